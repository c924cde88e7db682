"""The rules of ``data.*`` among themselves and the evaluation they feed, part of ``validate``
(trainer3d/config/validate.py); the files are checked before launch by trainer3d.preflight.data_checks.
"""

from typing import List

from trainer3d.config.schema import Config, TrainConfig


def data_problems(cfg: Config) -> List[str]:
    """The data knobs among themselves, and evaluation knobs that need validation data."""
    d, problems = cfg.data, []
    if d.name == "tokens" and not d.path and not d.blend:
        problems.append("data=tokens needs data.path=<file.bin> or data.blend=[{path: ..., weight: ...}, ...] "
                        "(make token files with tools/prepare_data.py)")
    if d.path and d.blend:
        problems.append("data.path and data.blend are both set; give one (a blend lists every file)")
    if d.blend and d.name != "tokens":
        problems.append(f"data.blend needs data=tokens (data={d.name} has a corpus of its own)")
    for i, source in enumerate(d.blend):
        if not source.weight > 0:
            problems.append(f"data.blend[{i}].weight={source.weight} must be > 0")
    if d.loss_mask and d.name == "stdlib":
        problems.append("data.loss_mask=true needs token files with a loss mask (trainer3d-prepare-data --chat "
                        "writes one) or data=chat_sample; the built-in corpus (data=stdlib) has none")
    if d.val_fraction > 0 and d.val_path:
        problems.append("data.val_fraction and data.val_path are both set; give one (or set data.val_fraction=0)")
    _check_eval(cfg, problems)
    return problems


def _check_eval(cfg: Config, problems: List[str]) -> None:
    """Evaluation knobs set (away from their defaults) with no validation data to evaluate on
    would be ignored without a word: refused, naming the data knobs that give it some."""
    t, d, default = cfg.train, cfg.data, TrainConfig()
    if d.val_fraction > 0 or d.val_path or t.eval_every == 0:
        return
    given = [f"train.{k}={getattr(t, k)}" for k in ("eval_every", "eval_steps") if getattr(t, k) != getattr(default, k)]
    if given:
        problems.append(f"{' and '.join(given)} but there is no validation data: set data.val_fraction (e.g. 0.01) "
                        "or data.val_path=<file.bin>, or train.eval_every=0 for no evaluation")
