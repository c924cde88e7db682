#!/usr/bin/env python
"""Bytes and time of one training step on the hot path, against another revision of the code.

    python tools/bench/hotpath.py [--tp 2] [--dp 1] [--sp] [--dtype fp32] [--zero-stage 0]
                                  [--grad-accum 2] [--vocab 257] [--against main] [--rounds 2]

``tp x dp`` gloo ranks (pp 1) train the bench model (tools/bench/common.py's shape; the
vocabulary is a knob here) through the
engine's own pieces (``build_model_chunks``, ``build_optimizer``, ``build_loss_fn``, the
trainer's step order) and report, for rank 0:

- saved MiB / micro-batch: what autograd keeps for backward (``SavedActivationMeter``,
  trainer3d/memory/meter.py), the peak over one micro-batch's forward;
- allocated MiB / step: the bytes of every tensor the step's operators create (outputs of
  out-of-place operators, seen by a ``TorchDispatchMode``): copies, clones and temporary
  buffers show up here even when they are freed at once; allocations / step: how many;
- step ms: the median wall time of a step (slowest rank), after warm-up;
- the loss at the last step (the same model must train the same).

``--against REV`` also runs the same measurement with trainer3d/ as it is at git revision
REV (extracted with ``git archive`` into a temporary directory), alternating the two runs
``--rounds`` times so both see the same machine load, and prints ours / REV for each figure.
Figures measured with it are in the README ("Fewer bytes on the hot path").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tools.bench.revision; a child puts its revision's tree before it

from tools.bench.revision import extract_revision  # noqa: E402


# ---------------------------------------------------------------------------- in a child: measure

def _allocation_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllocatedBytes(TorchDispatchMode):
        """Sums the bytes, and counts the tensors, that out-of-place operators return (views
        and in-place operators allocate nothing and are not counted)."""

        def __init__(self):
            super().__init__()
            self.bytes = self.tensors = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            schema = func._schema
            if not schema.is_mutable and not any(r.alias_info for r in schema.returns):
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if hasattr(t, "untyped_storage"):
                        self.bytes += t.untyped_storage().nbytes()
                        self.tensors += 1
            return out
    return AllocatedBytes()


def _rank(rank, world, args):
    import torch
    import torch.distributed as dist

    from trainer3d.config.schema import Config, ModelConfig
    from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer
    from trainer3d.memory.meter import SavedActivationMeter
    from trainer3d.parallel.finalize import GradFinalizer
    from trainer3d.parallel.topology import ParallelDims, Topology

    cfg = Config()
    cfg.model = ModelConfig(name="bench", dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                            ffn_dim=3 * args.dim, vocab_size=args.vocab, max_seq_len=args.seq_len)
    p, t = cfg.parallel, cfg.train
    p.tp, p.dp, p.pp, p.sequence_parallel, p.zero_stage = args.tp, args.dp, 1, args.sp, args.zero_stage
    t.seq_len, t.micro_batch_size, t.grad_accum_steps, t.dtype = args.seq_len, args.micro_batch, args.grad_accum, args.dtype
    t.global_batch_size = args.micro_batch * args.grad_accum * args.dp
    dims = ParallelDims.build(Topology(tp=args.tp, pp=1, dp=args.dp), torch.device("cpu"))
    (model,) = build_model_chunks(cfg, dims)
    optimizer = build_optimizer([model], cfg, dims)
    grads = GradFinalizer([model], optimizer, dims, args.sp)
    try:  # the loss that applies the head itself (train.loss_chunk_tokens) takes the chunks
        loss_fn = build_loss_fn(cfg, dims, [model])
    except TypeError:  # a revision from before it
        loss_fn = build_loss_fn(cfg, dims)
    g = torch.Generator().manual_seed(dims.dp_rank)

    def step(meter=None):
        batch = torch.randint(0, args.vocab, (2, args.grad_accum, args.micro_batch, args.seq_len), generator=g)
        optimizer.zero_grad()
        losses = []
        for m in range(args.grad_accum):
            if meter is not None and m == 0:
                with meter:
                    loss = loss_fn(model(batch[0, m]), batch[1, m])
            else:
                loss = loss_fn(model(batch[0, m]), batch[1, m])
            losses.append(loss.detach())
            (optimizer.scale_loss(loss) / args.grad_accum).backward()
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(1e-3)
        return torch.stack(losses).mean()

    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        loss = step()
        elapsed = torch.tensor(time.perf_counter() - started)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(elapsed.item())
    meter = SavedActivationMeter(model.parameters())
    counter = _allocation_counter()
    with counter:
        step(meter)
    import trainer3d
    return {"source": trainer3d.__file__, "step_ms": statistics.median(times) * 1e3, "saved_mib": meter.peak_bytes / 2**20,
            "allocated_mib": counter.bytes / 2**20, "allocations": counter.tensors, "loss": loss.item()}


def child(args) -> dict:
    sys.path.insert(0, args.root)
    from trainer3d.launch.local_ranks import run_ranks
    if not Path(sys.modules["trainer3d"].__file__).is_relative_to(args.root):
        raise RuntimeError(f"trainer3d imported from {sys.modules['trainer3d'].__file__}, not {args.root}")
    results = run_ranks(_rank, args.tp * args.dp, args, timeout=1800, pg_timeout_s=300)
    if not all(Path(r.pop("source")).is_relative_to(args.root) for r in results):
        raise RuntimeError(f"the ranks did not import trainer3d from {args.root}")
    return results[0]


# ---------------------------------------------------------------------------- the parent: compare

def _run(argv, root: Path) -> dict:
    cmd = [sys.executable, __file__, *argv, "--child", "--root", str(root)]
    # Started in ``root`` with it on PYTHONPATH, not only on sys.path: the ranks fork from a
    # forkserver, whose sys.path starts with its working directory and the environment's
    # (Python 3.11's forkserver.main ignores the parent's sys.path).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_hotpath child ({root}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


FIGURES = (("saved_mib", "saved MiB / micro-batch"), ("allocated_mib", "allocated MiB / step"),
           ("allocations", "allocations / step"),
           ("step_ms", "step ms"), ("loss", "loss at last step"))


def _best(runs):
    """Bytes are deterministic; of the times, each run's median, then the least of the rounds."""
    return {key: min(r[key] for r in runs) if key == "step_ms" else runs[-1][key] for key, _ in FIGURES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1))
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=257, help="vocabulary (257: bytes; 32000: Llama-2's)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--against", help="a git revision to compare with (e.g. main)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each revision")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    own = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
           if k not in ("against", "rounds", "child", "root", "sp")] + (["--sp"] if args.sp else [])
    layout = (f"tp={args.tp} dp={args.dp} sp={args.sp} {args.dtype} zero {args.zero_stage}, dim {args.dim}, "
              f"{args.layers} layers, vocab {args.vocab}, {args.grad_accum} x {args.micro_batch} x {args.seq_len} tokens per rank")
    print(layout)
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"this tree": ROOT}
        if args.against:
            roots[args.against] = extract_revision(args.against, Path(tmp))
        runs = {name: [] for name in roots}
        for _ in range(args.rounds if args.against else 1):
            for name, root in roots.items():
                runs[name].append(_run(own, root))
    best = {name: _best(r) for name, r in runs.items()}
    print(f"{'':<24}" + "".join(f"{name:>14}" for name in best) + ("   this / " + args.against if args.against else ""))
    for key, label in FIGURES:
        cells = "".join(f"{b[key]:>14.6f}" if key == "loss" else f"{b[key]:>14.1f}" for b in best.values())
        ratio = ""
        if args.against and key != "loss":
            ratio = f"{best['this tree'][key] / best[args.against][key]:>12.3f}"
        print(f"{label:<24}{cells}{ratio}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
