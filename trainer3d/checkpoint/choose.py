"""Which checkpoint a run resumes from, and whether it fits the run: one function for the
submitting process (before launch, so a refusal costs no rank start-up) and for rank 0.

``train.resume=auto`` takes the newest checkpoint whose data match their checksums, skipping
newer broken ones (each named); an explicit path must be intact itself. ``never`` is refused
where checkpoints of an earlier run already lie: the new run's saves would sit among steps it
did not train, retention would delete its own newer saves in favour of the old run's higher
steps, and its metrics.jsonl would replace the old one's; a new run gets a new run dir. Either way the
checkpoint's model (recorded in its marker) must be the run's: a different shape would fail
deep inside DCP with a size assertion, a different rope or norm setting would silently train
another function. Every differing key is named. A change of ``train.dtype`` is allowed:
tensors are converted on load (trainer3d/checkpoint/precision.py). ``auto`` continues only the
run's own checkpoints, and every resume only the data they were trained on (unless
``train.allow_data_change``): trainer3d/checkpoint/lineage.py.
"""

import dataclasses
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from trainer3d.checkpoint import store
from trainer3d.checkpoint.lineage import data_problem, run_problem
from trainer3d.checkpoint.store import CheckpointError
from trainer3d.config.schema import Config, ModelConfig, flatten

RESUME_FIX = "give a published step_<N> directory, auto or never"

IGNORED_MODEL_KEYS = ("name", "init_from", "init_std", "max_seq_len", "bos_token_id", "eos_token_ids")
"""Model fields a resume may change: labels, how a fresh model would start, the rotary table's
length (computed, never stored) and token ids used only when exporting."""


@dataclasses.dataclass
class Choice:
    step: int
    path: Path
    info: dict
    """The checkpoint's marker (step, layout, config, file digests)."""
    skipped: List[Tuple[Path, str]]
    """Newer checkpoints passed over by ``auto``, and why."""


def _with_head_dim(model: dict) -> dict:
    """``head_dim`` resolved (null means dim // n_heads), so an explicit equal value is no change."""
    dim, heads = model.get("dim"), model.get("n_heads")
    if model.get("head_dim") is None and isinstance(dim, int) and isinstance(heads, int) and heads > 0:
        model = {**model, "head_dim": dim // heads}
    return model


def model_changes(saved: dict, now: ModelConfig) -> List[str]:
    """``model.<key> <saved> -> <now>`` for every weight-relevant model field that differs."""
    current = flatten(_with_head_dim(dataclasses.asdict(now)), "model.")
    # A field the marker lacks (written before the field existed) had its default then.
    before = {**flatten(dataclasses.asdict(ModelConfig()), "model."), **flatten(_with_head_dim(dict(saved)), "model.")}
    ignored = tuple(f"model.{k}" for k in IGNORED_MODEL_KEYS)
    return [f"{key} {before.get(key)} -> {value}" for key, value in current.items()
            if not key.startswith(ignored) and before.get(key) != value]


def choose(cfg: Config, root: Path, verify_data: bool = True, exclude: Iterable[Path] = ()) -> Optional[Choice]:
    """The checkpoint to resume from (None: start fresh), or CheckpointError naming the knob.

    ``verify_data``: hash every data file too (the submitting process, before launch); the
    ranks check the rest here and share the hashing at load (trainer3d/checkpoint/verify.py).
    ``exclude``: checkpoints whose data failed that verification (``auto`` passes over them)."""
    want = cfg.train.resume
    if want == "never":
        earlier = store.published(root)
        if earlier:
            raise CheckpointError(
                f"train.resume=never, but {root} holds {len(earlier)} checkpoint(s) of an earlier run (newest "
                f"{earlier[-1][1].name}); set train.resume=auto to continue that run, or give this run a new "
                "hydra.run.dir=... to start over")
        return None
    skipped: List[Tuple[Path, str]] = []
    if want == "auto":
        found = store.latest_complete(root, skipped, verify_data, exclude)
        if found is None and skipped:  # only damaged ones: starting over would silently drop the run
            raise CheckpointError(
                f"train.resume=auto: no checkpoint under {root} passes its checks ("
                + "; ".join(f"{path}: {why}" for path, why in skipped)
                + "); give this run a new hydra.run.dir=... to start over from step 0, or train.resume=<path> of a good copy")
        if found is None:
            return None
        path, knob = found[1], f"train.resume=auto (checkpoint {found[1]})"
    else:
        path = store.require_complete(want, "train.resume", fix=RESUME_FIX, verify_data=verify_data)
        knob = f"train.resume={path}"
    info = store.read_marker(path)
    saved_model = info.get("config", {}).get("model")
    if not isinstance(saved_model, dict):
        raise CheckpointError(f"{knob}: the checkpoint records no model config; start over in a new "
                              "hydra.run.dir=...")
    changes = model_changes(saved_model, cfg.model)
    if changes:
        raise CheckpointError(f"{knob} holds a different model: {', '.join(changes)}; set these model.* knobs as "
                              "the checkpoint has them, or start fresh in a new hydra.run.dir=...")
    problem = (run_problem(info, cfg, knob, root) if want == "auto" else None) or data_problem(info, cfg, knob)
    if problem:
        raise CheckpointError(problem)
    saved_optim = info.get("config", {}).get("optim", {}).get("name", "adamw")  # a marker before Muon: AdamW
    if saved_optim != cfg.optim.name:
        raise CheckpointError(
            f"{knob} was trained with optim.name={saved_optim}, this run sets optim.name={cfg.optim.name}: AdamW "
            "keeps two moments per weight and Muon one momentum buffer per matrix, and neither converts into the "
            f"other; set optim={saved_optim} to resume, or start fresh in a new hydra.run.dir=...")
    return Choice(int(info["step"]), Path(path), info, skipped)
