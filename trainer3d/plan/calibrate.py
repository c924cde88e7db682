"""``python -m trainer3d.plan --calibrate [--out FILE]``: measure this machine once for the planner.

What the step-time model (step_time.py) needs of a CPU node, measured with torch on this
machine, written as a Device (devices.py) that ``cluster.gpu=calibrated`` reads:

- matmul rate of one rank on one thread (fp32, bf16), and the node's total rate with 1, 2,
  4 and 8 ranks computing at once, each with the threads trainer3d/launch.py gives it
  (cores // ranks, at least one): how the node's cores are shared, and what else runs on it
  (on a machine shared with other jobs, more ranks win a larger share of it);
- memory bandwidth of one thread (a large in-place add), for elementwise work and the optimizer;
- dispatch overhead of one transformer block forward + backward at a negligible size;
- gloo all-reduce between 2 ranks: latency (a 1 KiB message) and bus bandwidth (16 MiB).

Rates are sustained over 1 s rounds (the best of three) in fresh processes, as ranks run;
on a machine shared with other jobs, calibrate when the load is what the runs will see.
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from trainer3d.plan.devices import DEFAULT_CALIBRATION

MATMUL = 512
RANKS = (1, 2, 4, 8)


def _best_rate(work: Callable[[], None], units: float, seconds: float = 0.6) -> float:
    """units / s of the fastest of several timed rounds of ``work``."""
    work()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return units / best


def matmul_gflops(dtype: torch.dtype = torch.float32, size: int = MATMUL, repeats: int = 4) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return _best_rate(lambda: [torch.mm(a, b) for _ in range(repeats)], repeats * 2 * size ** 3) / 1e9


def memory_gbps(numel: int = 8 * 2 ** 20) -> float:
    a, b = torch.zeros(numel), torch.ones(numel)
    return _best_rate(lambda: a.add_(b), 3 * 4 * numel) / 1e9  # read a, read b, write a


def layer_overhead_us() -> float:
    from trainer3d.config import ModelConfig
    from trainer3d.model.transformer import Block

    block = Block(ModelConfig(dim=8, n_heads=2, n_kv_heads=2, ffn_dim=8, max_seq_len=4))
    x = torch.randn(1, 4, 8, requires_grad=True)
    return 1e6 / _best_rate(lambda: block(x).sum().backward(), 1.0)


def _rank_matmul(rank: int, world: int, threads: int, rounds: int, seconds: float, barrier, out) -> None:
    """Rounds of ``seconds`` in which every rank multiplies at once (a barrier starts each)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    torch.mm(a, b)
    done = []
    for _ in range(rounds):
        barrier.wait()
        count, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            torch.mm(a, b)
            count += 1
        done.append(count * 2 * MATMUL ** 3 / (time.perf_counter() - began) / 1e9)
    out.put(done)


def _rank_all_reduce(rank: int, world: int, port: int, out, repeats: int = 20) -> None:
    """The fastest of ``repeats`` all-reduces per size (a fixed count: every rank must join each)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    times = {}
    for numel in (256, 4 * 2 ** 20):
        t = torch.ones(numel)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - started)
        times[numel] = best
    dist.destroy_process_group()
    if rank == 0:
        out.put(times)


def _run(target: Callable, ranks: int, *args, results: int = 1) -> List:
    """Start ``ranks`` processes running ``target(rank, ranks, *args, queue)``; the first
    ``results`` things they put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if target is _rank_matmul:
        args = (*args, ctx.Barrier(ranks))
    procs = [ctx.Process(target=target, args=(r, ranks, *args, queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=600) for _ in range(results)]
    for p in procs:
        p.join(timeout=60)
    return out


def node_gflops(ranks: int, threads: int, rounds: int = 3, seconds: float = 1.0) -> float:
    """The node's total fp32 matmul rate with ``ranks`` processes computing at once (best round)."""
    per_rank = _run(_rank_matmul, ranks, threads, rounds, seconds, results=ranks)
    return max(sum(rates) for rates in zip(*per_rank))


def all_reduce_figures() -> Dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (times,) = _run(_rank_all_reduce, 2, port)
    small, large = times[256], times[4 * 2 ** 20]
    # ring all-reduce over n = 2: 2 (n-1)/n B / bw + 2 (n-1) hops of latency
    return {"latency_us": small / 2 * 1e6, "gbps": 4 * 4 * 2 ** 20 / (large - small) / 1e9}


def calibrate() -> dict:
    cores = os.cpu_count() or 1
    torch.set_num_threads(1)
    # Sustained rates (1 s rounds in fresh processes, as the ranks run) set the scale; the
    # in-process best-of-many figures give the ratios to it (bf16/fp16, memory, dispatch).
    single = node_gflops(1, threads=1)
    node = {r: node_gflops(r, threads=max(1, cores // r)) / single for r in RANKS}
    scale = single / matmul_gflops()
    collective = all_reduce_figures()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return {
        "name": "calibrated", "memory_gib": round(memory_gib, 1), "reserved_gib": 2.0,
        "matmul_tflops": {"fp32": single / 1e3, "bf16": scale * matmul_gflops(torch.bfloat16) / 1e3,
                          "fp16": scale * matmul_gflops(torch.float16) / 1e3},
        "memory_gbps": scale * memory_gbps(), "intra_gbps": collective["gbps"], "inter_gbps": collective["gbps"],
        "latency_us": collective["latency_us"], "layer_overhead_us": layer_overhead_us() / scale,
        "node_scaling": node, "shared_memory": True, "cores": cores,
        "source": f"calibrated on {socket.gethostname()} ({cores} cores, torch {torch.__version__}) at "
                  f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
    }


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer3d.plan --calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--out", default=DEFAULT_CALIBRATION, help="where to write (cluster.calibration reads it)")
    args = parser.parse_args(argv)
    figures = calibrate()
    out = Path(os.path.expanduser(args.out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    print(f"written to {out}; plan with cluster.gpu=calibrated" + (f" cluster.calibration={args.out}"
                                                                     if args.out != DEFAULT_CALIBRATION else ""))
