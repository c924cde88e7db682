"""``checkpoint.every=auto``: the checkpoint interval that loses the least expected time.

A run that saves every ``tau`` seconds of training, stands still ``delta`` seconds per save
and fails on average every ``M`` seconds (exponentially distributed: independent
interruptions) loses, per failure, the work since the last save plus the restart; per save,
``delta``. Young (1974, "A first order approximation to the optimum checkpoint interval",
CACM 17(9)) minimised the first-order cost: ``tau = sqrt(2 delta M)``. Daly (2006, "A higher
order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), eq. 37)
solved the exact expected run time of that failure process,

    T(tau) = M e^(R/M) (e^((tau + delta)/M) - 1) W / tau     (W seconds of work, R restart)

to higher order: ``tau = sqrt(2 delta M) (1 + sqrt(delta/2M)/3 + (delta/2M)/9) - delta`` for
``delta < 2M``, else ``tau = M``. ``R`` scales T by a constant, so it does not move the
optimum.

The run measures ``delta`` (each save's stall: the loop's standstill, the whole save when
written in the loop), the write time (a background save must end before the next begins, so
the interval is at least that) and its step time; ``M`` is ``checkpoint.mtbf_hours``, or (``auto``) rank 0's estimate from the
run dir's history of interruptions (trainer3d/checkpoint/history.py). The
first save comes after ``FIRST_SAVE`` steps, to measure what a save costs; every save after
it recomputes the interval from rank 0's measurements, broadcast so every rank saves at the
same step.
"""

import math
from dataclasses import dataclass
from typing import Optional

FIRST_SAVE = 10
"""Steps before the first save of ``auto``, which measures what a save costs."""


def young(delta: float, mtbf: float) -> float:
    """Young's first-order optimum, seconds of training between saves."""
    return math.sqrt(2.0 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum, seconds of training between saves."""
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def expected_time(work: float, tau: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    """Daly's exact expected wall time to do ``work`` seconds of training, saving every ``tau``."""
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) * work / tau


@dataclass
class Measured:
    step_s: float
    stall_s: float
    write_s: float


class AutoInterval:
    """When ``auto`` saves next: ``due(steps_done)``; ``retune`` after each measured save."""

    def __init__(self, mtbf_hours: float):
        self.mtbf_s = mtbf_hours * 3600.0
        self.every: Optional[int] = None
        """Steps between saves (None until the first save was measured)."""
        self.next_at = FIRST_SAVE

    def due(self, steps_done: int) -> bool:
        return steps_done >= self.next_at

    def count_from(self, steps_done: int) -> None:
        """A save started, or a resume (a rollback) loaded, at ``steps_done``: the next save one
        interval later (``FIRST_SAVE`` steps before any was measured) until ``retune`` says."""
        self.next_at = steps_done + (self.every or FIRST_SAVE)

    def retune(self, m: Measured, last_saved: int, steps_done: int) -> str:
        """Recompute from ``m``, counting from the newest save, at ``last_saved``; the line that says why."""
        if m.step_s <= 0:  # no step timed since the start (a save right after a resume)
            self.count_from(steps_done)
            return f"checkpoint.every=auto: no step timed yet; next save at step {self.next_at}"
        tau = daly(m.stall_s, self.mtbf_s)
        optimum = max(1, round(tau / m.step_s))
        # steps a write spans, rounding noise dropped (a write of 10 steps measured as 10.000000000000002
        # still fits in 10)
        self.every = max(optimum, math.ceil(round(m.write_s / m.step_s, 9)))
        self.next_at = max(last_saved + self.every, steps_done + 1)
        by_write = self.every > optimum
        why = (f"a background save takes {m.write_s:.2f} s and the next must not wait for it" if by_write else
               f"Daly's optimum {tau:.2f} s of training (Young's first order {young(m.stall_s, self.mtbf_s):.2f} s)")
        return (f"checkpoint.every=auto: every {self.every} steps, next at step {self.next_at}: {why}; "
                f"measured save stall {m.stall_s:.3f} s, write {m.write_s:.3f} s, step {m.step_s:.4f} s; "
                f"mean time between interruptions {self.mtbf_s:.0f} s (checkpoint.mtbf_hours)")
