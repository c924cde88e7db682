"""Class: memory before launch. A run whose estimate (the dry run's own accounting) exceeds each
GPU's memory, or for CPU ranks the host's, is refused before any rank starts, naming the
estimate, the limit and the override knob; the check runs in bounded memory whatever the
config declares (a million layers are refused by arithmetic)."""

import tracemalloc
from math import prod

import pytest

from tests.unit.test_validate import make
from trainer3d import train
from trainer3d.config.validate import validate, world_size_of
from trainer3d.preflight.memory_check import host_lower_bound, memory_problems, states_lower_bound
from trainer3d.preflight.refusal import estimate_problems
from trainer3d.memory.dry_run import peak_lines
from trainer3d.memory.peak import rank_memory
from trainer3d.memory.states import format_bytes, rank_parameter_shapes

MILLION = ["parallel=single", "model.n_layers=1000000", "train.device=cpu"]


def _cfg(overrides):
    return validate(make(overrides))


def test_a_million_layers_are_refused_before_launch_in_bounded_memory(monkeypatch, capsys):
    monkeypatch.setattr(train, "launch", lambda cfg: pytest.fail("launched"))
    cfg = make(MILLION)
    tracemalloc.start()
    try:
        assert train.run(cfg) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer3d: memory error: the dry run's estimate"), err
    assert "GiB at least (model states alone)" in err[0] and "of memory" in err[0], err
    assert "launcher.check_memory=false" in err[0], err
    assert peak < 64 * 2 ** 20, f"{peak / 2 ** 20:.0f} MiB of Python objects to refuse"


@pytest.mark.parametrize("overrides", [
    ["parallel=tp2-pp2-dp2"],
    ["parallel=dp2", "parallel.zero_stage=1", "train.dtype=bf16"],
    ["parallel=dp2", "parallel.zero_stage=2", "train.dtype=bf16"],
    ["parallel=dp2", "parallel.zero_stage=3"],
    ["parallel=dp2", "parallel.zero_stage=1", "train.dtype=bf16", "parallel.offload_optimizer=true"],
    ["parallel=tp2-pp2-dp2", "parallel.offload_optimizer=true"],
    ["parallel=dp2", "parallel.zero_stage=2", "train.dtype=bf16", "parallel.offload_optimizer=true"],
    ["parallel=tp2-pp2-dp2", "parallel.pp_virtual_stages=2", "parallel.pp_schedule=interleaved_1f1b",
     "model.n_layers=8", "model.tie_embeddings=true"],
])
def test_the_quick_bound_never_exceeds_the_dry_runs_model_states(overrides):
    cfg = _cfg(overrides)
    for r in range(cfg.parallel.pp):
        exact = rank_memory(cfg, r).states.total
        assert 0.9 * exact < states_lower_bound(cfg, r) <= exact


def test_cpu_ranks_are_held_to_the_hosts_memory_by_the_dry_runs_sum():
    cfg = _cfg(["parallel=tp2-pp2-dp2", "train.device=cpu"])
    p = cfg.parallel
    need = sum(rank_memory(cfg, r).total + rank_memory(cfg, r).staged for r in range(p.pp)) * p.tp * p.cp * p.dp
    assert memory_problems(cfg, world_size_of(cfg), host_bytes=need) == []
    (line,) = memory_problems(cfg, world_size_of(cfg), host_bytes=need - 1)
    gib = f"{need / 2 ** 30:.2f} GiB" if need >= 2 ** 30 else f"{need / 2 ** 20:.1f} MiB"
    assert f"for the 8 CPU rank(s) on this host is {gib}" in line and "activations" in line, line


def test_the_check_runs_for_the_local_launcher_unless_turned_off():
    """trainer3d/preflight/refusal.py ``estimate_problems`` decides whether the estimate is asked:
    a 70B model on CPU ranks is refused for this host's memory by the local launcher, launched
    anyway with ``launcher.check_memory=false``, and left to its nodes under Slurm."""
    cfg = _cfg(["model=70b", "train.device=cpu"])
    (line,) = estimate_problems(cfg)
    assert "CPU rank(s) on this host" in line and "launcher.check_memory=false" in line, line
    cfg.launcher.check_memory = False
    assert estimate_problems(cfg) == []
    cfg = _cfg(["model=70b", "train.device=cpu", "launcher=slurm"])
    assert estimate_problems(cfg) == []


def test_cuda_ranks_are_held_to_each_gpus_memory():
    cfg = _cfg(["parallel=tp2-pp2-dp2", "train.device=cuda"])
    worst = max(rank_memory(cfg, r).total for r in range(cfg.parallel.pp))
    assert memory_problems(cfg, 8, device_bytes=worst) == []
    (line,) = memory_problems(cfg, 8, device_bytes=worst - 1)
    assert "per rank (pp rank" in line and "of each GPU" in line and "launcher.check_memory=false" in line, line


