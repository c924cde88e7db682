"""A CPU rank's torch threads (trainer3d/rank/task.py ``cpu_threads``): ``OMP_NUM_THREADS``
where it is set to a positive count, else the rank's share of the host's cores."""

import pytest

from trainer3d.rank.task import cpu_threads


@pytest.mark.parametrize("given, share, expected", [(None, 2, 2), ("1", 2, 1), ("4", 1, 4), (" 3 ", 8, 3),
                                                    ("0", 2, 2), ("", 2, 2), ("two", 2, 2), ("-1", 2, 2)])
def test_omp_num_threads_where_set_else_the_share(monkeypatch, given, share, expected):
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    assert cpu_threads(share) == expected
