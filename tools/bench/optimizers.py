#!/usr/bin/env python
"""AdamW against Muon: tokens to a target loss on the default corpus, and the step's cost in
tp2 x pp2 x dp2.

    python tools/bench/optimizers.py [--steps 200] [--seeds 3] [--lrs 1e-3,3e-3,1e-2]
                                     [--target 2.0] [--window 10] [--ns-dtype fp32] [--jobs 1]
                                     [--time-steps 6] [--time-warmup 2] [--time-model tiny] [--timeout 21600]

Tokens to a loss: the README's default run (the ``tiny`` model, the standard-library corpus of
conf/data/stdlib.yaml, 32 sequences of 128 tokens a step, warm-up then cosine decay over
``--steps`` where the default run decays over 300) in one process, as ``python -m trainer3d.train parallel=single`` trains it (the
same model as any layout: docs/parallelism.md). The learning rate of each optimizer is chosen
by a sweep the script runs: every rate of ``--lrs`` on the first seed, the one with the lowest
final loss (the mean of the last ``--window`` steps) kept. Muon uses Moonlight's
``adjust_lr=match_rms_adamw`` (Liu et al. 2025, arXiv 2502.16982: the update's RMS matched to
AdamW's, so one learning rate and weight decay serve both groups): ``optim.lr`` and
``optim.muon.lr`` are the swept rate, ``min_lr`` a tenth of it, weight decay 0.1 on both;
Newton-Schulz in fp32 (``--ns-dtype``: on this CPU a bf16 matmul of the tiny model's sizes is
~20x slower than fp32's, which would triple a run's time without changing what is compared). Then
``--seeds`` seeds (``train.seed``: the initial weights and the data order) at the chosen rate;
a run reaches the target at the first step whose trailing mean loss over ``--window`` steps is
at or below ``--target``, counted in tokens trained to the end of that step.

Step time: the trainer's own pieces for the default layout (conf/parallel/tp2-pp2-dp2.yaml:
tensor-parallel layers, 1F1B, ZeRO-1) on 8 gloo ranks, the ``tiny``
model built three times — AdamW, Muon with bf16 Newton-Schulz (the default), Muon with fp32 —
and the three stepped in turn on the same batches (each first in turn, so load from other
processes hits all alike), each step's time the slowest rank's; the ratios of the medians to
AdamW's.

Printed: the sweep's final losses, each seed's tokens to the target (``-`` where a run did not
reach it), the mean per optimizer and Muon / AdamW, and the step-time ratios. A run measured on
the 2-core development machine, and what it does not show: docs/optimizers.md.
"""

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from common import model_preset  # noqa: E402
import trainer3d.config.composed  # noqa: E402,F401  (registers the schema in the ConfigStore)
from trainer3d.config.schema import Config  # noqa: E402
from trainer3d.config.rows import read_metrics  # noqa: E402
from trainer3d.config.validate import validate  # noqa: E402
from trainer3d.launch.local_ranks import run_ranks  # noqa: E402
from trainer3d.parallel.finalize import GradFinalizer  # noqa: E402
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer  # noqa: E402
from trainer3d.parallel.pipeline.schedule import Pipeline  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402
from trainer3d.preflight.data_checks import check_data  # noqa: E402
from trainer3d.trainer import MicroBatchLoss, Trainer  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"
OPTIMIZERS = ("adamw", "muon")
TP, PP, DP = 2, 2, 2
TIMED = ("adamw", "muon-bf16", "muon-fp32")
TOKENS_PER_STEP = 32 * 128
"""The default run's global batch x sequence (train.global_batch_size, train.seq_len)."""


# ---------------------------------------------------------------- tokens to a target loss

def _overrides(name: str, lr: float, seed: int, steps: int, ns_dtype: str) -> List[str]:
    out = ["parallel=single", f"optim={name}", f"optim.lr={lr}", f"optim.min_lr={lr / 10}", f"train.seed={seed}",
           f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0", "checkpoint.save_final=false",
           "logger.mode=disabled"]
    if name == "muon":
        out += [f"optim.muon.lr={lr}", "optim.muon.adjust_lr=match_rms_adamw", "optim.muon.weight_decay=0.1",
                f"optim.muon.ns_dtype={ns_dtype}"]
    return out