def test_offloaded_state_is_held_to_the_hosts_memory():
    """CUDA ranks: the device holds the parameters and gradients only; the offloaded state of
    all the ranks is summed against this host's memory. CPU ranks: it counts in their sum."""
    cfg = _cfg(["parallel=tp2-pp2-dp2", "train.device=cuda", "train.dtype=bf16", "parallel.offload_optimizer=true"])
    mems = [rank_memory(cfg, r) for r in range(cfg.parallel.pp)]
    worst, host = max(m.total for m in mems), sum(m.host + m.staged for m in mems) * 4  # tp2 x dp2 per pp rank
    assert host > 0 and all(m.states.master == 0 for m in mems)
    assert memory_problems(cfg, 8, device_bytes=worst, host_bytes=host) == []
    (line,) = memory_problems(cfg, 8, device_bytes=worst, host_bytes=host - 1)
    assert "host memory of the 8 rank(s), the offloaded optimizer state" in line, line
    assert "parallel.offload_optimizer=false" in line, line
    cpu = _cfg(["parallel=tp2-pp2-dp2", "train.device=cpu", "train.dtype=bf16", "parallel.offload_optimizer=true"])
    need = sum(rank_memory(cpu, r).total + rank_memory(cpu, r).host + rank_memory(cpu, r).staged
               for r in range(cpu.parallel.pp)) * 4
    assert memory_problems(cpu, 8, host_bytes=need) == []
    (line,) = memory_problems(cpu, 8, host_bytes=need - 1)
    assert "offloaded optimizer state" in line, line


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_fsdp_shards_are_held_to_the_hosts_memory(stage):
    """ZeRO-2/3 offloaded on CUDA ranks: the device keeps no shard (ZeRO-2 its gathered
    parameters), the host all of them, summed over the ranks against this host's memory; the
    quick bound of the host state stays under the dry run's."""
    cfg = _cfg(["parallel=dp2", "parallel.tp=2", "train.device=cuda", "train.dtype=bf16",
                f"parallel.zero_stage={stage}", "parallel.offload_optimizer=true"])
    (mem,) = [rank_memory(cfg, 0)]
    assert mem.states.params == mem.states.grads == mem.states.master == 0 and mem.host > 0
    assert 0.9 * mem.host < host_lower_bound(cfg, 0) <= mem.host
    host = (mem.host + mem.staged) * 4
    assert memory_problems(cfg, 4, device_bytes=mem.total, host_bytes=host) == []
    (line,) = memory_problems(cfg, 4, device_bytes=mem.total, host_bytes=host - 1)
    assert "host memory of the 4 rank(s), the offloaded optimizer state" in line, line


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_background_checkpoints_host_copy_is_counted(device):
    """checkpoint.async_save keeps a host copy of each rank's state (trainer3d/memory/staged.py,
    measured against the saver's buffers by tests/multirank/test_staged_bytes.py): the limit
    that passes without it refuses with it, naming the knob; the dry run prints it."""
    overrides = ["parallel=dp2", f"train.device={device}", "train.dtype=bf16", "checkpoint.every=10"]
    on, off = _cfg(overrides), _cfg([*overrides, "checkpoint.async_save=false"])
    mem_on, mem_off = rank_memory(on, 0), rank_memory(off, 0)
    assert mem_off.staged == 0 and mem_on.staged > 0
    # ZeRO-0 bf16, by hand: the bf16 parameters whole + fp32 master and two moments per element + the step
    psi = sum(prod(s) for s in rank_parameter_shapes(on, 0))
    assert mem_on.staged == (2 + 12) * psi + 4
    if device == "cpu":
        need = mem_off.total * 2
        assert memory_problems(off, 2, host_bytes=need) == []
        (line,) = memory_problems(on, 2, host_bytes=need)
        assert "a background checkpoint's host copy" in line and "checkpoint.async_save" in line, line
        assert memory_problems(on, 2, host_bytes=need + 2 * mem_on.staged) == []
    else:
        assert memory_problems(off, 2, device_bytes=mem_off.total, host_bytes=1) == []
        (line,) = memory_problems(on, 2, device_bytes=mem_on.total, host_bytes=2 * mem_on.staged - 1)
        assert "a background checkpoint's copy" in line and "checkpoint.async_save=false" in line, line
        assert memory_problems(on, 2, device_bytes=mem_on.total, host_bytes=2 * mem_on.staged) == []
    printed = [line for line in peak_lines(on) if "background checkpoint" in line]
    assert len(printed) == 1 and format_bytes(mem_on.staged) in printed[0], printed
    assert not [line for line in peak_lines(off) if "background checkpoint" in line]
