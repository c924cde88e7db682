"""Our ZeRO stages against torch's own, on the same model in one run.

    python tools/bench/zero.py [--dp 2] [--steps 10] [--dim 256] [--layers 4] [--bucket-mb 25]

Each of ``dp`` gloo ranks trains the same Llama-style model, one fresh copy per variant,
with the same micro-batches (grad_accum of them per step), gradient clipping and AdamW
(torch's fused kernel everywhere, so only the data-parallel machinery differs):

- stage 0: ours (flat buffers, buckets reduced from the backward hooks) vs torch DDP
  (``gradient_as_bucket_view=True``, ``no_sync`` on early micro-batches) + AdamW;
- stage 1: ours (flat-buffer shards, zero_reduce=auto) vs DDP + torch's
  ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)``;
- stage 1, ours: the parameter all-gather overlapped with the next forward (the default,
  trainer3d/parallel/zero/param_gather.py) vs waited for at the end of step(), with the host
  time each spends waiting for it.

Printed: median step time (slowest rank), optimizer-state bytes and model-state bytes
(parameters + gradients + optimizer state, tensor storages reachable from Python, each
counted once) on rank 0, and ours/torch ratios. DDP's own bucket copies are not counted
when they are gradient views (as here); torch's defaults would add 4Ψ more.

Measured on the 2-core development machine (CPU, gloo; shared with other jobs, so times
are noisy), ``python tools/bench/zero.py`` (dp=2, 3.3M parameters, 2 + 10 steps):

    dp=2, 3,279,616 parameters, grad_accum=2, micro_batch=4x128, 10 timed steps (median, slowest rank)
                                         step ms  optimizer MB  model state MB
    stage 0: ours                          390.0         25.02           50.04
    stage 0: DDP + AdamW                   385.3         25.02           50.04
    stage 1: ours                          400.1         12.51           37.53
    stage 1: DDP + ZeroRedundancyOptimizer 390.4         12.51           37.53
    stage 0 ours/DDP: step time 1.01x, optimizer bytes 1.000x, model-state bytes 1.000x
    stage 1 ours/ZeroRedundancyOptimizer: step time 1.02x, optimizer bytes 1.000x, model-state bytes 1.000x

(2026-11-22, load average ~5 from other jobs: step-time ratios within the noise of 1.0.)

The stage 1 gather alone, on a model where it is a larger share of the step (12.9M
parameters, one 64-token micro-batch, 4 MiB buckets), same machine, load average 7-14:

    python tools/bench/zero.py --gather-only --dim 512 --micro-batch 1 --seq-len 64 --grad-accum 1 --bucket-mb 4 --dp 2
    python tools/bench/zero.py ... --dp 4

    host time waiting for the gather per step   overlapped   in step()   ratio
    dp=2 (two runs)                               21.1 ms      67.0 ms    0.32x
                                                  19.9 ms      36.2 ms    0.55x
    dp=4 (two runs)                               75.8 ms     132.6 ms    0.57x
                                                  66.7 ms     106.1 ms    0.63x

The exposed gather shrinks to about half; step time moved 0.54x-1.22x (dp=2) and 0.76x-0.93x
(dp=4) between runs, i.e. within this loaded 2-core machine's noise: on CPU, gloo's threads
take the same cores the forward computes on, so hiding the wait frees little. With 25 MiB
buckets the first bucket waited for holds half the model and the wait shrinks less (0.56x);
at the default 3.3M-parameter size the gather is ~13 ms of a ~1.2 s step (0.79x).
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import add_model_arguments, bench_config  # noqa: E402
from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.model.transformer import cross_entropy_loss  # noqa: E402
from trainer3d.optim.schedule import param_groups  # noqa: E402
from trainer3d.parallel.parallelize import build_model_chunks, build_optimizer  # noqa: E402
from trainer3d.parallel.zero.flat import ShardedOptimizer  # noqa: E402
from trainer3d.observe.telemetry import storage_bytes  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402


def make_cfg(args):
    cfg = bench_config(args)
    cfg.parallel.dp, cfg.parallel.bucket_mb = args.dp, args.bucket_mb
    cfg.train.grad_accum_steps = args.grad_accum
    cfg.train.global_batch_size = args.micro_batch * args.grad_accum * args.dp
    return cfg


def batches(cfg, rank, steps):
    g = torch.Generator().manual_seed(rank)
    shape = (steps, cfg.train.grad_accum_steps, cfg.train.micro_batch_size, cfg.train.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return tokens[..., :-1], tokens[..., 1:]


class GatherAtStepEnd(ShardedOptimizer):
    """ZeRO-1 waiting for its parameter all-gather inside step(), timing that wait."""

    def __init__(self, chunks, cfg, dims):
        super().__init__(chunks, cfg, dims, overlap_gather=False)
        self.gather_wait_s = 0.0

    def _gather_params(self, defer=False):
        start = time.perf_counter()
        super()._gather_params(defer)
        self.gather_wait_s += time.perf_counter() - start


class Ours:
    def __init__(self, model, cfg, dims, stage, overlap=True):
        cfg.parallel.zero_stage = stage
        self.model = model
        self.opt = build_optimizer([model], cfg, dims) if overlap else GatherAtStepEnd([model], cfg, dims)

    def gather_wait_s(self) -> float:
        """Host time spent waiting for the stage-1 parameter all-gather so far."""
        if getattr(self.opt, "deferred", None) is not None:
            return self.opt.deferred.waited_s
        return getattr(self.opt, "gather_wait_s", 0.0)

    def forward_backward(self, inputs, targets):
        accum = inputs.shape[0]
        for m in range(accum):
            (self.opt.scale_loss(cross_entropy_loss(self.model(inputs[m]), targets[m])) / accum).backward()

    def step(self, lr):
        self.opt.reduce_gradients()
        self.opt.clip_grad_norm(1.0)
        self.opt.step(lr)

    def zero_grad(self):
        self.opt.zero_grad()

    def optimizer_tensors(self):
        held = self.opt.state_tensors()
        return held["optimizer"] + held["master"]

    def model_state_tensors(self):
        return [t for tensors in self.opt.state_tensors().values() for t in tensors]


class Torch:
    """DDP + AdamW (stage 0) or DDP + ZeroRedundancyOptimizer(AdamW) (stage 1)."""

    def __init__(self, model, cfg, dims, stage):
        o = cfg.optim
        kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
        groups = param_groups(model.named_parameters(), o.weight_decay)
        self.model = model
        self.ddp = DDP(model, process_group=dims.dp_group, gradient_as_bucket_view=True,
                       bucket_cap_mb=cfg.parallel.bucket_mb)
        if stage == 0:
            self.opt = torch.optim.AdamW(groups, **kw)
            self.local = self.opt
        else:
            self.opt = ZeroRedundancyOptimizer(groups[0]["params"], torch.optim.AdamW, process_group=dims.dp_group,
                                               parameters_as_bucket_view=True, weight_decay=o.weight_decay, **kw)
            self.opt.add_param_group(groups[1])
            self.local = self.opt.optim

    def forward_backward(self, inputs, targets):
        accum = inputs.shape[0]
        for m in range(accum):  # DDP reduces in the last micro-batch's backward only
            with self.ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                (cross_entropy_loss(self.ddp(inputs[m]), targets[m]) / accum).backward()

    def step(self, lr):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=False)

    def optimizer_tensors(self):
        return [t for s in self.local.state.values() for t in s.values() if torch.is_tensor(t)]

    def model_state_tensors(self):
        params = list(self.model.parameters())
        return self.optimizer_tensors() + params + [p.grad for p in params if p.grad is not None]


VARIANTS = ((0, "ours"), (0, "torch"), (1, "ours"), (1, "torch"))


def run_variants(cfg, dims, inputs, targets, warmup) -> dict:
    """All four engines on fresh copies of one model, their steps interleaved (A B C D A B ...)
    so that load from other processes on a shared machine hits every variant alike."""
    engines = {}
    for stage, kind in VARIANTS:
        engines[(stage, kind)] = (Ours if kind == "ours" else Torch)(build_model_chunks(cfg, dims)[0], cfg, dims, stage)
    times = {key: [] for key in engines}
    for step in range(inputs.shape[0]):
        for key, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            engine.zero_grad()
            engine.forward_backward(inputs[step], targets[step])
            engine.step(cfg.optim.lr)
            times[key].append(time.perf_counter() - start)
    return {key: (statistics.median(times[key][warmup:]), storage_bytes(e.optimizer_tensors()),
                  storage_bytes(e.model_state_tensors()), sum(p.numel() for p in e.model.parameters()))
            for key, e in engines.items()}


GATHER_MODES = ("overlapped with forward", "waited in step()")


def run_gather_modes(cfg, dims, inputs, targets, warmup, rounds=2) -> dict:
    """Our stage 1 with the parameter all-gather overlapped with the next forward vs waited
    for in step(): mean step time and host time waiting for the gather per step. Each engine
    runs its steps back to back (a barrier or another engine between two steps would hide an
    in-flight gather); the engines alternate over ``rounds`` (A B, B A, ...) against drift."""
    steps, per_mode = inputs.shape[0] - warmup, {mode: [] for mode in GATHER_MODES}
    for r in range(rounds):
        for mode in GATHER_MODES if r % 2 == 0 else GATHER_MODES[::-1]:
            engine = Ours(build_model_chunks(cfg, dims)[0], cfg, dims, 1, overlap=mode == GATHER_MODES[0])
            for step in range(inputs.shape[0]):
                if step == warmup:
                    engine.opt.wait_params()
                    dist.barrier()
                    waited, start = engine.gather_wait_s(), time.perf_counter()
                engine.zero_grad()
                engine.forward_backward(inputs[step], targets[step])
                engine.step(cfg.optim.lr)
            engine.opt.wait_params()  # the last step's gather counts too
            per_mode[mode].append(((time.perf_counter() - start) / steps, (engine.gather_wait_s() - waited) / steps))
    return {mode: tuple(statistics.mean(x) for x in zip(*runs)) for mode, runs in per_mode.items()}


def rank_main(rank, world, args):
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=world), torch.device("cpu"))
    cfg = make_cfg(args)
    inputs, targets = batches(cfg, rank, args.warmup + args.steps)
    out = {} if args.gather_only else run_variants(cfg, dims, inputs, targets, args.warmup)
    for key, (t, opt_bytes, state_bytes, psi) in out.items():
        slowest = torch.tensor([t])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[key] = (slowest.item(), opt_bytes, state_bytes, psi)
    for mode, (step_s, wait_s) in run_gather_modes(cfg, dims, inputs, targets, args.warmup).items():
        slowest = torch.tensor([step_s, wait_s])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[mode] = tuple(slowest.tolist())
    return out


def report(out, args) -> None:
    psi = out[(0, "ours")][3]
    print(f"dp={args.dp}, {psi:,} parameters, grad_accum={args.grad_accum}, micro_batch={args.micro_batch}x"
          f"{args.seq_len}, {args.steps} timed steps (median, slowest rank); bytes on rank 0")
    print(f"{'':34} {'step ms':>9} {'optimizer MB':>13} {'model state MB':>15}")
    names = {(0, "ours"): "stage 0: ours", (0, "torch"): "stage 0: DDP + AdamW",
             (1, "ours"): "stage 1: ours", (1, "torch"): "stage 1: DDP + ZeroRedundancyOptimizer"}
    for key, name in names.items():
        t, ob, sb, _ = out[key]
        print(f"{name:34} {t * 1e3:9.1f} {ob / 2**20:13.2f} {sb / 2**20:15.2f}")
    for stage, vs in ((0, "DDP"), (1, "ZeroRedundancyOptimizer")):
        (t0, o0, s0, _), (t1, o1, s1, _) = out[(stage, "ours")], out[(stage, "torch")]
        print(f"stage {stage} ours/{vs}: step time {t0 / t1:.2f}x, optimizer bytes {o0 / o1:.3f}x, "
              f"model-state bytes {s0 / s1:.3f}x")


def report_gather(out, args) -> None:
    print(f"stage 1 parameter all-gather at dp={args.dp}, grad_accum={args.grad_accum}, micro_batch="
          f"{args.micro_batch}x{args.seq_len}: {args.steps} steps back to back, mean of 2 runs each, slowest rank")
    for mode in GATHER_MODES:
        step_s, wait_s = out[mode]
        print(f"  {mode:24} step {step_s * 1e3:7.1f} ms, waiting for the gather {wait_s * 1e3:6.2f} ms")
    (over, over_wait), (sync, sync_wait) = (out[mode] for mode in GATHER_MODES)
    print(f"  overlapped / in step(): step time {over / sync:.2f}x, exposed gather {over_wait / max(sync_wait, 1e-9):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    add_model_arguments(parser, steps=10)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--gather-only", action="store_true", help="only stage 1's gather, overlapped vs in step()")
    args = parser.parse_args()
    results = run_ranks(rank_main, args.dp, args, timeout=1800, threads=max(1, (os.cpu_count() or 1) // args.dp),
                        pg_timeout_s=300)
    if not args.gather_only:
        report(results[0], args)
    report_gather(results[0], args)


if __name__ == "__main__":
    main()
