"""Which documents fed a training step: the samples, token ranges and token ids of step N.

    trainer3d-provenance outputs/my-run --step 1200            # every data-parallel rank
    trainer3d-provenance outputs/my-run --step 1200 --rank 1 --json

A step's data is a function of the seed, the data and the samples consumed before it
(trainer3d/data/sampler.py), so the tool recomputes it from what the run dir records and
reads nothing else: the checkpoints' markers (each holds the config of the run that saved it,
its data identity, and the samples consumed at its step, whatever the global batch was), the
run's last launch config (``.hydra/config.yaml``) for steps after the newest checkpoint, and
``skipped_steps.json``. The segment of the run that trained step N is the one whose saves
bracket it: the first checkpoint after N whose own run started (``resumed_from``) at or
before N gives the batch size, the layout and the data position; a step after every
checkpoint is the last launch's, continuing from the newest checkpoint at or before it. So
the answer holds across resumes (a changed global batch, a changed layout), requeues and
rollbacks (set-aside checkpoints are not read: their branch was abandoned). A skipped step
read no batch: the tool says so and prints what it would have read.

For each data-parallel rank: each sample's global index, its token file, the token range
``[start, end)`` of its window (seq_len + 1 ids: the inputs are the first seq_len, the
targets the last), the documents it covers (by index in the file: a document ends at each
end-of-document id, data.eos_id; none where the file has no such id) and the ids.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
from omegaconf import OmegaConf

from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.data.identity import data_changes, data_identity
from trainer3d.data.loader import BatchReader, build_readers
from trainer3d.data.sampler import Origin
from trainer3d.data.skips import read_skip_log


class ProvenanceError(ValueError):
    pass


def config_from(record: dict, run_dir: Path) -> Config:
    """A Config from a recorded dict (a marker's ``config``, a launch's config.yaml)."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in record.items() if k != "hydra"})
    merged.run_dir, merged.launcher.folder = str(run_dir), str(run_dir)  # Hydra's interpolations: no Hydra here
    return OmegaConf.to_object(merged)


def markers(root: Path) -> List[dict]:
    """The published checkpoints' markers, by step."""
    return [store.read_marker(path) for _, path in store.published(root)]


def _started_at(info: dict) -> int:
    resumed = info.get("resumed_from")
    if not resumed:
        return 0
    name = Path(resumed).name
    return int(name.split("_")[-1]) if name.startswith("step_") else 0


def segment_of(run_dir: Path, root: Path, step: int) -> Tuple[Config, Origin, str]:
    """(the config that trained ``step``, the data position its run counted from, where both came from)."""
    found = markers(root) if root.is_dir() else []
    for info in found:
        if info["step"] > step and _started_at(info) <= step:
            cfg = config_from(info["config"], run_dir)
            batch = int(info.get("global_batch_size") or cfg.train.global_batch_size)
            samples = int(info["samples"]) - (info["step"] - step) * batch
            return cfg, Origin(step, samples), f"checkpoint step {info['step']}'s marker"
    launch = run_dir / ".hydra" / "config.yaml"
    before = [info for info in found if info["step"] <= step]
    if launch.is_file():
        cfg = config_from(OmegaConf.to_container(OmegaConf.load(launch)), run_dir)
        source = str(launch)
    elif before:
        cfg, source = config_from(before[-1]["config"], run_dir), f"checkpoint step {before[-1]['step']}'s marker"
    else:
        raise ProvenanceError(f"{run_dir} records no config: neither a checkpoint in {root} nor .hydra/config.yaml "
                              "(give the run dir the trainer wrote)")
    origin = Origin(before[-1]["step"], int(before[-1]["samples"])) if before else Origin()
    return cfg, origin, source


def documents_of(tokens, eos_id: Optional[int], start: int, end: int) -> List[int]:
    """Indices of the documents tokens ``[start, end)`` lie in (each ends at an ``eos_id``)."""
    if eos_id is None:
        return []
    before = 0
    for a in range(0, start, 1 << 24):  # counted in pieces: the file is memory-mapped, not read whole
        before += int(np.count_nonzero(np.asarray(tokens[a:min(start, a + (1 << 24))]) == eos_id))
    inside = np.asarray(tokens[start:end]) == eos_id
    ends_before_last = int(np.count_nonzero(inside[:-1]))
    return list(range(before, before + ends_before_last + 1))


