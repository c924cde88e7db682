#!/usr/bin/env python
"""torch's own 3D stack against this engine: the same model on tp2 x pp2 x dp2, one run.

    python tools/bench/native3d.py [--dim 256] [--layers 4] [--seq-len 128] [--micro-batch 4]
                                   [--grad-accum 4] [--steps 6] [--warmup 2]

8 gloo ranks (mesh pp x dp x tp = 2 x 2 x 2) build the bench model (tools/bench/common.py)
twice and train both, step by step in turn, so both see the same machine load:

- trainer3d: the trainer's own pieces for the default layout (conf/parallel/tp2-pp2-dp2.yaml:
  ``build_model_chunks``' Megatron-style tensor-parallel layers, the 1F1B ``Pipeline``, the
  ZeRO-1 flat-buffer optimizer, ``GradFinalizer``, the clip), in the trainer's step order;
- torch-native: the 1-rank model (the same initial values), cut into two pipeline stages
  (``torch.distributed.pipelining``: ``PipelineStage`` + ``Schedule1F1B``), each stage's
  blocks parallelised with DTensor (``parallelize_module``: ColwiseParallel on wq/wk/wv/w1/w3,
  RowwiseParallel on wo/w2, the embedding RowwiseParallel, the head ColwiseParallel with
  gathered logits) and sharded over dp with FSDP2 (``fully_shard`` per block and per stage,
  ``reshard_after_forward=False`` as torchtitan does under a pipeline: its micro-batches
  would otherwise gather every block again), torch's AdamW, and the global-norm clip over
  the DTensor gradients (one all-reduce of the squares, as torchtitan's pipeline clip does).

Each step is ``--grad-accum`` micro-batches forward and backward, the gradient reduction,
the clip at 1.0 and an AdamW step. The table gives each one's median step time (the slowest
rank's, after ``--warmup`` steps) and the loss at the last step (the same model trains
alike; the optimizers' arithmetic differs in rounding only); the last line is
torch-native / trainer3d step time (issue 25's goal: 1.6 or more). On the shared 2-core
development machine 8 ranks time-slice two cores: run it on an idle machine.
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import add_model_arguments, bench_config  # noqa: E402
from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.model.init import init_parameters  # noqa: E402
from trainer3d.model.transformer import Transformer, cross_entropy_loss  # noqa: E402
from trainer3d.parallel.finalize import GradFinalizer  # noqa: E402
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer  # noqa: E402
from trainer3d.parallel.pipeline.schedule import Pipeline  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402
from trainer3d.trainer import MicroBatchLoss  # noqa: E402

TP, PP, DP = 2, 2, 2
LR = 1e-3


def _config(args):
    cfg = bench_config(args)
    p, t = cfg.parallel, cfg.train
    p.tp, p.pp, p.dp, p.zero_stage = TP, PP, DP, 1
    t.grad_accum_steps, t.global_batch_size = args.grad_accum, args.micro_batch * args.grad_accum * DP
    cfg.optim.lr = LR
    return cfg


def _trainer3d(cfg, dims):
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, cfg.parallel.sequence_parallel)
    micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps, optimizer)
    pipeline = Pipeline(chunks, micro_loss, cfg, dims)

    def step(inputs, targets):
        optimizer.zero_grad()
        pipeline.forward_backward(inputs if dims.is_first_stage else None, targets if dims.is_last_stage else None)
        loss = micro_loss.losses.take_mean()
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(LR)
        return loss
    return step


def _stage_module(cfg, pp_rank: int) -> Transformer:
    """The 1-rank model, initialised as trainer3d initialises it, holding stage ``pp_rank``'s half."""
    model = Transformer(cfg.model)
    init_parameters(model, cfg.model, cfg.train.seed)
    n = cfg.model.n_layers
    keep = range(0, n // PP) if pp_rank == 0 else range(n // PP, n)
    for i in [k for k in model.layers.keys() if int(k) not in keep]:
        del model.layers[i]
    if pp_rank == 0:
        model.norm, model.output = None, None
    else:
        model.tok_embeddings, model.embeds_tokens = None, False
    return model


def _native(cfg, dims, mesh):
    model = _stage_module(cfg, dims.pp_rank)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for i in model.layers.keys():
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95), eps=1e-8)
    # The last stage returns the logits as a batch-first view (model/transformer.py); nothing writes into it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    stage = PipelineStage(model, dims.pp_rank, PP, torch.device("cpu"), group=dims.pp_group)
    losses = []

    def loss_fn(output, target):
        loss = cross_entropy_loss(output, target)
        losses.append(loss.detach())
        return loss

    schedule = Schedule1F1B(stage, cfg.train.grad_accum_steps, loss_fn=loss_fn)

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        losses.clear()
        if dims.is_first_stage:
            schedule.step(inputs.flatten(0, 1))
        else:
            schedule.step(target=targets.flatten(0, 1))
        _clip(model, 1.0, dims)
        optimizer.step()
        return torch.stack(losses).mean() if losses else None
    return step


def _clip(model, max_norm: float, dims) -> None:
    """The global gradient norm over the DTensor gradients of this stage and the other: the
    squares of each rank's shard, a gradient replicated over tp counted by one tp rank's
    share, summed over the world in one all-reduce; every gradient scaled in place."""
    locals_, sq = [], torch.zeros(())
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        tp_sharded = isinstance(p.grad, DTensor) and "tp" in (p.grad.device_mesh.mesh_dim_names or ())
        sq = sq + g.pow(2).sum() / (1 if tp_sharded else TP)
        locals_.append(g)
    dist.all_reduce(sq)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    torch._foreach_mul_(locals_, coef)


def _rank(rank, world, args):
    dims = ParallelDims.build(Topology(tp=TP, pp=PP, dp=DP), torch.device("cpu"))
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    cfg = _config(args)
    variants = {"trainer3d": _trainer3d(cfg, dims), "torch-native": _native(cfg, dims, mesh)}
    times = {name: [] for name in variants}
    last = {}
    for i in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * i + dims.dp_rank)  # every tp and pp rank of a replica alike
        tokens = torch.randint(0, 257, (args.grad_accum, args.micro_batch, args.seq_len + 1), generator=g)
        inputs, targets = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
        for name, step in (variants.items() if i % 2 == 0 else reversed(variants.items())):
            dist.barrier()
            started = time.perf_counter()
            loss = step(inputs, targets)
            elapsed = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i >= args.warmup:
                times[name].append(elapsed.item())
            if loss is not None:
                last[name] = loss.item()
    return {name: (statistics.median(t), last.get(name)) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, steps=6)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (1F1B: at least 2)")
    args = parser.parse_args(argv)
    out = run_ranks(_rank, TP * PP * DP, args, timeout=3600, pg_timeout_s=600)
    losses = {name: next(r[name][1] for r in out if r[name][1] is not None) for name in out[0]}
    print(f"tp={TP} pp={PP} dp={DP} (1F1B, {args.grad_accum} micro-batches), dim {args.dim}, {args.layers} layers, "
          f"{args.micro_batch} x {args.seq_len} tokens per micro-batch, {args.steps} timed steps")
    print(f"{'variant':<14} {'median step ms':>15} {'loss at last step':>18}")
    for name, (median, _) in out[0].items():
        print(f"{name:<14} {median * 1e3:>15.1f} {losses[name]:>18.4f}")
    print(f"torch-native / trainer3d: {out[0]['torch-native'][0] / out[0]['trainer3d'][0]:.2f} x step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
