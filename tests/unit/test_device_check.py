"""Devices are decided and checked, never guessed (trainer3d/config/device.py): the pure rules
through validate(), the local machine's GPU count before launch, and the rank's own check.
No GPU needed: the machine's GPU count is a parameter, the rank check is fed a CPU-only torch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.test_validate import make
from trainer3d.config.device import (DeviceError, cuda_index, exact_pinned_sizes, machine_problems, rank_device,
                                     uses_cuda)
from trainer3d.launch.slurm import slurm_parameters
from trainer3d.config.validate import ConfigError, validate

SLURM = ["launcher=slurm", "launcher.nodes=1"]

REFUSED = [
    (SLURM + ["launcher.gpus_per_node=4"], "launcher.tasks_per_node=2 but launcher.gpus_per_node=4"),
    (["launcher.gpus_per_node=2", "train.device=cpu"], "asks for GPUs but train.device=cpu"),
    (["launcher.gpus_per_node=-1"], "launcher.gpus_per_node=-1 must be >= 0"),
    (SLURM + ["train.device=cuda"], "train.device=cuda on Slurm needs GPUs in the request"),
    (["parallel.backend=nccl", "train.device=cpu"], "parallel.backend=nccl needs CUDA ranks"),
    (["parallel.init_timeout_s=0"], "parallel.init_timeout_s=0.0 must be in (0, 3.1536e+07)"),
]


@pytest.mark.parametrize("overrides, fragment", REFUSED)
def test_device_rules_refused_before_launch(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    assert any(fragment in p for p in err.value.problems), err.value.problems


def test_gpu_slurm_job_asks_for_one_gpu_per_task():
    cfg = validate(make(SLURM + ["launcher.gpus_per_node=2"]))
    params = slurm_parameters(cfg, 2)
    assert params["gpus_per_node"] == params["tasks_per_node"] == 2
    assert uses_cuda(cfg, cuda_visible=False)  # the login node's view does not matter
    assert not uses_cuda(validate(make(SLURM)), cuda_visible=True)  # no GPUs requested: CPU ranks


def test_cpus_per_task_reaches_the_job_and_its_srun_step(tmp_path):
    """Slurm 22.05-23.02's srun does not inherit the job's --cpus-per-task: it is given to srun too."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = slurm_parameters(validate(make(SLURM + ["launcher.gpus_per_node=2", "launcher.cpus_per_task=12"])), 2)
    assert params["cpus_per_task"] == 12 and params["slurm_srun_args"] == ["--cpus-per-task=12"]
    text = _make_sbatch_string(command="python -m x", folder=str(tmp_path), cpus_per_task=12,
                               srun_args=params["slurm_srun_args"])
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "#SBATCH --cpus-per-task=12" in text and len(srun) == 1 and "--cpus-per-task=12" in srun[0]
    assert "slurm_srun_args" not in slurm_parameters(validate(make(SLURM)), 2)


@pytest.mark.parametrize("overrides, gpus, fragment", [
    (["train.device=cuda"], 0, "train.device=cuda but no CUDA device is visible here"),
    (["launcher.gpus_per_node=2"], 0, "launcher.gpus_per_node=2 but no CUDA device is visible"),
    (["train.device=cuda"], 1, "= 2 ranks on this machine, but 1 GPU(s) are visible"),
    (["parallel=tp2-pp2-dp2"], 4, "= 8 ranks on this machine, but 4 GPU(s) are visible"),  # auto picks CUDA
])
def test_local_machine_without_enough_gpus_refused(overrides, gpus, fragment):
    problems = machine_problems(validate(make(overrides)), 8 if "parallel=tp2-pp2-dp2" in overrides else 2, gpus)
    assert len(problems) == 1 and fragment in problems[0], problems


def test_local_machine_checks_pass_where_they_should():
    assert machine_problems(validate(make(["train.device=cuda"])), 2, device_count=2) == []
    assert machine_problems(validate(make([])), 2, device_count=0) == []  # auto on a CPU machine: CPU
    assert machine_problems(validate(make(["train.device=cpu"])), 2, device_count=1) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_rank_refuses_cuda_it_cannot_see(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DeviceError, match="sees no GPU"):
        rank_device(validate(make(["train.device=cuda"])))
    assert rank_device(validate(make([]))) == torch.device("cpu")


def test_rank_refuses_a_local_rank_beyond_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(DeviceError, match="LOCAL_RANK=2 of LOCAL_WORLD_SIZE=3 but this task sees 2 GPU"):
        rank_device(validate(make(["train.device=cuda"])))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_device(validate(make(["train.device=cuda"]))) == torch.device("cuda", 1)


# What a task of an 8-GPU node sees under each way Slurm hands out GPUs (srun(1), "--gpus-per-task",
# "--gpu-bind"; SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_TASK are set in the job's environment).
ALL_VISIBLE = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_GPUS_ON_NODE": "8", "LOCAL_WORLD_SIZE": "8"}
PER_TASK = {"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_TASK": "1", "LOCAL_WORLD_SIZE": "8"}
BOUND = {"SLURM_GPUS_ON_NODE": "8", "SLURM_GPU_BIND": "single:1", "LOCAL_WORLD_SIZE": "8"}  # --gpu-bind only


