#!/usr/bin/env python
"""The engine's own host time per step and per micro-batch, next to the model's, in one process.

    python tools/bench/host_overhead.py [--against REV] [--rounds 3] [--steps 60]

The engine at a negligible model size (the planner's probe, trainer3d/plan/calibrate.py's
``TINY``: dim 32, 4 blocks, micro-batches of 1 x 32 tokens, fp32, one process) runs through
its own entry point, ``python -m trainer3d.train ... launcher=inplace`` in a child process
that is rank 0 of a world of one: heartbeat thread, run-dir checks, metrics, the
non-finite watch, the agreed stop, the checkpoint poll, the data prefetch — everything a
real run does each step. The child wraps ``Trainer.train_step`` to stamp the main thread's
CPU time (``time.thread_time``) at the start of every step, so the difference of two stamps
is one whole iteration of the loop (the step and everything the loop does after it), and
runs it twice: with ``grad_accum_steps`` 1 and ``--accum`` (8). Between two steps, outside
their stamps, it times the model alone on the same micro-batches: the trainer's own model
chunks and loss function with the engine's hooks taken off (the forward pre-hooks of
ZeRO-1's gather, the post-accumulate-grad hooks of the bucketed reduction), forward, loss
and backward as many times as a step has micro-batches, autograd making its own ``.grad``
(the engine's put back after). That is M, the model's share per micro-batch: the layers'
operators and autograd, measured under the same conditions as the steps around it.

With T(a) the mean CPU time of an iteration with ``a`` micro-batches and M(a) the model's
share measured beside it, the engine's time in an iteration is E(a) = T(a) - a M(a), and

- per micro-batch: ``(E(accum) - E(1)) / (accum - 1)``: what the engine adds to each
  micro-batch (its hooks, the loss's bookkeeping, the data slicing);
- per step: ``E(1)`` less that: everything done once per step outside the model
  (optimizer step, clipping, gradient finalisation, metrics, the watches, the data hand-off).

One intra-op thread: the launcher would give the one rank all the cores, and OpenMP's
workers, synchronising around every small operator, would then dominate (and, waiting for
each other on a loaded machine, inflate) the main thread's CPU time of a tiny model; the
host's own work is single-threaded Python either way.

Why CPU time of the main thread: on a loaded machine (the 2-core development box runs
other jobs) wall time counts the time the scheduler gave to others; the main thread's CPU
time counts what the loop itself executed, which is what a GPU would wait on. Background
threads (the prefetch, the heartbeat writer, gloo's workers) are not counted: they are off
the critical path by construction. Each figure is the median over ``--rounds`` child runs
(each child's figures are means over ``--steps`` iterations after warm-up, the logging
interval's flush included). ``--against REV`` runs the same with trainer3d/ and conf/ as they
are at git revision REV (``git archive``), alternating with this tree, and prints ours / REV.
The targets (issue 25): at most 2 ms per step and 0.5 ms per micro-batch.

``--profile N`` prints, instead, the N functions of the engine (trainer3d/ less the model)
with the most cumulative CPU time per step (cProfile over the timed steps, one child with
``--accum`` micro-batches), with REV's figure for each beside it: where the fixed time goes.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tools.bench.revision; a child puts its revision's tree before it

from tools.bench.revision import extract_revision  # noqa: E402

TINY = ("model=tiny", "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=null",
        "optim.warmup_steps=2", "parallel=single")
"""The probe's model (trainer3d/plan/calibrate.py ``TINY``), in overrides every revision since 2026-11-22 knows."""


# ---------------------------------------------------------------------------- in a child: measure

def _strip_hooks(chunks):
    """Take the engine's hooks off the model (returns what puts them back)."""
    saved = []
    for chunk in chunks:
        for module in chunk.modules():
            saved.append((module, "_forward_pre_hooks", dict(module._forward_pre_hooks)))
            module._forward_pre_hooks.clear()
        for p in chunk.parameters():
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks:
                saved.append((p, "_post_accumulate_grad_hooks", hooks))
                # an empty dict, not None: assigning None leaves the tensor's C++ hook (which holds
                # the dict) in place, and the engine's hooks would run inside the model's share
                # (torch/csrc/autograd/python_variable.cpp ``THPVariable_set_post_accumulate_grad_hooks``)
                p._post_accumulate_grad_hooks = {}

    def restore():
        for owner, name, value in saved:
            if name == "_forward_pre_hooks":
                owner._forward_pre_hooks.update(value)
            else:
                setattr(owner, name, value)
    return restore