def rank_samples(cfg: Config, origin: Origin, step: int, dp_rank: int) -> List[dict]:
    """What data-parallel rank ``dp_rank`` read for ``step``: one record per sample."""
    reader: BatchReader = build_readers(cfg, cfg.parallel.dp, dp_rank)[0]
    reader.origin = origin
    per_rank = reader.micro * reader.accum
    first = origin.samples_at(step, reader.global_batch_size) + dp_rank * per_rank
    out = []
    for i, (k, w) in enumerate(zip(*[a.tolist() for a in reader.windows(step)])):
        start = reader.spans[k].start + w * reader.seq_len
        end = start + reader.seq_len + 1
        record = {"sample": first + i, "file": str(reader.paths[k]), "window": w, "tokens": [start, end]}
        if step in reader.corrupt:  # train.inject.corrupt_steps: the drill's random ids
            ids = reader.random_window(step, step * reader.global_batch_size + dp_rank * per_rank + i)
            record.update(documents=[], ids=ids.tolist(), drill="train.inject.corrupt_steps: uniformly random ids")
        else:
            record.update(documents=documents_of(reader.tokens[k], reader.eos_ids[k], start, end),
                          ids=np.asarray(reader.tokens[k][start:end]).tolist())
        out.append(record)
    return out


def provenance(run_dir: Path, step: int, rank: Optional[int] = None, checkpoint_dir: Optional[Path] = None) -> dict:
    run_dir = Path(run_dir)
    root = Path(checkpoint_dir) if checkpoint_dir else run_dir / "checkpoints"
    cfg, origin, source = segment_of(run_dir, root, step)
    if not 0 <= step < cfg.train.max_steps:
        raise ProvenanceError(f"--step {step} is not a step of this run (0 <= step < train.max_steps="
                              f"{cfg.train.max_steps})")
    recorded = next((m.get("data") for m in (markers(root) if root.is_dir() else []) if m.get("data")), None)
    changed = data_changes(recorded, data_identity(cfg)) if recorded else []
    if changed:
        raise ProvenanceError(f"the run's data changed since it trained: {'; '.join(changed)}; the tool reads the "
                              "token files the run recorded, so point it at those")
    skipped = step in set(read_skip_log(str(run_dir))["steps"]) | set(cfg.train.skip_steps)
    ranks = range(cfg.parallel.dp) if rank is None else [rank]
    if rank is not None and not 0 <= rank < cfg.parallel.dp:
        raise ProvenanceError(f"--rank {rank}: the run had {cfg.parallel.dp} data-parallel ranks (0..{cfg.parallel.dp - 1})")
    return {"step": step, "from": source, "samples_before_step": origin.samples_at(step, cfg.train.global_batch_size),
            "global_batch_size": cfg.train.global_batch_size, "dp": cfg.parallel.dp,
            "skipped": skipped, "ranks": {r: rank_samples(cfg, origin, step, r) for r in ranks}}


def _print(result: dict) -> None:
    print(f"step {result['step']}: global batch {result['global_batch_size']} over dp {result['dp']}, after "
          f"{result['samples_before_step']} samples (from {result['from']})"
          + ("; SKIPPED (skipped_steps.json): no rank read this batch" if result["skipped"] else ""))
    for r, samples in result["ranks"].items():
        print(f"dp rank {r}:")
        for s in samples:
            docs = f"documents {s['documents'][0]}-{s['documents'][-1]}" if s["documents"] else "documents n/a"
            head = " ".join(map(str, s["ids"][:8]))
            print(f"  sample {s['sample']}: {s['file']} tokens [{s['tokens'][0]}, {s['tokens'][1]}) {docs}"
                  f"{' (' + s['drill'] + ')' if 'drill' in s else ''}: {head} ...")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's directory (hydra.run.dir)")
    parser.add_argument("--step", type=int, required=True, help="the step, numbered as in metrics.jsonl")
    parser.add_argument("--rank", type=int, default=None, help="one data-parallel rank (default: all)")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint.dir, where it is not <run_dir>/checkpoints")
    parser.add_argument("--json", action="store_true", help="print JSON (every id) instead of a summary")
    args = parser.parse_args(argv)
    try:
        result = provenance(Path(args.run_dir), args.step, args.rank, args.checkpoint_dir)
    except (ProvenanceError, store.CheckpointError, OSError) as err:
        print(f"trainer3d-provenance: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
