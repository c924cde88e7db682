#!/usr/bin/env python
"""Start-up cost of one rank: its parameters materialised and initialised, nothing else.

    python tools/bench/init.py [--model 7b] [--tp 8] [--pp 4] [--dtype bf16] [--rank 0]

A fresh child process builds one rank's chunks (``--rank``, global: tp fastest, so rank 0
is pipeline stage 0, tp rank 0) of conf/model/<model>.yaml on the CPU as the trainer does
(``build_model_chunks``: meta device, stage split, tensor-parallel layers, ``to_empty``,
the layout-independent random init), then draws the same number of normal values with one
generator into a reused buffer: the least any initialisation of that shard costs. It prints

- shard: the bytes of the rank's parameters, in ``--dtype``;
- peak RSS above start: the child's peak resident set (VmHWM) minus its resident set
  before the build, and its ratio to the shard bytes;
- build CPU s: CPU seconds of the build (on one thread; CPU time, not wall time, so that
  other work on a shared machine does not move it), and its ratio to the reference.

Measured on the 2-core development machine under load from other jobs (torch 2.13, CPU,
2026-11-22), ``python tools/bench/init.py --model 7b --tp 8 --pp 4 --dtype bf16``:

    7b tp=8 pp=4 rank 0 (pp 0, tp 0): 218.8M parameters, shard 417.4 MiB bf16
    peak RSS above start 0.49 GiB (1.20 x shard)
    build CPU s 2.64, normal draws of the shard 0.56 (4.68 x)

and with ``--rank 7`` (pp 0, tp 7, whose slices end at the matrices' ends): 0.51 GiB
(1.24 x), 5.47 CPU s (8.26 x). When every tp rank drew each full matrix and kept its slice:
1.01 GiB (2.48 x), 11.99 CPU s (21.2 x) on rank 0, the same on rank 7. README.md
("Start-up") explains the costs.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import model_preset  # noqa: E402
from trainer3d.config.schema import Config  # noqa: E402
from trainer3d.memory.states import planning_dims  # noqa: E402
from trainer3d.parallel.parallelize import build_model_chunks  # noqa: E402
from trainer3d.observe.telemetry import peak_rss_bytes  # noqa: E402

_REFERENCE_CHUNK = 1 << 22  # values per draw of the reference


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def build_rank(model: str, tp: int, pp: int, dtype: str, rank: int = 0) -> dict:
    """Build global rank ``rank``'s chunks in this process; its figures (see the module docstring)."""
    cfg = Config(model=model_preset(model))
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = tp, pp, 1
    cfg.train.dtype, cfg.train.grad_accum_steps = dtype, max(pp, 1)
    dims = replace(planning_dims(cfg, rank), device=torch.device("cpu"))
    start_rss = _rss_bytes()
    cpu = time.process_time()
    chunks = build_model_chunks(cfg, dims)
    build_s = time.process_time() - cpu
    peak = peak_rss_bytes() - start_rss
    params = [p for chunk in chunks for p in chunk.parameters()]
    numel = sum(p.numel() for p in params)
    shard = sum(p.numel() * p.element_size() for p in params)
    del chunks, params
    buffer, generator = torch.empty(_REFERENCE_CHUNK), torch.Generator().manual_seed(0)
    cpu = time.process_time()
    for start in range(0, numel, _REFERENCE_CHUNK):
        n = min(_REFERENCE_CHUNK, numel - start)
        torch.randn(n, generator=generator, out=buffer[:n])
    reference_s = time.process_time() - cpu
    return {"numel": numel, "shard_bytes": shard, "peak_above_start": peak, "build_cpu_s": build_s,
            "reference_cpu_s": reference_s}


def measure(model: str, tp: int, pp: int, dtype: str, rank: int = 0, timeout: float = 1200) -> dict:
    """``build_rank`` in a fresh child process (so its peak resident set is the build's own)."""
    cmd = [sys.executable, __file__, "--model", model, "--tp", str(tp), "--pp", str(pp), "--dtype", dtype,
           "--rank", str(rank), "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_init child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(args, figures: dict) -> str:
    shard, peak = figures["shard_bytes"], figures["peak_above_start"]
    return "\n".join([
        f"{args.model} tp={args.tp} pp={args.pp} rank {args.rank} (pp {args.rank // args.tp}, tp {args.rank % args.tp}): "
        f"{figures['numel'] / 1e6:.1f}M parameters, "
        f"shard {shard / 2**20:.1f} MiB {args.dtype}",
        f"peak RSS above start {peak / 2**30:.2f} GiB ({peak / shard:.2f} x shard)",
        f"build CPU s {figures['build_cpu_s']:.2f}, normal draws of the shard {figures['reference_cpu_s']:.2f} "
        f"({figures['build_cpu_s'] / figures['reference_cpu_s']:.2f} x)"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7b", help="a conf/model member")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--rank", type=int, default=0,
                        help="global rank to build (tp fastest: rank 7 of tp=8 is pp 0, tp 7)")
    parser.add_argument("--json", action="store_true", help="build in this process and print the figures as JSON")
    args = parser.parse_args()
    if args.json:
        # One thread: on a loaded machine OpenMP workers spin waiting for each other, which
        # would count as CPU time of whichever side happened to be unlucky.
        torch.set_num_threads(1)
        print(json.dumps(build_rank(args.model, args.tp, args.pp, args.dtype, args.rank)))
    else:
        print(report(args, measure(args.model, args.tp, args.pp, args.dtype, args.rank)))


if __name__ == "__main__":
    main()
