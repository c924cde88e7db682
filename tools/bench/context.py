#!/usr/bin/env python
"""Context parallelism's two exchanges against each other: ring vs all-gather attention.

    python tools/bench/context.py [--cp 4] [--seq-lens 2048 8192] [--heads 8] [--kv-heads 2] [--head-dim 64]
                                  [--steps 6]

``cp`` gloo ranks each hold their load-balanced shard of one sequence (2·cp chunks,
trainer3d/data/cp_sharding.py) and run the cp attention forward and backward
(trainer3d/parallel/context/attention.py) with ``parallel.cp_attention=ring`` (key/value
blocks passed around the ring, the next hop in flight while the current block computes)
and ``all_gather`` (every block at once; backward gathers again and reduce-scatters the
key/value gradients), interleaved step by step so both see the same machine load. The
table shows the median over steps of the slowest rank's time, and the ratio
all_gather / ring (above 1: the ring is faster); both outputs are checked equal.

Measured on the 2-core development machine (CPU, gloo, torch 2.13, one thread per rank,
the machine shared by other sessions: times noisy, ratios less so), ``nice -n 5 python
tools/bench/context.py`` (see docs/context_parallel.md for the figures).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.parallel.context.attention import MODES, CPGroup, context_attention  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402


def _step(q, k, v, dout, cp: CPGroup) -> torch.Tensor:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = context_attention(q, k, v, cp)
    out.backward(dout)
    return out.detach()


def _bench(rank: int, world: int, args) -> dict:
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1, cp=world), torch.device("cpu"))
    groups = {mode: CPGroup(dims.cp_group, world, dims.cp_rank, mode) for mode in MODES}
    out = {}
    for seq in args.seq_lens:
        g = torch.Generator().manual_seed(rank)
        local = seq // world
        q, dout = (torch.randn(1, args.heads, local, args.head_dim, generator=g) for _ in range(2))
        k, v = (torch.randn(1, args.kv_heads, local, args.head_dim, generator=g) for _ in range(2))
        times = {mode: [] for mode in MODES}
        results = {}
        for step in range(args.warmup + args.steps):
            for mode in MODES:
                dist.barrier(group=dims.cp_group)
                start = time.perf_counter()
                results[mode] = _step(q, k, v, dout, groups[mode])
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=dims.cp_group)  # the slowest rank
                if step >= args.warmup:
                    times[mode].append(elapsed.item())
        diff = (results["ring"] - results["all_gather"]).abs().max().item()
        out[seq] = {mode: statistics.median(t) for mode, t in times.items()} | {"diff": diff}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    result = run_ranks(_bench, args.cp, args, timeout=1800)[0]
    print(f"cp={args.cp}, {args.heads} heads ({args.kv_heads} kv), head_dim {args.head_dim}, fp32, "
          f"forward + backward of one attention, {args.steps} timed steps")
    print(f"{'tokens':>8} {'ring ms':>9} {'all_gather ms':>14} {'all_gather / ring':>18} {'max |diff|':>11}")
    for seq, r in result.items():
        print(f"{seq:>8} {1e3 * r['ring']:>9.1f} {1e3 * r['all_gather']:>14.1f} "
              f"{r['all_gather'] / r['ring']:>18.2f} {r['diff']:>11.1e}")


if __name__ == "__main__":
    main()
