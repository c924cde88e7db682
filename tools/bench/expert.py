#!/usr/bin/env python
"""The all-to-all's share of a training step under expert parallelism, at ep 2 and ep 4.

    python tools/bench/expert.py [--ep 2 4] [--dim 256] [--layers 4] [--experts 8] [--top-k 2] [--steps 6]

For each ep, ``ep`` gloo ranks (dp = ep) build the benchmark's model with every block an MoE
of ``--experts`` SwiGLU experts (width dim, top-k routing) through ``build_model_chunks``,
so each rank holds experts / ep of them, and run full steps (forward, backward, gradient
finalisation, clipping, the ZeRO-1 step) on their own micro-batch. Every
``all_to_all_single`` call is timed on the host where it runs (gloo's is synchronous:
the call returns when this rank's part is done), the counts' exchange included; the table
gives the median step time (slowest rank), the all-to-all seconds in it (the slowest rank's)
and their ratio, each ep measured in the same run so the ratios share the machine's load.

On CPU gloo ranks of one host the all-to-all is a memory copy through loopback sockets;
on GPUs it crosses NVLink (inside a node) or the network (across nodes), where its share is
the figure that decides ep (docs/moe.md says what needs a GPU to measure).

Measured on the 2-core development machine (CPU, gloo, torch 2.13, shared with other work),
``python tools/bench/expert.py``:

    dim 256, 4 MoE layers of 8 experts (top-2), 4 x 128 tokens per rank per step, 6 timed steps, dp = ep
     ep  median step ms  all-to-all ms  share
      2          1767.1          651.3   0.37
      4          2377.7         1275.6   0.54

(2026-11-29.)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import add_model_arguments, bench_config  # noqa: E402
from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.parallel.finalize import GradFinalizer  # noqa: E402
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402


def _config(args, ep):
    cfg = bench_config(args)
    cfg.model.moe.num_experts, cfg.model.moe.top_k = args.experts, args.top_k
    cfg.model.moe.expert_ffn_dim = args.dim
    cfg.parallel.dp = cfg.parallel.ep = ep
    cfg.parallel.zero_stage = 1
    cfg.train.grad_accum_steps = 1
    return cfg


class _Timed:
    """``dist.all_to_all_single`` with the seconds of each call added up."""

    def __init__(self):
        self.seconds, self.inner = 0.0, dist.all_to_all_single

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        return out


def _rank(rank, world, args):
    cfg = _config(args, world)
    dims = ParallelDims.build(Topology.of(cfg.parallel), torch.device("cpu"))
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, cfg.parallel.sequence_parallel)
    loss_fn = build_loss_fn(cfg, dims)
    timed = _Timed()
    dist.all_to_all_single = timed  # parallel/expert/dispatch.py calls it through the module
    g = torch.Generator().manual_seed(rank)
    steps, shares = [], []
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, 257, (args.micro_batch, args.seq_len + 1), generator=g)
        dist.barrier()
        timed.seconds = 0.0
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(chunks[0](tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(1e-3)
        optimizer.wait_params()
        figures = torch.tensor([time.perf_counter() - started, timed.seconds])
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest rank's
        if i >= args.warmup:
            steps.append(figures[0].item())
            shares.append(figures[1].item())
    dist.all_to_all_single = timed.inner
    return statistics.median(steps), statistics.median(shares)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    add_model_arguments(parser, steps=6)
    args = parser.parse_args(argv)
    rows = {}
    for ep in args.ep:
        try:
            rows[ep] = run_ranks(_rank, ep, args, timeout=1800, pg_timeout_s=300)[0]
        except (RuntimeError, TimeoutError) as err:
            print(f"bench_expert: ep={ep}: {err}", file=sys.stderr)
            return 1
    print(f"dim {args.dim}, {args.layers} MoE layers of {args.experts} experts (top-{args.top_k}), "
          f"{args.micro_batch} x {args.seq_len} tokens per rank per step, {args.steps} timed steps, dp = ep")
    print(f"{'ep':>3} {'median step ms':>15} {'all-to-all ms':>14} {'share':>6}")
    for ep, (step, a2a) in rows.items():
        print(f"{ep:>3} {step * 1e3:>15.1f} {a2a * 1e3:>14.1f} {a2a / step:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
