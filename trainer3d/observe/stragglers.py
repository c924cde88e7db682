"""Stragglers: a rank persistently slower than its peers, named.

A synchronous step runs at the pace of its slowest rank, and the collectives even out the
step's wall time over the ranks: every rank's step takes as long, so a step's duration blames
nobody. What differs is where the time goes. A rank's *compute* is its forward and backward
up to the gradient reduction (on a pipeline stage, the stage's busy intervals only: its waits
on neighbours left out, trainer3d/parallel/pipeline/bubble.py); its *wait* is the rest of the
step up to the update (the reduction and the norm's all-reduce, and a stage's receives): the
slow rank computes longer and waits less, its peers wait for it.

Peers are the ranks doing the same work: those of the same pipeline stage (every dp, cp and
tp rank of it; stages differ in their layers and their loss). A step's *ratio* for a rank is
its compute over the median compute of its peers in that step. A rank is named when the
median of its ratios over the last ``train.straggler.window`` steps has been at or above
``train.straggler.threshold`` for ``train.straggler.persist`` steps in a row: a median over a
window, held, so a rank descheduled for a few steps, or a step stalled by the host, names
nobody. The default threshold of 1.5 sits above what clean soaks of CPU ranks on time-shared
cores reached (docs/failures.md, "Stragglers", gives their figures). A rank without peers (one
rank per stage) is never judged.

Cost: the times are marks on the host clock (CPU, where ops run synchronously) or CUDA events
recorded on the current stream (read only at the logging interval, when the metrics are read
anyway, so no extra sync); every ``train.log_every`` steps the (steps x 2) numbers of each rank
ride in the metrics' one all-gather (trainer3d/observe/metrics.py ``add_gathered``) to rank 0,
which judges and prints. Background: a straggler
detector of the same shape (per-rank op timings compared over ranks, a slowdown ratio) is
Megatron-LM's ``megatron/training/straggler_detector.py``.
"""

import os
import socket
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from trainer3d.config.schema import TrainConfig
from trainer3d.parallel.pipeline.bubble import seconds_between, stamp
from trainer3d.parallel.topology import ParallelDims


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class StragglerDetector:
    """Rank 0's judgement, on the per-rank compute times of each step (no communication)."""

    def __init__(self, window: int, threshold: float, peers: List[List[int]], persist: int = 1):
        """``peers``: groups of ranks doing the same work (every rank in exactly one)."""
        self.window, self.threshold, self.persist = window, threshold, persist
        self.peers_of = {r: [p for p in group if p != r] for group in peers for r in group}
        self.ratios: Dict[int, Deque[float]] = {r: deque(maxlen=window) for r in self.peers_of}
        self.streak: Dict[int, int] = {r: 0 for r in self.peers_of}
        """Consecutive steps each rank's window median has been at or above the threshold."""
        self.named: Dict[int, float] = {}
        """Ranks named now, with the median ratio that named them."""

    @property
    def span(self) -> int:
        """Steps a rank is slow over before it is named: its window, then ``persist`` - 1 more."""
        return self.window + self.persist - 1

    def ratio(self, rank: int, compute: Sequence[float]) -> Optional[float]:
        """``rank``'s compute over its peers' median (None without peers)."""
        peers = self.peers_of[rank]
        if not peers:
            return None
        median = _median([compute[p] for p in peers])
        if median <= 0:
            return 1.0 if compute[rank] <= 0 else float("inf")
        return compute[rank] / median

    def feed(self, compute: Sequence[float]) -> Tuple[Dict[int, float], List[Tuple[int, float]], List[int]]:
        """One step's compute per rank: (this step's ratios, ranks newly named with their median
        ratio over the window, ranks no longer named)."""
        ratios = {r: q for r in self.peers_of if (q := self.ratio(r, compute)) is not None}
        onset, cleared = [], []
        for rank, q in ratios.items():
            history = self.ratios[rank]
            history.append(q)
            level = _median(history)
            above = len(history) == self.window and level >= self.threshold
            self.streak[rank] = self.streak[rank] + 1 if above else 0
            slow = self.streak[rank] >= self.persist
            if slow and rank not in self.named:
                onset.append((rank, level))
            if not slow and rank in self.named:
                cleared.append(rank)
                del self.named[rank]
            if slow:
                self.named[rank] = level
        return ratios, onset, cleared


