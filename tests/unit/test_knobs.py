"""Every knob of the schema is checked: numeric ranges and choices from one table
(trainer3d/config/knobs.py), keys outside the schema refused (trainer3d/config/composed.py), a GPU asked for where there is none.

The sweeps below walk the dataclass schema itself, so a field added later without a range
or a choice fails here; each invalid value is pushed through ``validate`` and must come back
as one line naming the knob.
"""

import copy
import dataclasses
import math
import typing

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.unit.test_validate import CONF_DIR, make
from trainer3d import train
from trainer3d.config.schema import Config
from trainer3d.config.composed import unknown_keys  # and registers the schema in the ConfigStore
from trainer3d.config.knobs import CHOICES, FREE_TEXT, RANGES
from trainer3d.config.validate import ConfigError, validate


def _leaves(schema=Config, prefix=""):
    """(knob, type hint) of every non-dataclass field, recursively."""
    for name, hint in typing.get_type_hints(schema).items():
        inner = next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)
        if inner is not None and typing.get_origin(hint) is not list:
            yield from _leaves(inner, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", hint


def _base(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def test_every_field_has_a_range_or_choices():
    unchecked = []
    for knob, hint in _leaves():
        kind = _base(hint)
        if kind in (int, float) and knob not in RANGES and knob not in CHOICES:
            unchecked.append(knob)
        if kind is str and knob not in CHOICES and knob not in FREE_TEXT:
            unchecked.append(knob)
    assert not unchecked, f"knobs without a range or choice in trainer3d/config/knobs.py: {unchecked}"


_DEFAULT = make()


def _default():
    return copy.deepcopy(_DEFAULT)


def _outside(valid):
    """Values just outside a Range, plus the non-finite ones."""
    below = valid.lo if valid.lo_open else valid.lo - 1
    return [below, *([valid.hi] if valid.hi is not None else []), math.nan, -math.inf]


@pytest.mark.parametrize("knob", sorted(RANGES))
def test_every_numeric_knob_outside_its_range_is_refused(knob):
    section, _, name = knob.rpartition(".")
    for bad in _outside(RANGES[knob]):
        cfg = _default()
        holder = cfg
        for part in section.split("."):
            holder = getattr(holder, part)
        setattr(holder, name, int(bad) if isinstance(bad, int) and not isinstance(bad, bool) else bad)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert any(p.startswith(f"{knob}=") for p in err.value.problems), (knob, bad, err.value.problems)


@pytest.mark.parametrize("knob", sorted(CHOICES))
def test_every_choice_knob_refuses_other_values(knob):
    cfg = _default()
    section, _, name = knob.rpartition(".")
    bad = 9 if isinstance(CHOICES[knob][0], int) else "bogus"
    target = cfg
    for part in section.split("."):
        target = getattr(target, part)
    setattr(target, name, bad)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    shown = knob[:-len(".name")] if knob.endswith(".name") else knob
    assert any(p.startswith(f"{shown}={bad} is not one of") for p in err.value.problems), err.value.problems


@pytest.mark.parametrize("override,fragment", [
    ("optim.eps=0", "optim.eps=0.0 must be > 0"), ("model.rope_theta=-1", "model.rope_theta=-1.0 must be > 0"),
    ("optim.beta1=1", "optim.beta1=1.0 must be in [0, 1)"), ("optim.beta2=-0.1", "optim.beta2=-0.1 must be in"),
    ("train.peak_tflops=0", "train.peak_tflops=0.0 must be > 0"),
    ("launcher.timeout_min=0", "launcher.timeout_min=0 must be in [1, 525600)"),
    ("model.norm_eps=nan", "model.norm_eps=nan must be > 0"), ("optim.lr=inf", "optim.lr=inf must be > 0"),
    ("checkpoint.dir=''", "checkpoint.dir is empty"),
    ("launcher=slurm", "launcher.signal_delay_s=90 is not below launcher.timeout_min=1"),
])
def test_the_reported_gaps_are_refused(override, fragment):
    overrides = [override] + (["launcher.timeout_min=1"] if override == "launcher=slurm" else [])
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    assert any(fragment in p for p in err.value.problems), err.value.problems


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides) + ["run_dir=/tmp/unused",
                                                                          "launcher.folder=/tmp/unused"])


@pytest.mark.parametrize("override,key", [("+foo=1", "foo"), ("+train.max_stpes=5", "train.max_stpes"),
                                          ("+model.rope_scaling.fator=2", "model.rope_scaling.fator"),
                                          ("+logger.extra.depth=1", "logger.extra")])
def test_keys_outside_the_schema_are_refused(override, key):
    problems = unknown_keys(_compose([override]))
    assert len(problems) == 1 and problems[0].startswith(f"{key} is not a config key"), problems
    assert unknown_keys(_compose([])) == []


@pytest.mark.parametrize("knob", ["train.device=cuda", "parallel.backend=nccl"])
def test_cuda_without_a_gpu_is_refused_before_launch(monkeypatch, capsys, knob):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = make([knob, "parallel=single"])
    assert train.run(cfg) == 2
    err = capsys.readouterr().err
    assert f"trainer3d: device error: {knob} but no CUDA device is visible here" in err and "Traceback" not in err


def test_a_directory_knob_naming_a_file_is_refused_before_launch(tmp_path, capsys):
    cfg = make()
    cfg.checkpoint.dir = str(tmp_path / "file")
    (tmp_path / "file").write_text("")
    assert train.run(cfg) == 2
    assert f"checkpoint.dir={tmp_path / 'file'} is a file, not a directory" in capsys.readouterr().err


def test_path_knobs_expand_a_leading_tilde(monkeypatch, tmp_path):
    """A ``~`` that reaches the config (quoted for Hydra) is the home directory in the validated
    config, for every path knob; a ``~`` inside a path is left as it is."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = make(["model.init_from='~/models/m'", "data=tokens", "data.path='~/d/web.bin'",
                "data.val_path='~/d/val.bin'", "data.cache_dir='~/cache'", "checkpoint.dir='~/ck'",
                "train.resume='~/ck/step_00000010'", "+data.blend=[{path: '~/d/a.bin', weight: 1.0}]"])
    cfg.data.path = None  # a blend instead of data.path
    cfg.run_dir, cfg.launcher.folder = "~/run", "/tmp/x~/folder"
    out = validate(cfg)
    assert out.model.init_from == f"{tmp_path}/models/m" and out.data.val_path == f"{tmp_path}/d/val.bin"
    assert out.data.cache_dir == f"{tmp_path}/cache" and out.checkpoint.dir == f"{tmp_path}/ck"
    assert out.train.resume == f"{tmp_path}/ck/step_00000010" and out.data.blend[0].path == f"{tmp_path}/d/a.bin"
    assert out.run_dir == f"{tmp_path}/run" and out.launcher.folder == "/tmp/x~/folder"
    assert cfg.data.cache_dir == "~/cache"  # validate returns a copy