def _model_share(trainer, batch) -> float:
    """CPU seconds of the model alone (forward, loss, backward) per micro-batch: the trainer's
    chunks and loss function on ``batch`` (as many micro-batches as its steps), the engine's
    hooks off and ``.grad`` autograd's own; both put back after."""
    model, loss_fn = trainer.chunks[0], trainer.micro_loss.loss_fn
    inputs, targets = batch
    params = list(model.parameters())
    grads = [p.grad for p in params]
    restore = _strip_hooks(trainer.chunks)
    try:
        for p in params:
            p.grad = None
        started = time.thread_time()
        for m in range(inputs.shape[0]):
            loss_fn(model(inputs[m]), targets[m]).backward()
        return (time.thread_time() - started) / inputs.shape[0]
    finally:
        restore()
        for p, g in zip(params, grads):
            p.grad = g


def child(args) -> dict:
    sys.path.insert(0, args.root)
    import trainer3d.trainer as trainer_module

    if not Path(trainer_module.__file__).is_relative_to(args.root):
        raise RuntimeError(f"trainer3d imported from {trainer_module.__file__}, not {args.root}")
    stamps, trainers, model_s, batch, aside = [], [], [], [], [0.0]
    init, step = trainer_module.Trainer.__init__, trainer_module.Trainer.train_step
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile(time.thread_time)

    def init_spy(self, *a, **k):
        init(self, *a, **k)
        trainers.append(self)

    def step_spy(self, n, *a, **k):
        if len(stamps) > args.warmup and not args.profile:  # the model alone, between two steps, outside their stamps
            started = time.thread_time()
            if not batch:
                batch.append(getattr(self.data, "reader", self.data).batch(0))
            model_s.append(_model_share(self, batch[0]))
            aside[0] += time.thread_time() - started  # left out of the iteration it falls in
        stamps.append(time.thread_time() - aside[0])
        if profiler is not None and len(stamps) == args.warmup + 1:
            profiler.enable()
        return step(self, n, *a, **k)

    trainer_module.Trainer.__init__, trainer_module.Trainer.train_step = init_spy, step_spy
    import torch
    torch.set_num_threads(1)
    torch.set_num_threads = lambda n: None  # the launcher's share of the cores: one thread here (see the docstring)
    try:  # outside the ephemeral range: no connection takes it before rank 0 binds it
        from trainer3d.rank.master_port import local_port
        port = local_port()
    except ImportError:  # a revision older than trainer3d/rank/master_port.py
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WANDB_MODE="disabled")
    run_dir = Path(args.run_dir)
    sys.argv = ["trainer3d.train", *TINY, f"train.grad_accum_steps={args.accum}", f"train.max_steps={args.steps + args.warmup + 1}",
                f"hydra.run.dir={run_dir}", f"run_dir={run_dir}", f"launcher.folder={run_dir / 'launcher'}",
                "launcher=inplace", "checkpoint.save_final=false", *args.override]
    import runpy
    try:  # as ``python -m trainer3d.train``: revisions that name their config directory relative to it find it
        runpy.run_module("trainer3d.train", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if done.code:
            raise
    calls = {}
    if profiler is not None:
        profiler.disable()
        import pstats
        for (filename, _, name), (_, ncalls, _, cumtime, _) in pstats.Stats(profiler).stats.items():
            if "/trainer3d/" in filename and "/trainer3d/model/" not in filename:  # the engine's own functions
                key = f"{filename.split('/trainer3d/', 1)[1]}:{name}"
                calls[key] = [calls.get(key, [0, 0.0])[0] + ncalls, calls.get(key, [0, 0.0])[1] + cumtime]
    timed = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup:]
    return {"source": trainer_module.__file__, "iteration_s": statistics.fmean(timed),
            "model_s": statistics.fmean(model_s) if model_s else 0.0, "steps": len(timed), "calls": calls}