class StragglerWatch:
    """``start()`` before the step's forward, ``backward_done()`` after its last backward,
    ``end()`` after the gradient norm; ``mine``/``take`` ride in the metrics' all-gather
    (``MetricsLogger.add_gathered``) at each flush, on every rank."""

    def __init__(self, t: TrainConfig, dims: ParallelDims, stage_busy: Optional[Callable[[], list]] = None):
        """``stage_busy``: the last step's busy intervals of this rank's pipeline stage (None
        without a pipeline: the whole forward and backward is compute)."""
        self.on = t.straggler.window > 0
        self.dims, self.cuda = dims, dims.device.type == "cuda"
        self.stage_busy = stage_busy
        self.slow_s = t.inject.slow_ms / 1000.0 if t.inject.slow_rank == dims.rank else 0.0
        self._step: List[object] = []
        self._steps: List[Tuple[object, object, object, object, Optional[list]]] = []
        """Per step: stamps at its start, its backward's end, after the drill's delay, after the
        gradient norm; the pipeline stage's busy intervals."""
        world = dims.topo.world_size
        if not self.on:
            return
        where: List[object] = [None] * world
        dist.all_gather_object(where, (socket.gethostname(), _local_rank()))
        self.where: List[Tuple[str, int]] = where
        stages: Dict[int, List[int]] = {}
        for r in range(world):
            stages.setdefault(dims.topo.coords(r).pp, []).append(r)
        self.detector = StragglerDetector(t.straggler.window, t.straggler.threshold, list(stages.values()),
                                          t.straggler.persist)

    def start(self) -> None:
        if self.on:
            self._step = [stamp(self.cuda)]

    def backward_done(self) -> None:
        if self.on:
            self._step.append(stamp(self.cuda))
        if self.slow_s:
            time.sleep(self.slow_s)  # train.inject.slow_ms: this rank's backward ends late
        if self.on:
            self._step.append(stamp(self.cuda))

    def end(self) -> None:
        if self.on:
            busy = list(self.stage_busy()) if self.stage_busy is not None else None
            self._steps.append((*self._step, stamp(self.cuda), busy))

    def _times(self) -> List[Tuple[float, float]]:
        """(compute, wait) seconds of each step since the last read."""
        out = []
        for start, backward_end, computed, end, busy in self._steps:
            step = seconds_between(self.cuda, start, end)
            if busy is None:
                compute = seconds_between(self.cuda, start, computed)
            else:  # a stage's receives inside its schedule are waits; the drill's delay is not
                compute = sum(seconds_between(self.cuda, a, b) for a, b in busy)
                compute += seconds_between(self.cuda, backward_end, computed)
            out.append((compute, max(0.0, step - compute)))
        self._steps = []
        return out

    def mine(self) -> torch.Tensor:
        """This rank's (compute, wait) seconds of each step since the last flush, flattened."""
        if not self.on:
            return torch.zeros(0, dtype=torch.float64, device=self.dims.device)
        return torch.tensor(self._times(), dtype=torch.float64, device=self.dims.device).reshape(-1)

    def take(self, rows: torch.Tensor) -> Dict[str, List[Optional[float]]]:
        """Every rank, with every rank's ``mine()`` (world, steps x 2): rank 0 judges them, prints
        whom it names and returns the columns of metrics.jsonl (others: {})."""
        if not self.on or self.dims.rank != 0:
            return {}
        times = rows.reshape(rows.shape[0], rows.shape[1] // 2, 2).tolist()  # (rank, step, [compute, wait])
        columns: Dict[str, List[Optional[float]]] = {k: [] for k in (
            "rank_compute_s", "rank_wait_s", "slowest_rank", "slowest_ratio", "straggler_rank", "straggler_ratio")}
        for i in range(len(times[0])):
            compute = [times[r][i][0] for r in range(len(times))]
            ratios, onset, cleared = self.detector.feed(compute)
            for rank, level in onset:
                print(f"trainer3d: straggler: {self.name(rank)} {level:.2f}× the median compute for "
                      f"{self.detector.span} steps (of its peers, the ranks of its pipeline stage; "
                      f"train.straggler.threshold={self.detector.threshold:g})", flush=True)
            for rank in cleared:
                print(f"trainer3d: straggler: {self.name(rank)} is back under "
                      f"{self.detector.threshold:g}× its peers' median compute", flush=True)
            slowest = max(ratios, key=ratios.get) if ratios else None
            worst = max(self.detector.named, key=self.detector.named.get) if self.detector.named else None
            for key, value in (("rank_compute_s", _median(compute)),
                               ("rank_wait_s", _median([times[r][i][1] for r in range(len(times))])),
                               ("slowest_rank", slowest), ("slowest_ratio", ratios.get(slowest)),
                               ("straggler_rank", worst), ("straggler_ratio", self.detector.named.get(worst))):
                columns[key].append(value)
        return columns

    def name(self, rank: int) -> str:
        host, local = self.where[rank]
        return f"rank {rank} (node {host}, local rank {local})"


def _local_rank() -> int:
    """This process's rank on its node, as the launcher exported it (torchrun/submitit's
    LOCAL_RANK, Slurm's SLURM_LOCALID)."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0