def _config(run_dir: Path, overrides: Sequence[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        dcfg = compose(config_name="config", overrides=[*overrides, f"run_dir={run_dir}",
                                                        f"launcher.folder={run_dir / 'submitit'}"])
    cfg = validate(OmegaConf.to_object(dcfg))
    problems = check_data(cfg)  # also prepares the built-in corpus's token files once
    assert not problems, problems
    return cfg


def _train_rank(rank: int, world: int, cfg) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # the run's progress lines; its metrics.jsonl is read
        Trainer(cfg, ParallelDims.build(Topology(tp=1, pp=1, dp=1), torch.device("cpu"))).train()


def _losses(cfg, steps: int, timeout_s: float) -> List[float]:
    """The per-step training losses of one single-process run of ``cfg`` (ended and reported
    if it outlives ``timeout_s``)."""
    run_ranks(_train_rank, 1, cfg, timeout=timeout_s, pg_timeout_s=600)
    rows, _ = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), f"{cfg.run_dir}: one metrics row per step expected"
    return [r["loss"] for r in rows]


def train_losses(root: Path, runs: Sequence[tuple], args) -> Dict[tuple, List[float]]:
    """The losses of each (optimizer, lr, seed) of ``runs``, ``args.jobs`` runs at a time (each
    its own process; the configs are composed here first, as Hydra's compose is not thread-safe)."""
    cfgs = {}
    for name, lr, seed in runs:
        cfgs[name, lr, seed] = _config(root / f"{name}-lr{lr:g}-seed{seed}",
                                       _overrides(name, lr, seed, args.steps, args.ns_dtype))
        tokens = cfgs[name, lr, seed].train.global_batch_size * cfgs[name, lr, seed].train.seq_len
        assert tokens == TOKENS_PER_STEP, "the default run's batch changed"
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {run: pool.submit(_losses, cfg, args.steps, args.timeout) for run, cfg in cfgs.items()}
    return {run: f.result() for run, f in futures.items()}


def trailing_means(losses: Sequence[float], window: int) -> List[float]:
    """The mean of the last ``window`` losses at each step from the ``window``-th on."""
    return [statistics.fmean(losses[i - window + 1:i + 1]) for i in range(window - 1, len(losses))]


def steps_to(losses: Sequence[float], target: float, window: int) -> Optional[int]:
    """Steps trained when the trailing mean first reaches ``target`` (None: never)."""
    for i, mean in enumerate(trailing_means(losses, window)):
        if mean <= target:
            return i + window
    return None


def tokens_table(args, root: Path) -> None:
    print(f"learning-rate sweep: seed 0, {args.steps} steps, final loss = mean of the last {args.window} steps")
    print(f"{'optimizer':<10} " + " ".join(f"{f'lr {lr:g}':>10}" for lr in args.lrs))
    losses = train_losses(root, [(name, lr, 0) for name in OPTIMIZERS for lr in args.lrs], args)
    chosen: Dict[str, float] = {}
    for name in OPTIMIZERS:
        finals = {lr: trailing_means(losses[name, lr, 0], args.window)[-1] for lr in args.lrs}
        chosen[name] = min(finals, key=finals.get)
        print(f"{name:<10} " + " ".join(f"{finals[lr]:>10.4f}" for lr in args.lrs))
    losses.update(train_losses(root, [(n, chosen[n], s) for n in OPTIMIZERS for s in range(1, args.seeds)], args))
    print(f"\ntokens to a trailing-{args.window}-step mean loss <= {args.target} ({TOKENS_PER_STEP:,} tokens a step)")
    print(f"{'optimizer':<10} {'lr':>8} " + " ".join(f"{f'seed {s}':>10}" for s in range(args.seeds)) + f" {'mean':>10}")
    means = {}
    for name in OPTIMIZERS:
        reached = [steps_to(losses[name, chosen[name], s], args.target, args.window) for s in range(args.seeds)]
        cells = [f"{n * TOKENS_PER_STEP:>10,}" if n is not None else f"{'-':>10}" for n in reached]
        means[name] = statistics.fmean(reached) * TOKENS_PER_STEP if None not in reached else None
        mean = f"{means[name]:>10,.0f}" if means[name] is not None else f"{'-':>10}"
        print(f"{name:<10} {chosen[name]:>8g} " + " ".join(cells) + f" {mean}")
    if None in means.values():
        print("muon / adamw tokens: - (a run did not reach the target)")
    else:
        print(f"muon / adamw tokens: {means['muon'] / means['adamw']:.2f} x")


# ---------------------------------------------------------------- step time in tp2 x pp2 x dp2

def _timed_config(args, engine: str):
    """The default layout's config for ``engine`` (adamw, muon-bf16, muon-fp32) on the ``tiny`` model."""
    cfg = Config()
    cfg.model = model_preset(args.time_model)
    p, t = cfg.parallel, cfg.train
    p.tp, p.pp, p.dp, p.zero_stage = TP, PP, DP, 1
    t.seq_len, t.micro_batch_size, t.grad_accum_steps = 128, args.time_micro_batch, args.time_grad_accum
    t.global_batch_size = args.time_micro_batch * args.time_grad_accum * DP
    if engine != "adamw":
        cfg.optim.name = "muon"
        cfg.optim.muon.lr, cfg.optim.muon.adjust_lr = cfg.optim.lr, "match_rms_adamw"
        cfg.optim.muon.ns_dtype = engine.split("-")[1]
    return cfg


def _engine(cfg, dims):
    """The trainer's step for this layout: pipeline forward-backward, dp reduction, clip, step."""
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, cfg.parallel.sequence_parallel)
    micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps, optimizer)
    pipeline = Pipeline(chunks, micro_loss, cfg, dims)

    def step(inputs, targets):
        optimizer.zero_grad()
        pipeline.forward_backward(inputs if dims.is_first_stage else None, targets if dims.is_last_stage else None)
        micro_loss.losses.take_mean()
        grads.finalize()
        optimizer.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step(cfg.optim.lr)
    return step


