"""A rank's CPU threads (trainer3d/rank/threads.py): its part of the cores of its affinity mask,
shared with the node's other ranks unless Slurm gave each task its own; ``OMP_NUM_THREADS`` where
the user set it. The pure rule against a hand count, then real processes whose mask is set before
they start (as taskset and Slurm's binding set it), on CPU and CUDA ranks alike (the function
never touches a device)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trainer3d.rank.threads import cpu_threads, rank_share


@pytest.mark.parametrize("given, share, expected", [(None, 2, 2), ("1", 2, 1), ("4", 1, 4), (" 3 ", 8, 3),
                                                    ("0", 2, 2), ("", 2, 2), ("two", 2, 2), ("-1", 2, 2)])
def test_omp_num_threads_where_set_else_the_share(given, share, expected):
    env = {} if given is None else {"OMP_NUM_THREADS": given}
    assert cpu_threads(share, env) == expected


@pytest.mark.parametrize("cores, local_world, cpus_per_task, expected", [
    (96, 8, None, 12),  # a node's mask shared by 8 ranks (local launcher, torchrun, no binding)
    (96, 8, 12, 12),    # no binding: the whole node's mask though each task asked for 12
    (12, 8, 12, 12),    # Slurm bound each task to its 12 cores: the mask is the rank's own
    (1, 8, 1, 1),       # Slurm's default of one CPU per task
    (2, 4, None, 1),    # fewer cores than ranks: one thread each, never zero
    (7, 2, None, 3),
])
def test_the_share_is_the_rank_s_part_of_its_mask(cores, local_world, cpus_per_task, expected):
    assert rank_share(cores, local_world, cpus_per_task) == expected


_PROBE = """
import json, os, sys, torch, torch._inductor.config as inductor_config
from trainer3d.rank.threads import set_host_threads
KNOBS = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "LOCAL_WORLD_SIZE", "SLURM_CPUS_PER_TASK")
for mask, env in json.loads(sys.argv[1]):
    for knob in KNOBS:
        os.environ.pop(knob, None)
    os.environ.update(env)
    os.sched_setaffinity(0, mask)
    threads = set_host_threads()
    print(json.dumps({"threads": threads, "torch": torch.get_num_threads(), "compile": inductor_config.compile_threads,
                      "omp": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count()}))
"""


def _probe(cases):
    """``set_host_threads`` of a rank under each (mask, environment) of ``cases``, in one fresh
    process (one import of torch and inductor's config): the mask set before it starts for the
    first, and by the process itself for each later one, as taskset or Slurm's binding would
    have set it; torch's and inductor's thread counts, the OpenMP variable, os.cpu_count()."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "LOCAL_WORLD_SIZE", "SLURM_CPUS_PER_TASK")}
    first = cases[0][0]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([[sorted(m), e] for m, e in cases])],
                         env={**clean, "PYTHONPATH": str(ROOT), **cases[0][1]},
                         preexec_fn=lambda: os.sched_setaffinity(0, first), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()[-len(cases):]]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of two cores or more to narrow")
def test_threads_follow_the_affinity_mask_not_the_machine():
    one = {min(os.sched_getaffinity(0))}
    two = set(sorted(os.sched_getaffinity(0))[:2])
    alone, shared, own, user = _probe([
        (one, {"LOCAL_WORLD_SIZE": "1"}),  # taskset -c 0: one core of a machine of more
        (two, {"LOCAL_WORLD_SIZE": "2"}),  # two ranks share two cores
        (two, {"LOCAL_WORLD_SIZE": "2", "SLURM_CPUS_PER_TASK": "2"}),  # Slurm bound these two to this task
        (two, {"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}),  # the user's setting stands
    ])
    assert alone["cpu_count"] >= 2
    assert (alone["threads"], alone["torch"], alone["compile"], alone["omp"]) == (1, 1, 1, "1")
    assert (shared["torch"], shared["compile"]) == (1, 1)
    assert (own["torch"], own["compile"], own["omp"]) == (2, 2, "2")
    assert (user["torch"], user["compile"], user["omp"]) == (1, 2, "1")
