"""The host AdamW step of ZeRO-Offload (trainer3d/parallel/zero/offload.py: ``HostAdamW``) beside
DeepSpeed's CPU Adam and torch's fused kernel, on the same fp32 state sizes, in one run.

    python tools/bench/offload.py --params 20000000 [--steps 20] [--threads N]

Every variant updates the same ``--params`` fp32 parameters (one set of buffers: masters,
gradients, both moments) with AdamW (weight decay on), on all the machine's cores unless ``--threads`` (torch's intra-op threads, which
DeepSpeed's OpenMP loop shares: the same count for all). Rounds of one step of each, in
turn (each round starting one variant further along), after 2 untimed rounds, so a load that
comes and goes on a shared machine falls on them alike:

- ``ours``: ``HostAdamW.step`` as the engine runs it (the compiled kernel of
  trainer3d/parallel/zero/host_kernel.py, bit for bit torch's fused CPU AdamW);
- ``DeepSpeedCPUAdam``: DeepSpeed's C++/OpenMP CPU Adam in AdamW mode, when deepspeed is
  importable (its op is built with the machine's compiler on first use; not a dependency:
  the ``peers`` extra, ``DS_BUILD_OPS=0 pip install -e '.[peers]'``);
- ``torch fused``: ``HostAdamW.step`` on torch's kernel (``torch._fused_adamw_``), the path
  the engine takes where the compiled kernel cannot be built;
- ``foreach`` (``--foreach``): ``torch.optim.AdamW(foreach=True)``, a pass over memory per op.

Printed: each round's Mparam/s and, with DeepSpeed, the round's ratio ours / DeepSpeed; then
per variant the median and the best round, the median of the per-round ratios; the last line
is ours, the best round: ``host AdamW step: <x> Mparam/s``. Figures measured on the
development machines are in docs/offload.md.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from trainer3d.config.schema import OptimConfig  # noqa: E402
from trainer3d.optim.adamw import Segment  # noqa: E402
from trainer3d.parallel.zero.offload import HostAdamW  # noqa: E402

LR = 1e-3
DS = "DeepSpeedCPUAdam (AdamW)"


def timed_rounds(steps: Dict[str, Callable[[], None]], threads: Dict[str, int], rounds: int,
                 warmup: int = 2) -> Dict[str, List[float]]:
    """Each variant's step times, one step of every variant per round, in turn; each round starts
    one variant further along (no variant always runs first, or always after the same one)."""
    times: Dict[str, List[float]] = {label: [] for label in steps}
    labels = list(steps)
    for r in range(warmup + rounds):
        for i in range(len(labels)):
            label = labels[(r + i) % len(labels)]
            step = steps[label]
            torch.set_num_threads(threads[label])
            started = time.perf_counter()
            step()
            if r >= warmup:
                times[label].append(time.perf_counter() - started)
    return times


def shared_state(n: int, cfg: OptimConfig) -> HostAdamW:
    """The engine's host optimizer over one owned piece of ``n`` elements of a matrix (weight decay
    on): its four fp32 buffers (masters, gradients, moments) are the state every variant updates,
    so no variant gets memory placed better or worse than another's."""
    param = nn.Parameter(torch.randn(n) * 0.02)
    segment = Segment("layers.0.mlp.w1.weight", param.view(1, n), 0, n, 0, 0)
    adam = HostAdamW([segment], [(0, n)], param.detach(), torch.zeros(n), cfg)
    adam.grad.copy_(torch.randn(n) * 1e-3)
    return adam


def ours(adam: HostAdamW, kernel: Optional[ModuleType]) -> Callable[[], None]:
    """``HostAdamW.step`` as the engine runs it; ``kernel=None``: on torch's kernel, as where the
    compiled one cannot be built."""
    def step() -> None:
        adam.kernel = kernel
        adam.step(LR, None, None)
    return step


def deepspeed_adam(adam: HostAdamW, cfg: OptimConfig) -> Optional[Callable[[], None]]:
    """DeepSpeedCPUAdam (AdamW mode) on ``adam``'s buffers: the masters as its parameter, the host
    gradients as its gradient, the moments as its state."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    param = nn.Parameter(adam.master)
    param.grad = adam.grad
    opt = DeepSpeedCPUAdam([param], lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                           weight_decay=cfg.weight_decay, adamw_mode=True)
    opt.state[param] = {"step": 0, "exp_avg": adam.exp_avg, "exp_avg_sq": adam.exp_avg_sq}
    return opt.step


def torch_adamw(n: int, cfg: OptimConfig) -> Callable[[], None]:
    param = nn.Parameter(torch.randn(n) * 0.02)
    param.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([param], lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=True)
    return opt.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=20_000_000, help="fp32 parameters updated per step")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each variant per round)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores to use (default: all)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    parser.add_argument("--foreach", action="store_true", help="also time torch.optim.AdamW(foreach=True)")
    args = parser.parse_args()
    cfg, n, cores = OptimConfig(), args.params, args.threads
    # DeepSpeed's OpenMP loop shares torch's OpenMP runtime: each timed step sets the thread count
    # (torch.set_num_threads) for both; the variable covers a runtime that starts later.
    os.environ["OMP_NUM_THREADS"] = str(cores)
    torch.set_num_threads(cores)
    adam = shared_state(n, cfg)
    variants = {"ours": lambda: ours(adam, adam.kernel)}
    if not args.no_deepspeed:
        variants[DS] = lambda: deepspeed_adam(adam, cfg)
    variants["torch fused"] = lambda: ours(adam, None)
    if args.foreach:
        variants["foreach"] = lambda: torch_adamw(n, cfg)
    steps = {}
    for label, make in variants.items():
        torch.set_num_threads(cores)
        step = make()
        if step is None:
            print(f"{label}: deepspeed is not importable, not measured")
            continue
        steps[label] = step
    times = timed_rounds(steps, {label: cores for label in steps}, args.steps)
    rates = {label: [n / t / 1e6 for t in ts] for label, ts in times.items()}
    labels = list(rates)
    print(f"AdamW on {n:,} fp32 parameters, {cores} core(s), {args.steps} rounds in turn; Mparam/s per round:")
    print("round " + " ".join(f"{label:>16.16}" for label in labels) + ("   ours/DS" if DS in rates else ""))
    for r in range(args.steps):
        row = " ".join(f"{rates[label][r]:16.1f}" for label in labels)
        print(f"{r + 1:5d} {row}" + (f" {rates['ours'][r] / rates[DS][r]:8.2f}x" if DS in rates else ""))
    print(f"{'variant':<28} {'median':>10} {'best':>10}")
    for label in labels:
        print(f"{label:<28} {statistics.median(rates[label]):10.1f} {max(rates[label]):10.1f}")
    if DS in rates:
        ratios = [a / b for a, b in zip(rates["ours"], rates[DS])]
        print(f"ours / DeepSpeedCPUAdam: median of rounds {statistics.median(ratios):.2f}x, "
              f"best vs best {max(rates['ours']) / max(rates[DS]):.2f}x")
    print(f"host AdamW step: {max(rates['ours']):.1f} Mparam/s")


if __name__ == "__main__":
    main()