# ---------------------------------------------------------------------------- the parent: compare

def _run(root: Path, accum: int, args) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, __file__, "--child", "--root", str(root), "--run-dir", run_dir,
               f"--accum={accum}", f"--steps={args.steps}", f"--warmup={args.warmup}",
               *(f"--override={o}" for o in args.override), *([f"--profile={args.profile}"] if args.profile else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"host_overhead child ({root}, accum {accum}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(result.pop("source")).is_relative_to(root):
        raise RuntimeError(f"the child did not import trainer3d from {root}")
    return result


def figures(one: dict, many: dict, accum: int) -> dict:
    """Per-step and per-micro-batch engine time (ms) from the runs with 1 and ``accum`` micro-batches:
    each run's engine time per iteration is its iteration less its micro-batches' model share."""
    model = statistics.fmean([one["model_s"], many["model_s"]])
    engine_one, engine_many = one["iteration_s"] - one["model_s"], many["iteration_s"] - accum * many["model_s"]
    per_micro = (engine_many - engine_one) / (accum - 1)
    per_step = engine_one - per_micro
    return {"engine_step_ms": per_step * 1e3, "engine_micro_ms": per_micro * 1e3, "model_micro_ms": model * 1e3,
            "iteration_ms": many["iteration_s"] * 1e3}


LABELS = (("engine_step_ms", "engine ms / step"), ("engine_micro_ms", "engine ms / micro-batch"),
          ("model_micro_ms", "model ms / micro-batch"), ("iteration_ms", "iteration ms (CPU)"))


def profile(args) -> int:
    """The engine's functions with the most cumulative CPU time per step (cProfile), this tree and REV."""
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"this tree": ROOT, **({args.against: extract_revision(args.against, Path(tmp))} if args.against else {})}
        runs = {name: _run(root, args.accum, args) for name, root in roots.items()}
    per_step = {name: {k: (n / r["steps"], t / r["steps"] * 1e6) for k, (n, t) in r["calls"].items()}
                for name, r in runs.items()}
    print(f"cProfile of {args.steps} steps of {args.accum} micro-batches, one process; cumulative CPU us per step "
          "(its own overhead included: compare within a row)")
    print(f"{'function':<58}" + "".join(f"{name:>16}" for name in per_step) + "   calls/step")
    mine = per_step["this tree"]
    for key in sorted(mine, key=lambda k: -mine[k][1])[:args.profile]:
        cells = "".join(f"{p[key][1]:>16.1f}" if key in p else f"{'-':>16}" for p in per_step.values())
        print(f"{key:<58}{cells}   {mine[key][0]:.0f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accum", type=int, default=8, help="micro-batches per step of the second run")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="child runs per revision (alternating)")
    parser.add_argument("--against", help="a git revision to compare with (e.g. main)")
    parser.add_argument("--override", action="append", default=[], help="one more Hydra override (repeatable)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N functions with the most CPU time (cProfile) of one run instead")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.profile:
        return profile(args)
    print(f"one process, fp32, dim 32 x 4 blocks, micro-batches of 1 x 32 tokens, {args.steps} steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"this tree": ROOT}
        if args.against:
            roots[args.against] = extract_revision(args.against, Path(tmp))
        runs = {name: [] for name in roots}
        for _ in range(args.rounds):
            for name, root in roots.items():
                runs[name].append(figures(_run(root, 1, args), _run(root, args.accum, args), args.accum))
    best = {name: {key: statistics.median(r[key] for r in rs) for key, _ in LABELS} for name, rs in runs.items()}
    print(f"{'':<26}" + "".join(f"{name:>14}" for name in best) + ("   this / " + args.against if args.against else ""))
    for key, label in LABELS:
        cells = "".join(f"{b[key]:>14.3f}" for b in best.values())
        ratio = f"{best['this tree'][key] / best[args.against][key]:>12.3f}" if args.against else ""
        print(f"{label:<26}{cells}{ratio}")
    print(f"load average {os.getloadavg()[0]:.1f}; targets: engine <= 2 ms / step, <= 0.5 ms / micro-batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
