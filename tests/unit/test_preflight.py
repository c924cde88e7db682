"""Class: the checks before launch (trainer3d/preflight/refusal.py). Each problem is one line
naming its kind; the checks run in order and the first that finds problems ends the run, so a
run on a device this machine lacks is refused as such and its memory is never costed."""

import dataclasses

import pytest
import torch

from tests.unit.test_validate import make
from trainer3d.config.validate import validate
from trainer3d.preflight.refusal import refused_before_launch, report


def test_a_refusal_is_one_line_per_problem_naming_its_kind(capsys):
    assert report("data", ["train.bin: not a token file", "val.bin: empty"]) is True
    assert report("memory", []) is False
    assert capsys.readouterr().err.splitlines() == ["trainer3d: data error: train.bin: not a token file",
                                                    "trainer3d: data error: val.bin: empty"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_first_check_with_problems_ends_the_run(capsys, tmp_path):
    # A million layers fit no host (the memory check's refusal, tests/unit/test_memory_check.py),
    # but CUDA on a machine without it is found first: one device line, nothing costed.
    million = ["parallel=single", "model.n_layers=1000000"]
    cfg = validate(make([*million, "train.device=cuda"]))
    assert refused_before_launch(cfg)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("trainer3d: device error: train.device=cuda"), err
    cfg = validate(make([*million, "train.device=cpu"]))
    assert refused_before_launch(cfg)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("trainer3d: memory error: "), err


def test_a_run_that_passes_every_check_is_not_refused(capsys, tmp_path):
    cfg = validate(make(["parallel=single", "train.device=cpu"]))
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"),
                              launcher=dataclasses.replace(cfg.launcher, folder=str(tmp_path / "logs")))
    assert not refused_before_launch(cfg), capsys.readouterr().err
    assert (tmp_path / "run").is_dir() and (tmp_path / "logs").is_dir()  # the run dirs were probed
