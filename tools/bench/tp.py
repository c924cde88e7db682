#!/usr/bin/env python
"""Our tensor parallelism against torch's DTensor TP, on the same model in one run.

    python tools/bench/tp.py [--tp 2] [--dim 256] [--layers 4] [--steps 8] [--seq-len 128] [--micro-batch 4]

``tp`` gloo ranks build the same Llama-style model twice, interleaving the two variants step
by step so both see the same machine load:

- ours: ``trainer3d.parallel.parallelize.build_model_chunks`` (column/row-parallel layers on plain
  tensors with autograd communication functions, vocabulary-parallel embedding, head and
  cross-entropy) and the flat-buffer stage-0 optimizer, as the trainer runs it;
- DTensor: the 1-rank model after ``parallelize_module`` with ColwiseParallel on wq/wk/wv/
  w1/w3, RowwiseParallel on wo/w2, the embedding RowwiseParallel and the head
  ColwiseParallel with replicated (gathered) logits — the way torch's own tutorial
  parallelises a Llama block — and ``torch.optim.AdamW`` over the DTensor parameters.

Each step is a forward, backward, gradient clip and AdamW step on one micro-batch. The table
shows each one's median step time (slowest rank) and the ratio DTensor / ours; both losses
at the last step are printed so a reader can see they train the same model.

Measured on the 2-core development machine (CPU, gloo, torch 2.13; machine shared, so times
are noisy, ratios less so), ``python tools/bench/tp.py``:

    tp=2, dim 256, 4 layers, 8 heads, vocab 257, 4 x 128 tokens per step, 8 timed steps
    variant       median step ms  loss at last step
    ours                   204.0             5.6133
    DTensor TP             328.9             5.6133
    DTensor / ours: 1.61 x step time

(2026-11-22.)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import add_model_arguments, bench_config  # noqa: E402
from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.model.init import init_parameters  # noqa: E402
from trainer3d.model.transformer import Transformer, cross_entropy_loss  # noqa: E402
from trainer3d.parallel.finalize import GradFinalizer  # noqa: E402
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks  # noqa: E402
from trainer3d.parallel.zero.flat import ReplicatedOptimizer  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402


def _config(args):
    cfg = bench_config(args)
    cfg.parallel.tp, cfg.parallel.dp = args.tp, 1
    cfg.train.grad_accum_steps = 1
    return cfg


def _ours(cfg, dims):
    chunks = build_model_chunks(cfg, dims)
    optimizer = ReplicatedOptimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, cfg.parallel.sequence_parallel)
    loss_fn = build_loss_fn(cfg, dims)

    def step(tokens, targets):
        optimizer.zero_grad()
        loss = loss_fn(chunks[0](tokens), targets)
        loss.backward()
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(1e-3)
        return loss.detach()
    return step


def _dtensor(cfg, dims):
    model = Transformer(cfg.model)
    init_parameters(model, cfg.model, cfg.train.seed)
    mesh = dims.mesh["tp"]
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())}
    for i in model.layers.keys():
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)  # the plan's default layouts shard weights on dim 0 / 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(model(tokens), targets)
        loss.backward()
        _clip_mixed(model.parameters(), 1.0, dims.tp_group)
        optimizer.step()
        return loss.detach()
    return step


def _clip_mixed(parameters, max_norm, group):
    """clip_grad_norm_ over DTensor (sharded) and plain (replicated) gradients: torch's own
    refuses the mix. Sharded squares are summed over tp, replicated ones counted once."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor) and not g.placements[0].is_replicate()]
    replicated = [g.to_local() if isinstance(g, DTensor) else g for g in grads
                  if not (isinstance(g, DTensor) and not g.placements[0].is_replicate())]
    sq = torch.stack([g.pow(2).sum() for g in sharded]).sum()
    dist.all_reduce(sq, group=group)
    sq = sq + torch.stack([g.pow(2).sum() for g in replicated]).sum()
    scale = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)


def _rank(rank, world, args):
    dims = ParallelDims.build(Topology(tp=world, pp=1, dp=1), torch.device("cpu"))
    cfg = _config(args)
    variants = {"ours": _ours(cfg, dims), "DTensor TP": _dtensor(cfg, dims)}
    g = torch.Generator().manual_seed(0)
    times = {name: [] for name in variants}
    last = {}
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, 257, (args.micro_batch, args.seq_len), generator=g)
        targets = torch.randint(0, 257, (args.micro_batch, args.seq_len), generator=g)
        for name, step in variants.items():
            dist.barrier()
            started = time.perf_counter()
            last[name] = step(tokens, targets)
            elapsed = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i >= args.warmup:
                times[name].append(elapsed.item())
    return {name: (statistics.median(t), last[name].item()) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    add_model_arguments(parser, steps=8)
    args = parser.parse_args(argv)
    try:
        out = run_ranks(_rank, args.tp, args, timeout=1800, pg_timeout_s=300)[0]
    except (RuntimeError, TimeoutError) as err:
        print(f"bench_tp: {err}", file=sys.stderr)
        return 1
    print(f"tp={args.tp}, dim {args.dim}, {args.layers} layers, 8 heads, vocab 257, "
          f"{args.micro_batch} x {args.seq_len} tokens per step, {args.steps} timed steps")
    print(f"{'variant':<12} {'median step ms':>15} {'loss at last step':>18}")
    for name, (median, loss) in out.items():
        print(f"{name:<12} {median * 1e3:>15.1f} {loss:>18.4f}")
    ratio = out["DTensor TP"][0] / out["ours"][0]
    print(f"DTensor / ours: {ratio:.2f} x step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
