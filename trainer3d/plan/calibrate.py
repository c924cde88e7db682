"""``python -m trainer3d.plan --calibrate [--out FILE] [--max-ranks N] [--quick]``: measure this machine once for the planner.

What the step-time model (step_time.py) needs of a CPU node, measured with torch on this
machine, written as a Device (devices.py) that ``cluster.gpu=calibrated`` reads:

- the fp32 (and bf16, fp16) matmul rate of one thread;
- the node's total matmul rate with 1, 2, 4 and 8 ranks computing at once, each with the
  threads trainer3d/rank/body.py gives it (cores // ranks, at least one): how the ranks share
  the cores, their caches and memory;
- the memory bandwidth of one thread (a large in-place add: the optimizer's kind of work);
- a transformer block's forward + backward on one thread: its dispatch overhead (at a
  negligible size) and the rate of its elementwise work (the block without its projections,
  in the bytes step_time.py charges);
- gloo all-reduce between 2 ranks: latency (a 1 KiB message) and bus bandwidth (16 MiB);
- the engine itself (trainer3d/plan/probe.py) on a model of negligible size (dim 32, 4
  blocks, 4 micro-batches of 32 tokens; each rank on one thread), where a step is only fixed costs: one process (the
  host time of a step outside the blocks), tp=2 on 2, 4 and 8 ranks (a hop of a collective
  while that many ranks share the cores: where ranks outnumber cores a peer may be waiting
  for one), pp=2 and pp=4 (a pipeline action's host time with 2 and 4 ranks on the node).
  Each figure is the value that makes step_time.py's prediction of that run equal its
  fastest measured step.

Compute figures are per CPU-second of one thread (``time.thread_time`` / ``process_time``):
what the machine does for a program that has it, whatever else runs on it meanwhile; the
node's rate with N one-thread ranks is min(N, cores) CPU-seconds per second at the rate
each reached while all ran. A rank with several threads is timed by the wall clock (best
round). Each figure is the best of several rounds (``Effort``: ``--quick`` takes fewer).
"""

import argparse
import dataclasses
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer3d.memory.activations import Sizes
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.model.transformer import Block
from trainer3d.plan.calibrate_gpu import calibrate_cuda
from trainer3d.plan.devices import DEFAULT_CALIBRATION, Device
from trainer3d.plan.probe import measured_step_s, training_config
from trainer3d.plan.search import evaluate
from trainer3d.plan.block_time import BWD_PASSES, FWD_PASSES, elementwise_bytes
from trainer3d.plan.calibrate_ranks import MATMUL, best_matmul_gflops, rank_all_reduce, rank_matmul, run_ranks

RANKS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Effort:
    """How hard each figure is measured: the best of ``rounds`` timed rounds of a kernel (a
    block's overhead: ``overhead_rounds``), of ``starts`` starts of the node's ranks (a start's
    first rounds may find the cores busy) and, in each engine probe, the fastest step after the
    first ``warmup`` of a ``steps``-step run."""

    rounds: int
    overhead_rounds: int
    node_rounds: int
    starts: int
    steps: int
    warmup: int


FULL = Effort(rounds=8, overhead_rounds=20, node_rounds=12, starts=3, steps=12, warmup=3)
QUICK = Effort(rounds=3, overhead_rounds=5, node_rounds=4, starts=1, steps=6, warmup=2)
"""``--quick``: every figure measured, each from fewer rounds, one start of the node's ranks
instead of three and 6-step engine probes: a coarser calibration (what the test tier runs)."""


def _best_rate(work: Callable[[], None], units: float, clock: Callable[[], float] = time.thread_time,
               rounds: int = 8) -> float:
    """units per second of ``clock`` in the fastest of ``rounds`` timed rounds of ``work``."""
    work()
    best = float("inf")
    for _ in range(rounds):
        started = clock()
        work()
        best = min(best, clock() - started)
    return units / max(best, 1e-9)