def _time_rank(rank: int, world: int, args) -> Dict[str, float]:
    dims = ParallelDims.build(Topology(tp=TP, pp=PP, dp=DP), torch.device("cpu"))
    engines = {name: _engine(_timed_config(args, name), dims) for name in TIMED}
    times: Dict[str, List[float]] = {name: [] for name in engines}
    for i in range(args.time_warmup + args.time_steps):
        g = torch.Generator().manual_seed(1000 * i + dims.dp_rank)  # every tp and pp rank of a replica alike
        tokens = torch.randint(0, 257, (args.time_grad_accum, args.time_micro_batch, 129), generator=g)
        inputs, targets = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
        order = TIMED[i % len(TIMED):] + TIMED[:i % len(TIMED)]  # each engine first in turn: load hits all alike
        for name in order:
            dist.barrier()
            started = time.perf_counter()
            engines[name](inputs, targets)
            elapsed = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i >= args.time_warmup:
                times[name].append(elapsed.item())
    return {name: statistics.median(t) for name, t in times.items()}


def time_table(args) -> None:
    medians = run_ranks(_time_rank, TP * PP * DP, args, timeout=args.timeout, pg_timeout_s=600)[0]
    print(f"\nstep time, tp={TP} pp={PP} dp={DP} ZeRO-1, model {args.time_model}, {args.time_grad_accum} "
          f"micro-batches of {args.time_micro_batch} x 128 tokens, {args.time_steps} timed steps, median of the "
          "slowest rank")
    print(f"{'optimizer':<10} {'/ adamw':>8}")
    for name in TIMED:
        print(f"{name:<10} {medians[name] / medians['adamw']:>7.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each run (the default run has 300)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the sweep's learning rates, comma-separated")
    parser.add_argument("--target", type=float, default=2.0, help="the training loss to reach")
    parser.add_argument("--window", type=int, default=10, help="steps of the trailing mean the target is read on")
    parser.add_argument("--ns-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="optim.muon.ns_dtype of the loss runs (bf16 matmuls are ~20x slower on this CPU)")
    parser.add_argument("--jobs", type=int, default=1, help="loss runs trained at once, each its own process")
    parser.add_argument("--timeout", type=float, default=6 * 3600,
                        help="seconds a run may take before its ranks are ended and the bench fails")
    parser.add_argument("--time-steps", type=int, default=6, help="timed steps in tp2 x pp2 x dp2 (0: skip)")
    parser.add_argument("--time-warmup", type=int, default=2)
    parser.add_argument("--time-model", default="tiny", help="the timed model, a conf/model preset")
    parser.add_argument("--time-micro-batch", type=int, default=4)
    parser.add_argument("--time-grad-accum", type=int, default=4, help="micro-batches per step (1F1B: at least 2)")
    args = parser.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    if not 1 <= args.window <= args.steps:
        parser.error(f"--window={args.window} must be between 1 and --steps={args.steps}")
    with tempfile.TemporaryDirectory(prefix="bench-optimizers-") as tmp:
        tokens_table(args, Path(tmp))
    if args.time_steps:
        time_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
