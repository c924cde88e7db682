"""The resume command a stop line prints (trainer3d/rank/resume.py), a named run's dir, and the
refusals of a malformed run name and of evaluation knobs without validation data."""

import shlex

import pytest

from tests.unit.test_validate import make
from trainer3d.config.schema import Config, named_run_dir
from trainer3d.config.validate import ConfigError, validate
from trainer3d.rank.resume import resume_command


def _cfg(name=None, run_dir="outputs/2026-01-01/10-00-00") -> Config:
    cfg = Config()
    cfg.name, cfg.run_dir = name, run_dir
    return cfg


def test_an_unnamed_run_pins_its_timestamped_dir():
    argv = ["/x/trainer3d/train.py", "parallel=dp2", "train.lr=1e-3", "train.resume=never"]
    got = shlex.split(resume_command(_cfg(), argv))
    assert got == ["python", "-m", "trainer3d.train", "parallel=dp2", "train.lr=1e-3",
                   "hydra.run.dir=outputs/2026-01-01/10-00-00", "train.resume=auto"]


def test_a_named_run_resumes_by_the_same_command():
    argv = ["/venv/bin/trainer3d", "name=web-1b", "data.path=my data.bin"]
    assert resume_command(_cfg("web-1b", "outputs/web-1b"), argv) == "trainer3d name=web-1b 'data.path=my data.bin'"


def test_a_named_run_dir_is_outputs_name():
    assert named_run_dir("web-1b", "outputs/stamp") == "outputs/web-1b"
    assert named_run_dir(None, "outputs/stamp") == "outputs/stamp"
    assert named_run_dir("../up", "outputs/stamp") == "outputs/stamp"  # refused by validate, in one line


@pytest.mark.parametrize("overrides, expect", [
    (["name=../up"], "name='../up': a run name is letters, digits"),
    (["data=tokens", "data.path=a.bin", "train.eval_every=50"],
     "train.eval_every=50 but there is no validation data: set data.val_fraction"),
    (["data=tokens", "data.path=a.bin", "train.eval_steps=3"], "train.eval_steps=3 but there is no validation data"),
])
def test_refused_in_one_line(overrides, expect):
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    assert len(err.value.problems) == 1 and expect in err.value.problems[0], err.value.problems


def test_evaluation_knobs_with_validation_data_or_off_pass():
    validate(make(["data=tokens", "data.path=a.bin", "train.eval_every=50", "data.val_fraction=0.01"]))
    validate(make(["data=tokens", "data.path=a.bin", "train.eval_every=0", "train.eval_steps=3"]))
    validate(make(["name=web-1b.v2"]))


def test_a_sweep_point_resumes_by_its_own_overrides_in_its_own_dir():
    argv = ["/x/trainer3d/train.py", "-m", "parallel.dp=1,2", "train.lr=1e-3", "train.resume=never"]
    point = ["parallel.dp=2", "train.lr=1e-3", "train.resume=never"]
    got = shlex.split(resume_command(_cfg(run_dir="multirun/2026-01-01/10-00-00/1"), argv, point))
    assert got == ["python", "-m", "trainer3d.train", "parallel.dp=2", "train.lr=1e-3",
                   "hydra.run.dir=multirun/2026-01-01/10-00-00/1", "train.resume=auto"]