def matmul_gflops(dtype: torch.dtype = torch.float32, size: int = MATMUL, repeats: int = 4,
                  rounds: int = FULL.rounds) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return _best_rate(lambda: [torch.mm(a, b) for _ in range(repeats)], repeats * 2 * size ** 3, rounds=rounds) / 1e9


def memory_gbps(numel: int = 8 * 2 ** 20, rounds: int = FULL.rounds) -> float:
    a, b = torch.zeros(numel), torch.ones(numel)
    return _best_rate(lambda: a.add_(b), 3 * 4 * numel, rounds=rounds) / 1e9  # read a, read b, write a


def _projections_s(block: nn.Module, tokens: int, rounds: int) -> float:
    """Seconds of one thread for the forward and backward (input and weight gradients) of each
    linear layer of ``block`` on ``tokens`` rows: the block's projections, found in the model's
    own block, each timed alone."""
    total = 0.0
    for linear in [m for m in block.modules() if isinstance(m, nn.Linear)]:
        x = torch.randn(tokens, linear.in_features, requires_grad=True)
        total += 1.0 / _best_rate(lambda linear=linear, x=x: linear(x).sum().backward(), 1.0, rounds=rounds)
    return total


def block_figures(effort: Effort = FULL) -> Dict[str, float]:
    """Dispatch overhead and elementwise rate of a transformer block on one thread.

    The overhead is a block's forward + backward at a negligible size. The elementwise rate
    is what is left of the model's own block's forward + backward (dim = FFN width = heads x
    head_dim = 512, 2 x 128 tokens) once its seven projections, each timed alone, and that
    overhead are taken out: norms, RoPE, attention, SwiGLU's product and the residual adds,
    over the traffic the step-time model charges for them (FWD_PASSES + BWD_PASSES times what
    the block's elementwise operators write). The block is built by the model's code as it
    is, so the probe follows the model wherever it goes.
    """
    tiny = Block(ModelConfig(dim=8, n_heads=2, n_kv_heads=2, ffn_dim=8, max_seq_len=4))
    x = torch.randn(4, 1, 8, requires_grad=True)
    overhead = 1.0 / _best_rate(lambda: tiny(x).sum().backward(), 1.0, rounds=effort.overhead_rounds)
    cfg = Config(model=ModelConfig(dim=512, n_heads=8, n_kv_heads=8, ffn_dim=512, max_seq_len=128))
    cfg.train.micro_batch_size, cfg.train.seq_len = 2, 128
    block = Block(cfg.model)
    x = torch.randn(128, 2, 512, requires_grad=True)  # (seq, batch, dim), as blocks see it
    took = (1.0 / _best_rate(lambda: block(x).sum().backward(), 1.0, rounds=effort.rounds)
            - _projections_s(block, 2 * 128, effort.rounds))
    traffic = (FWD_PASSES + BWD_PASSES) * elementwise_bytes(Sizes.of(cfg))
    return {"layer_overhead_us": overhead * 1e6, "elementwise_gbps": traffic / max(took - overhead, 1e-9) / 1e9}