@pytest.mark.parametrize("visible, env, expected", [
    (8, {**ALL_VISIBLE, "LOCAL_RANK": "5"}, 5),
    (8, {**ALL_VISIBLE, "LOCAL_RANK": "0"}, 0),
    (1, {**PER_TASK, "LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "5"}, 0),
    (1, {**PER_TASK, "LOCAL_RANK": "7", "CUDA_VISIBLE_DEVICES": "0"}, 0),  # cgroup-constrained: its own GPU is 0
    (1, {**BOUND, "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 0),
    (1, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 0),  # one rank, one GPU, no Slurm
    (4, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 3),  # torchrun on a 4-GPU machine
])
def test_each_rank_takes_its_own_gpu_whether_tasks_see_all_or_one(visible, env, expected):
    assert cuda_index(visible, env) == expected


@pytest.mark.parametrize("visible, env", [
    (1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),  # two ranks on a one-GPU machine: NCCL would refuse
    (1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "SLURM_GPUS_ON_NODE": "4"}),  # 8 tasks, 4 GPUs on the node
    (2, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_TASK": "2"}),
    (4, {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "SLURM_GPUS_ON_NODE": "4"}),
])
def test_a_rank_without_a_gpu_of_its_own_is_refused_naming_the_knob(visible, env):
    with pytest.raises(DeviceError, match="launcher.tasks_per_node") as err:
        cuda_index(visible, env)
    assert f"this task sees {visible} GPU(s)" in str(err.value) and "--gpus-per-task=1" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_entry_point_refuses_cuda_without_gpu_before_any_rank(monkeypatch, capsys):
    """The entry point's run (trainer3d/train.py ``run``, in this process: the path from the
    command line to its exit status is tests/unit/test_validate.py's and test_knobs.py's)."""
    from trainer3d import train

    monkeypatch.setattr(train, "launch", lambda cfg, record=None: pytest.fail("launched"))
    assert train.run(make(["parallel=single", "train.device=cuda"])) == 2
    err = capsys.readouterr().err
    assert "trainer3d: device error: train.device=cuda but no CUDA device is visible here" in err, err


PINNED_CASES = [
    ({}, True, "pinned_max_round_threshold_mb:64"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True,
     "expandable_segments:True,pinned_max_round_threshold_mb:64"),  # the user's settings given again
    ({"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:8"}, False,
     "pinned_max_round_threshold_mb:8"),  # the user's threshold stays
]

_PINNED_PROBE = """
import json, os, sys
import torch
for env in json.loads(sys.argv[1]):
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.environ.update(env)
        from trainer3d.config.device import exact_pinned_sizes
        print(exact_pinned_sizes(), repr(torch._C._accelerator_getAllocatorSettings()), flush=True)
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
"""


@pytest.fixture(scope="module")
def pinned_settings():
    """What ``exact_pinned_sizes`` hands torch's allocator under each PINNED_CASES environment,
    read back from it. The setting is process-wide: each case runs in a process of its own,
    forked from one fresh process that imported torch (one import, not three) with its
    environment set before the allocator's configuration is first read (torch parses the
    variables then, not at import: a case whose variable torch had read before would show the
    settings without it)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", _PINNED_PROBE, json.dumps([env for env, _, _ in PINNED_CASES])],
                         capture_output=True, text=True, timeout=120, env=clean)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(PINNED_CASES), out.stdout + out.stderr
    return [line.split() for line in lines]


@pytest.mark.parametrize("case", range(len(PINNED_CASES)), ids=[settings for _, _, settings in PINNED_CASES])
def test_pinned_buffers_are_not_rounded_to_a_power_of_two(case, pinned_settings):
    _, changed, settings = PINNED_CASES[case]
    assert pinned_settings[case] == [str(changed), repr(settings)]


def test_a_torch_that_refuses_the_pinned_threshold_keeps_its_rounding(monkeypatch):
    """torch 2.11 has the allocator setter but refuses the key (seen on the first GPU run,
    docs/gpu.md): every CUDA rank ran ``exact_pinned_sizes`` first and died of it. The refusal of
    that key leaves the rounding as it was; any other refusal still raises."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)

    def refuses(message):
        def setter(settings):
            raise ValueError(message)
        return setter
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuses(
        "Unrecognized key 'pinned_max_round_threshold_mb' in Accelerator allocator config."), raising=False)
    assert exact_pinned_sizes() is False
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuses("Unrecognized key 'other'"),
                        raising=False)
    with pytest.raises(ValueError, match="other"):
        exact_pinned_sizes()


def test_rank_bound_to_one_gpu_by_slurm_takes_cuda_0(monkeypatch):
    """--gpus-per-task=1: each task sees one GPU (device_count() == 1) and local ranks 1..7 run on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in {**PER_TASK, "LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "5"}.items():
        monkeypatch.setenv(key, value)
    assert rank_device(validate(make(["train.device=cuda"]))) == torch.device("cuda", 0)


@pytest.mark.parametrize("overrides, slurm_client", [
    (["experiment=llama3.1-8b-8gpu", "data=stdlib"], False),  # a GPU recipe on a machine without Slurm or GPUs
    (["launcher.gpus_per_node=2", "train.device=cuda", "parallel.backend=nccl"], True),
])
def test_one_refusal_names_every_override_a_gpu_config_needs_on_cpu_ranks(overrides, slurm_client):
    problems = machine_problems(validate(make(overrides)), 2, device_count=0, slurm_client=slurm_client)
    assert len(problems) == 1, problems
    fix = problems[0].split(" add ", 1)[1].split(",")[0].split()
    assert fix and all("=" in o for o in fix), problems[0]
    # the overrides it names are all it takes: the fixed config passes on the same machine
    assert machine_problems(validate(make([*overrides, *fix])), 2, device_count=0, slurm_client=slurm_client) == []
