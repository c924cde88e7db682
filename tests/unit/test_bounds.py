"""Bounds: every path knob's name is checked against what its file system can hold, in one
place, before anything opens it; the planner's own knobs (``cluster.*``, ``search.*``) have
ranges, checked before the search as the training knobs are by ``validate`` (the planner's
entry point refusing them in one line: tests/unit/test_command_line.py).

The reference for a name's limit is the file system itself: a directory one byte longer than
pathconf's NAME_MAX is created with os.mkdir and must fail with ENAMETOOLONG, one at the limit
must be created.
"""

import copy
import dataclasses
import errno
import functools
import math
import os
import typing

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
from tests.unit.test_validate import make
from trainer3d import train
from trainer3d.config.knobs import PATHS, get, path_problems
from trainer3d.config.schema import BlendSource
from trainer3d.plan.knobs import (PLAN_CHOICE_LISTS, PLAN_CHOICES, PLAN_FLAG_LISTS, PLAN_FREE_TEXT, PLAN_LISTS, PLAN_RANGES,
                                  plan_problems)
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.plan.settings import ClusterConfig, SearchConfig


def _set(cfg, knob, value):
    section, _, name = knob.rpartition(".")
    holder = cfg
    for part in section.split(".") if section else ():
        holder = getattr(holder, part)
    setattr(holder, name, value)


def _names(tmp_path):
    """A component one byte over the file system's NAME_MAX and one at it, checked by mkdir."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    over, at = "n" * (name_max + 1), "n" * name_max
    with pytest.raises(OSError) as err:
        os.mkdir(tmp_path / over)
    assert err.value.errno == errno.ENAMETOOLONG
    os.mkdir(tmp_path / at)
    return over, at


@pytest.mark.parametrize("knob", [*PATHS, "data.blend[0].path"])
def test_every_path_knob_with_a_name_too_long_is_refused(tmp_path, knob):
    over, at = _names(tmp_path)
    for name, refused in ((over, True), (at, False)):
        cfg = make(["data=tokens", f"data.path={tmp_path / 'ok.bin'}"])
        value = str(tmp_path / name / "x")
        if knob == "data.blend[0].path":
            cfg.data.path, cfg.data.blend = None, [BlendSource(path=value, weight=1.0)]
        else:
            _set(cfg, knob, value)
        problems = path_problems(cfg)
        named = [p for p in problems if p.startswith(f"{knob}=")]
        assert bool(named) == refused, (name, problems)
        if refused:
            assert "NAME_MAX" in named[0] and str(len(over)) in named[0], named


def test_a_nul_byte_in_a_path_is_refused():
    cfg = make()
    cfg.checkpoint.dir = "/tmp/a\0b"
    assert any(p.startswith("checkpoint.dir=") and "NUL" in p for p in path_problems(cfg))


@pytest.mark.parametrize("knob", ["model.init_from", "data.path", "train.resume"])
def test_the_entry_point_refuses_a_name_too_long_before_opening_it(tmp_path, capsys, knob):
    """A refusal, not an OSError traceback from init_from's reader, the resume check or the data check."""
    over, _ = _names(tmp_path)
    cfg = make(["data=tokens", f"data.path={tmp_path / 'ok.bin'}", "dry_run=true"])
    _set(cfg, knob, str(tmp_path / over / "x"))
    assert train.run(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainer3d: config error: {knob}=") and "NAME_MAX" in err, err


def _plan(*overrides):
    """The planner's config (conf/plan.yaml) under ``overrides``: a copy of the one composed per
    overrides in the session, for the caller to change."""
    return copy.deepcopy(_plan_composed(overrides))


@functools.lru_cache(maxsize=None)
def _plan_composed(overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("plan", list(overrides)))


def _leaves(schema, prefix):
    for f in dataclasses.fields(schema):
        yield f"{prefix}{f.name}", typing.get_type_hints(schema)[f.name]


def test_every_planner_knob_has_a_range_or_choices():
    tables = (PLAN_RANGES, PLAN_LISTS, PLAN_FLAG_LISTS, PLAN_CHOICES, PLAN_CHOICE_LISTS, PLAN_FREE_TEXT)
    unchecked = [knob for schema, prefix in ((ClusterConfig, "cluster."), (SearchConfig, "search."))
                 for knob, hint in _leaves(schema, prefix)
                 if hint is not bool and not any(knob in table for table in tables)]
    assert not unchecked, f"planner knobs without a range or choice in trainer3d/plan/knobs.py: {unchecked}"
    assert plan_problems(_plan()) == []


def _outside(valid):
    below = valid.lo if valid.lo_open else valid.lo - 1
    return [below, *([valid.hi] if valid.hi is not None else []), math.nan, math.inf]


@pytest.mark.parametrize("knob", sorted(PLAN_RANGES))
def test_every_planner_number_outside_its_range_is_refused(knob):
    for bad in _outside(PLAN_RANGES[knob]):
        cfg = _plan()
        _set(cfg, knob, bad)
        assert any(p.startswith(f"{knob}=") for p in plan_problems(cfg)), (knob, bad)


@pytest.mark.parametrize("knob", sorted(PLAN_LISTS))
def test_every_planner_list_empty_or_out_of_range_is_refused(knob):
    valid = PLAN_LISTS[knob]
    for bad in ([], [valid.lo - 1], [valid.hi], [*get(_plan(), knob), valid.hi]):
        cfg = _plan()
        _set(cfg, knob, bad)
        assert any(p.startswith(f"{knob}=") for p in plan_problems(cfg)), (knob, bad)


@pytest.mark.parametrize("knob", PLAN_FLAG_LISTS)
def test_an_empty_planner_flag_list_is_refused(knob):
    cfg = _plan()
    _set(cfg, knob, [])
    assert any(p.startswith(f"{knob}=[]") for p in plan_problems(cfg))


def test_the_training_knobs_are_checked_for_the_planner_too():
    cfg = _plan()
    cfg.optim.lr = math.nan
    assert any(p.startswith("optim.lr=nan") for p in plan_problems(cfg))
