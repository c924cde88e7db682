#!/usr/bin/env python
"""What checkpoint checksums cost: save and verified load with and without them, one rank.

    python tools/bench/checkpoint.py [--mb 512] [--repeats 3] [--dir /tmp]

Saves ``--mb`` MiB of fp32 tensors (64 MiB each) with DCP's plain FileSystemWriter and with
the engine's CheckpointWriter (SHA-256 of every byte on its way to disk, then a read-back),
then times the load-time verification (``store.is_complete``: every file hashed against the
marker) next to a plain DCP load of the same data. Prints seconds per GB and the ratios
against the plain save/load of the same process; the best of ``--repeats``. Files come from
the page cache on the read-back, as they would right after a save; a cold read adds the
disk's own read time.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer3d.checkpoint import store  # noqa: E402
from trainer3d.checkpoint.digest import file_digest  # noqa: E402
from trainer3d.checkpoint.writer import CheckpointWriter  # noqa: E402


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    state = {f"t{i}": torch.randn(16 << 20) for i in range(max(1, args.mb // 64))}
    gb = sum(t.numel() * 4 for t in state.values()) / 1e9
    root = Path(tempfile.mkdtemp(dir=args.dir))
    plain, ours = root / "plain", store.step_dir(root, 1)

    def save_plain():
        shutil.rmtree(plain, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(plain)), no_dist=True)

    def save_ours():
        shutil.rmtree(ours, ignore_errors=True)
        partial = store.partial_dir(root, 1)
        writer = CheckpointWriter(str(partial))
        dcp.save(state, storage_writer=writer, no_dist=True)
        store.publish(partial, ours, {"step": 1, "files": writer.digests})

    def load_plain():
        dcp.load({k: torch.empty_like(v) for k, v in state.items()}, checkpoint_id=str(plain), no_dist=True)

    try:
        t_plain, t_ours = _best(save_plain, args.repeats), _best(save_ours, args.repeats)
        t_load, t_verify = _best(load_plain, args.repeats), _best(lambda: store.is_complete(ours), args.repeats)
        t_hash = _best(lambda: [file_digest(p) for p in ours.glob("*.distcp")], args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{gb:.2f} GB of fp32 tensors, best of {args.repeats}")
    print(f"save    plain DCP {t_plain / gb:.2f} s/GB | with checksums + read-back {t_ours / gb:.2f} s/GB "
          f"| ratio {t_ours / t_plain:.2f}x")
    print(f"load    plain DCP {t_load / gb:.2f} s/GB | verification alone {t_verify / gb:.2f} s/GB "
          f"| verified load / plain load {(t_load + t_verify) / t_load:.2f}x")
    print(f"SHA-256 of the files (page cache) {t_hash / gb:.2f} s/GB = {gb / t_hash:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
