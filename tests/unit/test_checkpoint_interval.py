"""checkpoint.every=auto's interval (trainer3d/checkpoint/interval.py) against a brute-force
optimum over a simulated failure process: exponentially distributed interruptions, each
losing the work since the last save plus a restart, each save standing the run still."""

import math

import numpy as np
import pytest

from trainer3d.checkpoint.interval import AutoInterval, Measured, daly, expected_time, young


def simulate(work: float, tau: float, delta: float, mtbf: float, restart: float, rng) -> float:
    """Wall time of one run doing ``work`` seconds of training, saving every ``tau`` (a save
    ``delta``), failing after exponential(mtbf) seconds of wall time, restarting in ``restart``
    (a failure during a restart starts it again)."""
    done, wall, next_failure = 0.0, 0.0, rng.exponential(mtbf)
    while done < work:
        segment = min(tau, work - done) + delta
        if wall + segment <= next_failure:
            wall, done = wall + segment, done + segment - delta
            continue
        wall = next_failure  # the segment's work is lost
        while True:
            next_failure = wall + rng.exponential(mtbf)
            if next_failure >= wall + restart:
                wall += restart
                break
            wall = next_failure
    return wall


@pytest.mark.parametrize("delta, mtbf", [(30.0, 24 * 3600.0), (300.0, 4 * 3600.0), (5.0, 600.0), (60.0, 300.0)])
def test_daly_is_within_5_percent_of_the_brute_force_optimum(delta, mtbf):
    work, restart = 50 * mtbf, 0.1 * mtbf
    grid = np.geomspace(delta / 10, 20 * mtbf, 20000)
    cost = [expected_time(work, t, delta, mtbf, restart) for t in grid]
    best = float(grid[int(np.argmin(cost))])
    lost = lambda tau: expected_time(work, tau, delta, mtbf, restart) - work  # noqa: E731
    assert abs(daly(delta, mtbf) - best) <= 0.05 * best
    assert lost(daly(delta, mtbf)) <= 1.05 * lost(best)  # and the expected lost time with it


def test_the_expectation_is_what_the_simulated_process_gives():
    rng = np.random.default_rng(0)
    delta, mtbf, restart, work = 20.0, 1000.0, 50.0, 20000.0
    for tau in (100.0, daly(delta, mtbf), 800.0):
        runs = [simulate(work, tau, delta, mtbf, restart, rng) for _ in range(400)]
        assert np.mean(runs) == pytest.approx(expected_time(work, tau, delta, mtbf, restart), rel=0.05)


def test_young_is_daly_to_first_order():
    assert young(1.0, 1e6) == pytest.approx(math.sqrt(2e6))
    assert daly(1.0, 1e6) == pytest.approx(young(1.0, 1e6), rel=1e-3)
    assert daly(10.0, 4.0) == 4.0  # a save longer than 2 M: save every M


def test_the_interval_in_steps_and_its_reasons():
    auto = AutoInterval(mtbf_hours=1.0)
    assert auto.due(10) and not auto.due(9)  # the first save measures
    line = auto.retune(Measured(step_s=0.5, stall_s=2.0, write_s=2.0), last_saved=10, steps_done=10)
    tau = daly(2.0, 3600.0)
    assert auto.every == round(tau / 0.5) and auto.next_at == 10 + auto.every
    assert f"every {auto.every} steps, next at step {auto.next_at}" in line and "Daly" in line
    # A background write longer than the optimum: the interval waits for it.
    line = auto.retune(Measured(step_s=0.5, stall_s=0.01, write_s=60.0), last_saved=40, steps_done=41)
    assert auto.every == 120 and "must not wait" in line
