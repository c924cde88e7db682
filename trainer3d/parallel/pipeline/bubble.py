"""The pipeline bubble, measured: how much of a step each stage spends idle.

A rank's *busy* time is its stage compute — forward and backward of each micro-batch
(the loss included on the last stage); its *wall* time is the span of the schedule's
step (``Pipeline.forward_backward``: the micro-batches' forwards and backwards with
their sends and receives; the gradient reduction and optimizer step that follow are not
pipeline time). ``bubble = 1 - busy / wall`` is the fraction of the step the rank
waited on its neighbours.

Theory, for equal stages and free communication (Huang et al. 2019, GPipe, sec. 2.2;
Narayanan et al. 2021, sec. 2.2): a step of m micro-batches on p stages takes
(m + p - 1) slots of one micro-batch's forward+backward, each stage is busy m of them,
so ``bubble_theory = (p - 1) / (m + p - 1)`` for GPipe and 1F1B alike. Interleaving v
virtual stages per rank shrinks the fill and drain v-fold; the project reports
``(p - 1) / (v (m + p - 1))`` (in metrics.jsonl and tools/bench/pipeline.py). The exact idle share of an ideal
interleaved step is (p - 1) / (v m + p - 1); the two agree for m >> p.

On CPU the clock is ``time.perf_counter`` (ops run synchronously). On CUDA it records
events on the current stream and resolves them only when the metrics are read, at the
logging interval, so the step never waits for the device.
"""

import time
from contextlib import contextmanager
from typing import Callable, List, Optional, Tuple

import torch

from trainer3d.parallel.pipeline.timeline import ZERO_BUBBLE, schedule_bubble


def stamp(cuda: bool):
    """A point in time on this rank's work: a CUDA event recorded on the current stream (read
    only later, so the host never waits for the device), or the host clock on CPU, where ops
    run synchronously."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(cuda: bool, start, end) -> float:
    """Seconds from one ``stamp`` to a later one (on CUDA it waits for ``end``: call it where the
    loop reads the device anyway, at the logging interval)."""
    if cuda:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    return end - start


def bubble_theory(pp: int, n_micro: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """The idle fraction of an ideal pipeline step: (p - 1) / (v (m + p - 1)); for the zero-bubble
    schedules, that of torch's own action lists run with unit costs (timeline.py)."""
    if schedule in ZERO_BUBBLE:
        return schedule_bubble(schedule, pp, virtual_stages, n_micro)
    return (pp - 1) / (virtual_stages * (n_micro + pp - 1))


class StageClock:
    """Busy intervals of this rank's stage compute inside each pipeline step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._busy: List[Tuple[object, object]] = []
        self._step_start: Optional[object] = None
        self._steps: List[Tuple[object, object, List[Tuple[object, object]]]] = []
        self.last_busy: List[Tuple[object, object]] = []
        """The busy intervals (``stamp`` pairs) of the last step ended, for the straggler watch
        (trainer3d/observe/stragglers.py: a stage's compute, its waits on neighbours left out)."""

    def _now(self):
        return stamp(self.cuda)

    def _seconds(self, start, end) -> float:
        return seconds_between(self.cuda, start, end)

    @property
    def in_step(self) -> bool:
        return self._step_start is not None

    def start_step(self) -> None:
        self._busy = []
        self._step_start = self._now()

    def end_step(self) -> None:
        self._steps.append((self._step_start, self._now(), self._busy))
        self.last_busy = self._busy
        self._step_start, self._busy = None, []

    @contextmanager
    def busy(self):
        """Count the enclosed work as stage compute (only inside a step)."""
        if self._step_start is None:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            self._busy.append((start, self._now()))

    def timed(self, fn: Callable) -> Callable:
        """``fn`` with its calls counted as compute."""
        def wrapper(*args, **kwargs):
            with self.busy():
                return fn(*args, **kwargs)
        return wrapper

    def pop_times(self) -> List[Tuple[float, float]]:
        """(busy, wall) seconds of each step since the last call."""
        out = []
        for start, end, busy in self._steps:
            out.append((sum(self._seconds(a, b) for a, b in busy), self._seconds(start, end)))
        self._steps = []
        return out

    def pop_bubbles(self) -> List[float]:
        """The idle fraction 1 - busy / wall of each step since the last call."""
        return [1.0 - busy / wall if wall > 0 else 0.0 for busy, wall in self.pop_times()]