def node_gflops(ranks: int, cores: int, rounds: int = FULL.node_rounds,
                store: Optional[str] = None) -> Tuple[float, Optional[Dict[int, float]]]:
    """The node's total fp32 matmul rate with ``ranks`` processes computing at once: one-thread
    ranks give the cores they can have (min(ranks, cores)) at the rate per CPU-second each
    reached; a rank with several threads, its best round's rate. One rank is this process (with
    the threads trainer3d/rank/body.py would give it; one thread again after). With ``store``,
    the ranks also time gloo all-reduces once they have multiplied (calibrate_ranks.py:
    ``rank_matmul``): the rate, and those times (None without ``store``)."""
    threads = max(1, cores // ranks)
    times = None
    if ranks == 1 and store is None:
        rates = [best_matmul_gflops(threads, rounds)]
        torch.set_num_threads(1)
    else:
        got = run_ranks(rank_matmul, ranks, threads, rounds, store, results=ranks + (store is not None))
        rates = [value for kind, value in got if kind == "matmul"]
        times = next((value for kind, value in got if kind == "all_reduce"), None)
    if threads > 1:
        return sum(rates), times
    return min(ranks, cores) * sum(rates) / ranks, times


# The engine at a negligible size: what is left of a step is host time and fixed costs.
TINY = ("model=tiny", "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=32", "train.micro_batch_size=1", "train.grad_accum_steps=4",
        "train.global_batch_size=null", "train.dtype=fp32", "optim.warmup_steps=2", "parallel.timeout_s=600", "parallel=single")
TP_PROBES = {2: "parallel.tp=2", 4: "parallel.tp=2 parallel.dp=2", 8: "parallel.tp=2 parallel.dp=4"}
"""Ranks on the node -> the layout whose tensor-parallel collectives time a hop at that sharing."""
PP_PROBES = {2: "parallel.pp=2", 4: "parallel.pp=4"}
"""Ranks on the node -> the layout whose pipeline actions time one at that sharing."""
PROBE_ENV = {"OMP_NUM_THREADS": "1"}
"""Each rank of an engine probe runs on one thread (trainer3d/rank/threads.py cpu_threads reads
the variable): at a negligible size a step is host time, which one thread runs, as every
compute figure here is per CPU-second of one thread. With the launcher's share of the cores
instead (all of them for one process), each OpenMP region of a step waits for a second thread,
which on a machine busy with anything else waits for a core and makes the probe measure the
wait instead of the engine (tests/unit/test_plan.py holds every probe to this environment)."""


def _fit(predict: Callable[[float], float], measured: float) -> float:
    """The least x >= 0 with ``predict(x) >= measured`` (``predict`` grows with x), by bisection."""
    low, high = 0.0, 1e3
    if predict(low) >= measured:
        return 0.0
    while predict(high) < measured and high < 1e9:
        high *= 4
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(mid) < measured else (low, mid)
    return high


def engine_figures(figures: dict, max_ranks: int = RANKS[-1], effort: Effort = FULL) -> dict:
    """``step_overhead_us``, ``latency_by_ranks`` and ``action_by_ranks``, fitted in turn so
    that the step-time model, with the kernel ``figures`` measured before, predicts the
    engine's fastest step of each TINY probe on at most ``max_ranks`` ranks."""
    fitted: dict = {}

    def probe(layout: str, tmp: str) -> Callable[[Callable[[float], dict]], float]:
        overrides = [*TINY, *layout.split()]
        cfg = training_config(overrides)
        world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
        run_dir = Path(tmp) / f"probe-{len(os.listdir(tmp))}"
        took = min(measured_step_s(overrides, effort.steps, effort.warmup, run_dir, PROBE_ENV))
        print(f"calibrate: the engine at a negligible size, {layout or 'one process'}: {took * 1e3:.1f} ms/step",
              flush=True)

        def fit(changes: Callable[[float], dict]) -> float:
            return _fit(lambda x: evaluate(cfg, Device(**{**figures, **fitted, **changes(x)}), world, "gloo")
                        .step.total, took)
        return fit

    with tempfile.TemporaryDirectory() as tmp:
        fitted["step_overhead_us"] = probe("", tmp)(lambda x: {"step_overhead_us": x})
        latency: Dict[int, float] = {}
        for ranks, layout in [(r, lay) for r, lay in TP_PROBES.items() if r <= max_ranks]:
            latency[ranks] = probe(layout, tmp)(lambda x, ranks=ranks: {"latency_by_ranks": {**latency, ranks: x}})
        fitted["latency_by_ranks"] = latency
        action: Dict[int, float] = {}
        for ranks, layout in [(r, lay) for r, lay in PP_PROBES.items() if r <= max_ranks]:
            action[ranks] = probe(layout, tmp)(lambda x, ranks=ranks: {"action_by_ranks": {**action, ranks: x}})
        fitted["action_by_ranks"] = action
    return fitted


def all_reduce_figures(times: Optional[Dict[int, float]] = None) -> Dict[str, float]:
    """Latency and bus bandwidth of gloo all-reduce between 2 ranks, from ``times``
    (calibrate_ranks.py: ``all_reduce_times``), or timed by two ranks of their own."""
    if times is None:
        # A file store: a port probed free here could be taken again before rank 0 binds it.
        with tempfile.TemporaryDirectory() as tmp:
            (times,) = run_ranks(rank_all_reduce, 2, os.path.join(tmp, "store"))
    small, large = times[256], times[4 * 2 ** 20]
    # ring all-reduce over n = 2: 2 (n-1)/n B / bw + 2 (n-1) hops of latency
    return {"latency_us": small / 2 * 1e6, "gbps": 4 * 4 * 2 ** 20 / max(large - small, 1e-9) / 1e9}


def calibrate(max_ranks: int = RANKS[-1], effort: Effort = FULL) -> dict:
    """Every figure, the node's sharing measured with 1 up to ``max_ranks`` ranks (devices.py
    takes a count beyond the largest measured as that one)."""
    cores = os.cpu_count() or 1
    torch.set_num_threads(1)
    single = matmul_gflops(rounds=effort.rounds)
    node: Dict[int, float] = {}
    times = None
    with tempfile.TemporaryDirectory() as tmp:  # a file store: a port probed free could be taken before rank 0 binds it
        for ranks in [r for r in RANKS if r <= max_ranks]:
            rates = []
            for _ in range(effort.starts):  # the first start of two ranks times their all-reduces too
                rate, got = node_gflops(ranks, cores, effort.node_rounds,
                                        os.path.join(tmp, "store") if ranks == 2 and times is None else None)
                rates.append(rate)
                times = times or got
            node[ranks] = max(rates) / single
    block = block_figures(effort)
    collective = all_reduce_figures(times)
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    figures = {
        "name": "calibrated", "memory_gib": round(memory_gib, 1), "reserved_gib": 2.0,
        "matmul_tflops": {"fp32": single / 1e3, "bf16": matmul_gflops(torch.bfloat16, rounds=effort.rounds) / 1e3,
                          "fp16": matmul_gflops(torch.float16, repeats=1, rounds=effort.rounds) / 1e3},
        "memory_gbps": memory_gbps(rounds=effort.rounds), "elementwise_gbps": block["elementwise_gbps"],
        "intra_gbps": collective["gbps"], "inter_gbps": collective["gbps"], "latency_us": collective["latency_us"],
        "layer_overhead_us": block["layer_overhead_us"], "node_scaling": node, "shared_memory": True,
        "cores": cores, "source": f"calibrated on {socket.gethostname()} ({cores} cores, torch {torch.__version__}) "
                                  f"at {datetime.datetime.now():%Y-%m-%d %H:%M}",
    }
    return {**figures, **engine_figures(figures, max_ranks, effort)}


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer3d.plan --calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--out", default=DEFAULT_CALIBRATION, help="where to write (cluster.calibration reads it)")
    parser.add_argument("--max-ranks", type=int, choices=RANKS, default=RANKS[-1],
                        help="measure the node shared by 1 up to this many ranks (CPU nodes; fewer: a quicker, "
                             "coarser calibration for layouts of at most this many ranks)")
    parser.add_argument("--quick", action="store_true",
                        help="every figure from fewer rounds, one start of the node's ranks instead of three and "
                             "6-step engine probes: a quicker, coarser calibration (CPU nodes)")
    args = parser.parse_args(argv)
    # A CUDA node calibrates its GPU preset (calibrate_gpu.py); a CPU node measures everything.
    figures = calibrate_cuda() if torch.cuda.is_available() else calibrate(args.max_ranks, QUICK if args.quick else FULL)
    out = Path(os.path.expanduser(args.out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    print(f"written to {out}; plan with cluster.gpu=calibrated" + (f" cluster.calibration={args.out}"
                                                                     if args.out != DEFAULT_CALIBRATION else ""))
