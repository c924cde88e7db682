#!/usr/bin/env python
"""What a checkpoint costs the training loop, and what its integrity checks cost.

    python tools/bench/checkpoint.py [--repeats 2] [--dir /tmp] [--dim 512 --layers 8]

One run of 2 local gloo ranks (dp2, ZeRO-1, ~25M parameters at the defaults, a save every
4 steps, a metrics row every step) trains the same model --repeats times each way,
interleaved, and times between them a plain save of the same state:

  async  checkpoint.async_save=true: the loop stages the state, the rest runs in the background
  sync   checkpoint.async_save=false: the loop waits for the whole save (write, hash, read-back)
  plain  torch.distributed.checkpoint.save of the same rank state with DCP's FileSystemWriter
         (fsync, no checksums), between barriers: the reference

The stall of a save is the interval between the rows of the saving step and the next
(``step_time_s`` of the next row) minus the median of the plain steps' (rows without a
save); ``ckpt_write_s`` is the background time. Then the verification before a load: the
checkpoint's data hashed by every rank, each file once (trainer3d/checkpoint/verify.py),
next to one process hashing all of it with SHA-256 (what the submitting process and then
rank 0 did before XXH3-128) and with XXH3-128 (the submitting process's check), each with
the files' pages dropped from the page cache first; and the checksums' speed in memory.
The last line is the figure docs/checkpoints.md holds to 0.5 or less:

    stall ratio (async stall / plain DCP save): 0.12
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import trainer3d.config.composed  # noqa: E402,F401  (registers the schema in the ConfigStore)
from trainer3d.checkpoint import digest, store  # noqa: E402
from trainer3d.checkpoint.precision import load_passes  # noqa: E402
from trainer3d.checkpoint.state import rank_state  # noqa: E402
from trainer3d.checkpoint.verify import shared_problem  # noqa: E402
from trainer3d.config.validate import validate  # noqa: E402
from trainer3d.preflight.data_checks import check_data  # noqa: E402
from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.parallel.tied import drop_tied_copies  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402
from trainer3d.trainer import Trainer  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"
MODES = ("async", "sync")


def _config(run_dir: Path, args: argparse.Namespace, mode: str):
    overrides = ["parallel=single", "parallel.dp=2", "parallel.zero_stage=1", f"model.dim={args.dim}", f"model.n_layers={args.layers}",
                 "model.n_heads=8", "model.n_kv_heads=4", f"model.ffn_dim={3 * args.dim}", "train.seq_len=64",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "train.grad_accum_steps=null",
                 f"train.max_steps={args.steps}", "train.log_every=1", "checkpoint.every=4", "checkpoint.keep=1",
                 "checkpoint.save_final=false", f"checkpoint.async_save={mode == 'async'}", "logger.mode=disabled",
                 f"run_dir={run_dir}", f"launcher.folder={run_dir / 'submitit'}"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = validate(OmegaConf.to_object(compose(config_name="config", overrides=overrides)))
    problems = check_data(cfg)  # also prepares the built-in corpus's token files once
    assert not problems, problems
    return cfg


def _drop_page_cache(path: Path) -> None:
    for file in Path(path).iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _rank(rank: int, world: int, cfgs: Dict[str, List[object]], plain_root: Path) -> dict:
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=world), torch.device("cpu"))
    out: Dict[str, List[float]] = {"plain": [], "verify": []}
    trainer = None
    for runs in zip(*(cfgs[mode] for mode in MODES)):
        for cfg in runs:
            trainer = Trainer(cfg, dims)
            trainer.train()
        state = drop_tied_copies(rank_state(trainer.optimizer, dims, trainer.checkpointer.pieces), dims)
        target = plain_root / f"plain{len(out['plain'])}"
        dist.barrier()
        started = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)))
        dist.barrier()
        out["plain"].append(time.perf_counter() - started)
        shutil.rmtree(target, ignore_errors=True)
    path = store.published(trainer.checkpointer.root)[-1][1]
    metadata, recorded = store.read_metadata(path), store.read_marker(path)["files"]
    passes, _ = load_passes(rank_state(trainer.optimizer, dims, trainer.checkpointer.pieces),
                            metadata.state_dict_metadata)
    if rank == 0:
        _drop_page_cache(path)
    dist.barrier()
    started = time.perf_counter()
    assert shared_problem(path, recorded, passes, metadata, rank, world) is None
    dist.barrier()
    out["verify"].append(time.perf_counter() - started)
    return out


def _stalls(run_dir: Path) -> Dict[str, List[float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plain = statistics.median(r["step_time_s"] for r in rows[2:] if "ckpt_stall_s" not in r)
    return {"stall": [r["step_time_s"] - plain for r in rows if "ckpt_stall_s" in r],
            "loop_stall": [r["ckpt_stall_s"] for r in rows if "ckpt_stall_s" in r],
            "write": [r["ckpt_write_s"] for r in rows if "ckpt_write_s" in r], "step": [plain]}


def _hash_speeds(mb: int = 256) -> Dict[str, float]:
    """GB/s of each checksum over ``mb`` MiB in memory, one thread, best of 3 (BLAKE3 and CRC32C
    where their packages are installed: they are measured, not used)."""
    data = memoryview(os.urandom(1 << 20) * mb)
    kinds = {"XXH3-128 (xxhash)": xxhash.xxh3_128, "SHA-256 (hashlib)": hashlib.sha256}
    for name, module, attr in (("BLAKE3 (blake3)", "blake3", "blake3"), ("CRC32C (google-crc32c)", "google_crc32c",
                                                                          "Checksum")):
        try:
            kinds[name] = getattr(__import__(module), attr)
        except ImportError:
            pass
    speeds = {}
    for name, make in kinds.items():
        best = float("inf")
        for _ in range(3):
            started, h = time.perf_counter(), make()
            for i in range(0, len(data), 8 << 20):
                h.update(data[i:i + (8 << 20)] if "CRC32C" not in name else bytes(data[i:i + (8 << 20)]))
            best = min(best, time.perf_counter() - started)
        speeds[name] = len(data) / best / 1e9
    return speeds


def _one_process_hash(path: Path, kind: str) -> float:
    _drop_page_cache(path)
    started = time.perf_counter()
    for file in sorted(Path(path).iterdir()):
        if file.name != store.MARKER:
            digest.file_digest(file, kind)
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--steps", type=int, default=18, help="steps per run (saves after 4, 8, 12, 16)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where checkpoints go")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    try:
        cfgs = {mode: [_config(root / f"{mode}{r}", args, mode) for r in range(args.repeats)] for mode in MODES}
        results = run_ranks(_rank, 2, cfgs, root, timeout=3600, pg_timeout_s=600)
        figures = {mode: {} for mode in MODES}
        for mode in MODES:
            for r in range(args.repeats):
                for key, values in _stalls(root / f"{mode}{r}").items():
                    figures[mode].setdefault(key, []).extend(values)
        last = store.published(root / f"async{args.repeats - 1}" / "checkpoints")[-1][1]
        gb = sum(f.stat().st_size for f in last.iterdir()) / 1e9
        sha, xxh = _one_process_hash(last, "sha256"), _one_process_hash(last, digest.FILE_HASH)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = statistics.median(results[0]["plain"])
    med = {mode: {k: statistics.median(v) if v else float("nan") for k, v in f.items()} for mode, f in figures.items()}
    print(f"dp2 ZeRO-1, dim {args.dim} x {args.layers} layers, a save every 4 steps, {gb:.3f} GB per checkpoint; "
          f"medians over {args.repeats} run(s) of each mode; load {os.getloadavg()[0]:.1f}")
    print(f"plain step {med['async']['step']:.3f} s (async runs) / {med['sync']['step']:.3f} s (sync runs)")
    print(f"plain DCP save (same state, FileSystemWriter, between barriers): {plain:.3f} s")
    for mode in MODES:
        m = med[mode]
        print(f"{mode:5s}  stall per save {m['stall']:.3f} s (row interval - plain step; the loop's own ckpt_stall_s "
              f"{m['loop_stall']:.3f} s) | ckpt_write_s {m['write']:.3f} s | stall / plain DCP save "
              f"{m['stall'] / plain:.2f}")
    verify = statistics.median(results[0]["verify"])
    print(f"verification before a load, {gb:.3f} GB, pages dropped first: shared by 2 ranks (XXH3-128) {verify:.3f} s | "
          f"one process SHA-256 {sha:.3f} s ({gb / sha:.2f} GB/s; done twice before: submitting process + rank 0) | "
          f"one process XXH3-128 {xxh:.3f} s ({gb / xxh:.2f} GB/s)")
    print("checksums in memory, one thread: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in _hash_speeds().items()))
    print(f"stall ratio (async stall / plain DCP save): {med['async']['stall'] / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
