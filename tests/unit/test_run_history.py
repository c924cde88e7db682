"""checkpoint.mtbf_hours=auto: the time between interruptions from the run dir's history
(trainer3d/checkpoint/history.py), against counts made by hand."""

import pytest

from trainer3d.checkpoint import history

H = 3600.0


def test_no_history_is_the_prior(tmp_path):
    hours, why = history.estimate(history.read(str(tmp_path)), now=0.0)
    assert hours == history.DEFAULT_PRIOR_HOURS and "no history" in why and "24 h" in why


def test_interruptions_over_hours_of_running_with_the_prior(tmp_path):
    """Start 0 h, crash (no end) at ~10 h restart, preempted (stopped) at 15 h, restarted at 16 h
    and running at 20 h: 2 interruptions in 10 + 5 + 4 = 19 h of running (the hour queued
    after the preemption is not running), so (19 + 24) / 3 h."""
    for event in ({"event": "start", "time": 0.0, "step": 0}, {"event": "start", "time": 10 * H, "step": 900},
                  {"event": "end", "time": 15 * H, "step": 1400, "how": "stopped"},
                  {"event": "start", "time": 16 * H, "step": 1400}):
        history.append(str(tmp_path), event)
    (tmp_path / history.FILE_NAME).open("a").write('{"event": "start", "ti')  # a line cut short by a crash
    events = history.read(str(tmp_path))
    assert len(events) == 4
    assert history.interruptions(events, now=20 * H) == (2, pytest.approx(19.0))
    hours, why = history.estimate(events, now=20 * H)
    assert hours == pytest.approx((19 + 24) / 3)
    assert "2 interruption(s) in 19.00 h" in why


def test_a_finished_run_continued_later_is_not_an_interruption(tmp_path):
    events = [{"event": "start", "time": 0.0}, {"event": "end", "time": 5 * H, "how": "finished"},
              {"event": "start", "time": 100 * H}]
    assert history.interruptions(events, now=101 * H) == (0, pytest.approx(6.0))
    assert history.estimate(events, now=101 * H)[0] == pytest.approx(6.0 + 24.0)
