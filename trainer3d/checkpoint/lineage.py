"""Whose a checkpoint is and what it was trained on: the run, its branch, its data, its position.

Every marker (trainer3d/checkpoint/store.py) records, beside the model:

- ``run``: the run dir it was saved by (resolved). ``train.resume=auto`` continues only its
  own run: a ``checkpoint.dir`` shared by several runs (the points of a sweep, two runs given
  the same directory) holds another run's checkpoints, and resuming one would train another
  run's model, or nothing at all when it is already at ``train.max_steps``. Resuming another
  run's checkpoint on purpose is ``train.resume=<its path>``.
- ``resumed_from``: the checkpoint its branch started from (None for a fresh start). A run
  resumed from an explicit older checkpoint abandons the newer ones of its checkpoint dir:
  they are moved into ``<checkpoint dir>/abandoned/<time>-from-step_<N>/`` before the first
  step (``set_aside``), never deleted, so the next ``auto`` finds the new branch's saves and
  not the abandoned future, and retention never counts them.
- ``data``: the data's identity (trainer3d/data/identity.py). A resume onto other data (a
  token file re-made with another tokenizer, another file under the same name) is refused,
  naming what changed, unless ``train.allow_data_change=true`` says it is meant.
- ``samples``: the samples consumed, and ``global_batch_size``. The sampler reads global
  sample ``j`` by its index (trainer3d/data/sampler.py), so a resume continues from the
  recorded sample count whatever ``train.global_batch_size`` is now: no sample is read twice
  or skipped across a change of the batch size (``Origin``, trainer3d/data/sampler.py).
"""

import time
from pathlib import Path
from typing import Dict, List, Optional

from trainer3d.config.schema import Config
from trainer3d.data.identity import data_changes, data_identity, tokenizer_file_sha256
from trainer3d.data.sampler import Origin

ABANDONED = "abandoned"


def origin_of(info: Optional[dict], global_batch_size: int) -> Origin:
    """The data position a checkpoint's marker records (a marker without ``samples``: step x the
    batch its config records, as the sampler read it then, else x ``global_batch_size``; no
    checkpoint: the start)."""
    if not info:
        return Origin()
    step = int(info["step"])
    samples = info.get("samples")
    if type(samples) is not int or samples < 0:
        train = info.get("config", {}).get("train")
        batch = train.get("global_batch_size") if isinstance(train, dict) else None
        samples = step * (batch if type(batch) is int and batch > 0 else global_batch_size)
    return Origin(step, samples)


def run_record(cfg: Config) -> Dict[str, str]:
    return {"run_dir": str(Path(cfg.run_dir).expanduser().resolve())}


def marker_fields(cfg: Config, steps_done: int, origin: Origin, resumed_from: Optional[Path],
                  data: Dict[str, dict]) -> dict:
    """What a save adds to the marker: run, branch, data identity, data position."""
    return {"run": run_record(cfg), "resumed_from": str(resumed_from) if resumed_from else None, "data": data,
            "global_batch_size": cfg.train.global_batch_size,
            "samples": origin.samples_at(steps_done, cfg.train.global_batch_size)}


def run_problem(info: dict, cfg: Config, knob: str, root: Path) -> Optional[str]:
    """Why ``train.resume=auto`` must not continue the checkpoint ``info`` (another run's), or None."""
    saved = info.get("run")
    if not isinstance(saved, dict) or not isinstance(saved.get("run_dir"), str):
        return None  # a marker without a run record: nothing to compare
    mine = run_record(cfg)["run_dir"]
    if saved["run_dir"] == mine:
        return None
    return (f"{knob} belongs to another run (run dir {saved['run_dir']}, this run's is {mine}): checkpoint.dir={root} "
            "is shared; give each run its own checkpoint.dir (or leave it unset: <run dir>/checkpoints), or "
            "continue that checkpoint on purpose with train.resume=<its path>")


def data_problem(info: dict, cfg: Config, knob: str) -> Optional[str]:
    """Why the run's data is not the checkpoint's (without train.allow_data_change), or None."""
    saved = info.get("data")
    if not isinstance(saved, dict):
        return None  # a marker without a data record
    changes = data_changes(saved, data_identity(cfg))
    if not changes or cfg.train.allow_data_change:
        return None
    return (f"{knob} was trained on other data: {'; '.join(changes)}; point the data.* knobs at the data it was "
            "trained on, or set train.allow_data_change=true to continue on this data on purpose")


def tokenizer_problem(info: dict, tokenizer: Optional[Path], path: Path) -> Optional[str]:
    """Why ``tokenizer`` (the tokenizer.json the data path's header names now) is not the one the
    checkpoint at ``path`` was trained with, or None (also where the marker records no tokenizer)."""
    recorded = next((r for r in (info.get("data") or {}).values()
                     if isinstance(r, dict) and isinstance(r.get("tokenizer_sha256"), str)), None)
    if recorded is None or tokenizer is None:
        return None
    now = tokenizer_file_sha256(tokenizer)
    if now == recorded["tokenizer_sha256"]:
        return None
    return (f"checkpoint {path} was trained with tokenizer {recorded.get('tokenizer')} (sha256 "
            f"{recorded['tokenizer_sha256'][:12]}...), but the tokenizer its data path names now, {tokenizer}, "
            f"{'is unreadable' if now is None else f'differs (sha256 {now[:12]}...)'}; give the tokenizer it was "
            "trained with: --tokenizer FILE")


def set_aside(root: Path, resumed: Path, resumed_step: int, published: List) -> List[Path]:
    """Move the checkpoints of ``root`` that a resume from ``resumed`` abandons (the newer ones of
    the same directory; all of them when it lies elsewhere) into ``root/abandoned/...``; return
    their new paths."""
    same_dir = Path(resumed).resolve().parent == Path(root).resolve()
    doomed = [path for step, path in published if not same_dir or step > resumed_step]
    if not doomed:
        return []
    branch = Path(root) / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-from-{Path(resumed).name}"
    branch.mkdir(parents=True, exist_ok=True)
    moved = []
    for path in doomed:
        target = branch / path.name
        path.rename(target)
        moved.append(target)
    return moved
