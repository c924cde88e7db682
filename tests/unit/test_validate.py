"""Config validation: a pure function, tested without processes; and the CLI's clean exit."""

import copy
import functools

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.schema import Config
from trainer3d.config.validate import ConfigError, validate
from tests.conftest import CONF_DIR


def make(overrides=()) -> Config:
    """Compose the real conf/ with overrides, as the entry point does; the cases below are
    written against the 2-rank data-parallel layout (parallel=dp2) unless they pick one. A copy
    of the config composed once per overrides in the session (hydra's compose is most of a
    validation case's CPU): the caller may change it."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.lru_cache(maxsize=None)
def _composed(overrides) -> Config:
    base = [] if any(o.startswith("parallel=") for o in overrides) else ["parallel=dp2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name="config", overrides=base + list(overrides) + ["launcher.folder=/tmp/unused",
                                                                                 "run_dir=/tmp/unused"])
    return OmegaConf.to_object(dcfg)


# (overrides, a fragment the one-line error must contain: the knob to change)
BAD = [
    (["parallel.dp=3", "train.global_batch_size=32", "train.micro_batch_size=8"], "train.global_batch_size=32 is not a multiple"),
    (["train.micro_batch_size=4", "train.grad_accum_steps=4", "train.global_batch_size=30"], "set train.global_batch_size=32"),
    (["train.micro_batch_size=null", "train.grad_accum_steps=3", "train.global_batch_size=32"], "train.global_batch_size=32 is not a multiple of grad_accum_steps(3)"),
    (["train.micro_batch_size=null", "train.grad_accum_steps=null"], "give two of train.micro_batch_size"),
    (["parallel.pp=2", "parallel.zero_stage=2", "train.global_batch_size=64"], "parallel.zero_stage=2 with parallel.pp=2"),
    (["parallel.pp=2", "parallel.zero_stage=3", "train.global_batch_size=64"], "parallel.zero_stage=3 with parallel.pp=2"),
    # offloaded ZeRO-2/3 is FSDP2's CPUOffloadPolicy: no pipelines either, and the same message says so
    (["parallel.pp=2", "parallel.zero_stage=3", "parallel.offload_optimizer=true", "train.global_batch_size=64"],
     "use parallel.zero_stage=1 (or 0) with pipelining"),
    (["parallel.pp=4", "parallel.dp=1", "train.micro_batch_size=8", "train.global_batch_size=16"], "train.grad_accum_steps=2 < parallel.pp=4"),
    (["parallel.tp=3", "parallel.dp=1"], "model.n_heads=4 is not divisible by parallel.tp=3"),
    (["parallel.tp=4", "parallel.dp=1"], "model.n_kv_heads=2 is not divisible by parallel.tp=4"),
    (["model.ffn_dim=300", "parallel.tp=8", "model.n_heads=8", "model.n_kv_heads=8", "parallel.dp=1"], "model.ffn_dim=300 is not divisible by parallel.tp=8"),
    (["model.n_layers=2", "parallel.pp=4", "parallel.dp=1", "train.global_batch_size=32"], "model.n_layers=2 < pp(4)"),
    (["parallel.pp=2", "parallel.pp_layers=[1,1]", "parallel.dp=1"], "must be >= 1 each and sum to model.n_layers=4"),
    (["parallel.pp=2", "parallel.pp_layers=[4]", "parallel.dp=1"], "parallel.pp_layers has 1 entries"),
    (["parallel.zero_stage=5"], "parallel.zero_stage=5 is not one of"),
    (["parallel.tp=0"], "parallel.tp=0 must be >= 1"),
    (["parallel.dp=-1"], "parallel.dp=-1 must be >= 1"),
    (["train.seq_len=512"], "train.seq_len=512 > model.max_seq_len=256"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tp > 1"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=63"], "train.seq_len=63 is not divisible by parallel.tp=2"),
    (["parallel.cp=4", "parallel.dp=1", "train.seq_len=100"],
     "train.seq_len=100 is not a multiple of 2 * parallel.cp = 8 (each cp rank holds two equal chunks); set train.seq_len=96"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.dp=1", "parallel.sequence_parallel=true", "train.seq_len=36"],
     "18 tokens per cp rank is not divisible by parallel.tp=4"),
    (["parallel.cp_attention=ulysses"], "parallel.cp_attention=ulysses is not one of"),
    (["launcher=slurm", "launcher.nodes=1", "launcher.tasks_per_node=2", "parallel.cp=2"],
     "but tp(1) * cp(2) * pp(1) * dp(2) = 4; set parallel.dp=1"),
    (["train.dtype=fp8"], "train.dtype=fp8 is not one of"),
    (["parallel.pp_schedule=zigzag"], "parallel.pp_schedule=zigzag is not one of"),
    (["parallel.pp_virtual_stages=2"], "parallel.pp_virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b"),
    (["model.n_heads=3", "model.n_kv_heads=3"], "model.dim=128 is not divisible by model.n_heads=3"),
    (["model.n_kv_heads=3"], "model.n_heads=4 is not a multiple of model.n_kv_heads=3"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.min_lr=1.0"], "optim.min_lr=1.0 is above optim.lr"),
    (["train.max_steps=0"], "train.max_steps=0 must be >= 1"),
    (["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=4"], "launcher.nodes(2) * launcher.tasks_per_node(4) = 8 ranks, but"),
    (["launcher=slurm", "launcher.nodes=3"], "do not split evenly over launcher.nodes=3"),
    (["data=tokens", "data.path=null"], "data=tokens needs data.path"),
    (["logger.mode=sometimes"], "logger.mode=sometimes is not one of"),
    (["parallel.zero_reduce=broadcast"], "parallel.zero_reduce=broadcast is not one of"),
    (["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
      "train.micro_batch_size=1", "train.global_batch_size=5"], "train.grad_accum_steps=5 does not fit interleaved_1f1b"),
    (["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=zbv", "train.micro_batch_size=1",
      "train.global_batch_size=4"], "parallel.pp_schedule=zbv places exactly 2 stages per rank in a V; set "
     "parallel.pp_virtual_stages=2"),
    (["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
      "train.micro_batch_size=1", "train.global_batch_size=3"], "train.grad_accum_steps>=4"),
]

# What torch 2.13 runs although an earlier rule refused it (tests/unit/test_stages.py checks the rule
# against torch's own schedule classes).
GOOD_PIPELINES = [
    ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
     "train.micro_batch_size=1", "train.global_batch_size=1"],
    ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
     "train.micro_batch_size=1", "train.global_batch_size=4"],
    ["parallel.pp=4", "parallel.dp=1", "parallel.pp_schedule=gpipe", "train.micro_batch_size=8", "train.global_batch_size=16"],
    # compiled operators under the input/weight split (parallel/compile.py)
    ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=zb1p", "parallel.pp_virtual_stages=2",
     "train.compile=true", "train.micro_batch_size=1", "train.global_batch_size=4"],
    ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
     "train.micro_batch_size=1", "train.global_batch_size=3"],
    ["parallel.pp=4", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=8",
     "parallel.pp_virtual_stages=2", "train.micro_batch_size=1", "train.global_batch_size=6"],
]


@pytest.mark.parametrize("overrides,fragment", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_names_the_knob(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    problems = err.value.problems
    assert any(fragment in p for p in problems), problems
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("overrides", GOOD_PIPELINES, ids=[" ".join(o) for o in GOOD_PIPELINES])
def test_pipelines_torch_runs_are_accepted(overrides):
    validate(make(overrides))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_is_accepted_on_every_stage_without_pipelining(stage):
    cfg = validate(make([f"parallel.zero_stage={stage}", "parallel.offload_optimizer=true"]))
    assert cfg.parallel.offload_optimizer and cfg.parallel.zero_stage == stage


def test_the_embedded_default_is_a_valid_3d_layout():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = validate(OmegaConf.to_object(compose(config_name="config", overrides=["run_dir=/tmp/unused",
                                                                                    "launcher.folder=/tmp/unused"])))
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.zero_stage) == (2, 2, 2, 1)
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.train.grad_accum_steps * p.dp


def test_allocation_world_size_must_match():
    with pytest.raises(ConfigError, match=r"the allocation has 6 ranks .* set parallel.dp=6"):
        validate(make(["parallel.dp=2"]), world_size=6)


@pytest.mark.parametrize("given,derived", [
    (dict(micro_batch_size=4, grad_accum_steps=2, global_batch_size=None), ("global_batch_size", 4 * 2 * 3)),
    (dict(micro_batch_size=4, grad_accum_steps=None, global_batch_size=48), ("grad_accum_steps", 4)),
    (dict(micro_batch_size=None, grad_accum_steps=2, global_batch_size=48), ("micro_batch_size", 8)),
])
def test_batch_derivation_uses_dp_not_world_size(given, derived):
    # tp=2 x pp=2 x dp=3 = 12 ranks, but only the 3 dp replicas split the batch.
    cfg = make(["parallel.tp=2", "parallel.pp=2", "parallel.dp=3"] +
                [f"train.{k}={'null' if v is None else v}" for k, v in given.items()])
    out = validate(cfg)
    assert getattr(out.train, derived[0]) == derived[1]
    t = out.train
    assert t.global_batch_size == t.micro_batch_size * t.grad_accum_steps * 3


def test_validate_is_pure():
    cfg = make()
    before = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    validate(cfg)
    assert OmegaConf.to_yaml(OmegaConf.structured(cfg)) == before


def test_every_problem_is_reported():
    with pytest.raises(ConfigError) as err:
        validate(make(["parallel.tp=3", "parallel.zero_stage=9", "train.dtype=fp4"]))
    assert len(err.value.problems) >= 3
