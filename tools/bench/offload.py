"""The host AdamW step of ZeRO-Offload (trainer3d/parallel/zero/offload.py: ``HostAdamW``), its
candidates, and DeepSpeed's CPU Adam, on the same fp32 state in one run.

    python tools/bench/offload.py --params 20000000 [--steps 10] [--threads N]

Every variant updates ``--params`` fp32 parameters from fp32 gradients with AdamW (weight
decay on), all the machine's cores unless ``--threads``; printed: the best of ``--steps``
timed rounds (after 2 untimed; one step of every variant per round, so a load
that comes and goes falls on all alike) as Mparam/s, per variant:

- ``ours``: ``HostAdamW.step`` as the engine runs it (torch's fused CPU kernel
  ``torch._fused_adamw_`` on the owned state, one long tensor per weight-decay run, split
  over the cores by the kernel's own ``at::parallel_for``);
- ``fused, 1 thread``: the same kernel on one core (what the cores add);
- ``fused, N Python threads``: the state cut into N slices, one kernel call per slice from N
  Python threads with torch's pool at one thread (the kernel releases the GIL);
- ``foreach``: ``torch.optim.AdamW(foreach=True)`` (separate vectorised passes per op);
- ``DeepSpeedCPUAdam``: DeepSpeed's C++/OpenMP CPU Adam in AdamW mode, when deepspeed is
  importable (its op is built with the machine's compiler on first use; not a dependency:
  the ``peers`` extra, ``DS_BUILD_OPS=0 pip install -e '.[peers]'``).

The last line is ours: ``host AdamW step: <x> Mparam/s``. Figures measured on the
development machines are in docs/offload.md.
"""

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from trainer3d.config.schema import OptimConfig  # noqa: E402
from trainer3d.optim.adamw import Segment  # noqa: E402
from trainer3d.parallel.zero.offload import HostAdamW  # noqa: E402

LR = 1e-3
DS = "DeepSpeedCPUAdam (AdamW)"


def best_seconds(steps: Dict[str, Callable[[], None]], threads: Dict[str, int], rounds: int,
                 warmup: int = 2) -> Dict[str, float]:
    """Each variant's best step time over ``rounds`` rounds, one step of every variant per round:
    interleaved, so a load that comes and goes on a shared machine falls on all of them alike."""
    best = {label: float("inf") for label in steps}
    for r in range(warmup + rounds):
        for label, step in steps.items():
            torch.set_num_threads(threads[label])
            started = time.perf_counter()
            step()
            if r >= warmup:
                best[label] = min(best[label], time.perf_counter() - started)
    return best


def ours(n: int, cfg: OptimConfig) -> Callable[[], None]:
    """The engine's host step over one owned piece of ``n`` elements of a matrix (weight decay on)."""
    param = nn.Parameter(torch.randn(n) * 0.02)
    grads = torch.randn(n) * 1e-3
    segment = Segment("layers.0.mlp.w1.weight", param.view(1, n), 0, n, 0, 0)
    adam = HostAdamW([segment], [(0, n)], param.detach(), grads, cfg)
    adam.grad.copy_(grads)
    return lambda: adam.step(LR, None, None)


def state(n: int):
    return torch.randn(n) * 0.02, torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n), torch.zeros(())


def fused_slices(n: int, cfg: OptimConfig, slices: int) -> Callable[[], None]:
    """The fused kernel on ``slices`` slices of the state, each from its own Python thread."""
    p, g, m, v, step = state(n)
    bounds = [(n * i // slices, n * (i + 1) // slices) for i in range(slices)]
    steps = [step.clone() for _ in bounds]

    def one(i: int) -> None:
        lo, hi = bounds[i]
        torch._fused_adamw_([p[lo:hi]], [g[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [steps[i]], lr=LR, beta1=cfg.beta1,
                            beta2=cfg.beta2, weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False,
                            maximize=False)

    def run() -> None:
        for s in steps:
            s += 1
        if slices == 1:
            one(0)
            return
        threads = [threading.Thread(target=one, args=(i,)) for i in range(slices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


def torch_adamw(n: int, cfg: OptimConfig) -> Callable[[], None]:
    param = nn.Parameter(torch.randn(n) * 0.02)
    param.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([param], lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=True)
    return opt.step


def deepspeed_adam(n: int, cfg: OptimConfig) -> Optional[Callable[[], None]]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    param = nn.Parameter(torch.randn(n) * 0.02)
    param.grad = torch.randn(n) * 1e-3
    opt = DeepSpeedCPUAdam([param], lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                           weight_decay=cfg.weight_decay, adamw_mode=True)
    return opt.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=20_000_000, help="fp32 parameters updated per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the best is printed)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores to use (default: all)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    args = parser.parse_args()
    cfg, n, cores = OptimConfig(), args.params, args.threads
    os.environ.setdefault("OMP_NUM_THREADS", str(cores))  # DeepSpeed's OpenMP loop
    variants = {"fused, 1 thread": (lambda: fused_slices(n, cfg, 1), 1)}
    if cores > 1:
        variants[f"fused, {cores} Python threads"] = (lambda: fused_slices(n, cfg, cores), 1)
    variants["foreach"] = (lambda: torch_adamw(n, cfg), cores)
    if not args.no_deepspeed:
        variants[DS] = (lambda: deepspeed_adam(n, cfg), cores)
    variants["ours"] = (lambda: ours(n, cfg), cores)
    steps, threads = {}, {}
    for label, (make, used) in variants.items():
        torch.set_num_threads(used)
        step = make()
        if step is None:
            print(f"{label}: deepspeed is not importable, not measured")
            continue
        steps[label], threads[label] = step, used
    best = best_seconds(steps, threads, args.steps)
    rate = {label: n / seconds / 1e6 for label, seconds in best.items()}
    print(f"AdamW on {n:,} fp32 parameters, {cores} core(s), best of {args.steps} interleaved rounds; Mparam/s:")
    for label, value in rate.items():
        print(f"{label:<32} {value:10.1f}")
    if DS in rate:
        print(f"ours / DeepSpeedCPUAdam: {rate['ours'] / rate[DS]:.2f}x")
    print(f"host AdamW step: {rate['ours']:.1f} Mparam/s")


if __name__ == "__main__":
    main()
