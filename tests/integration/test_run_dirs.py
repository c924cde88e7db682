"""Class: run dirs across runs. A fresh start (``train.resume=never``) beside an earlier run's
checkpoints is refused naming both ways out; a torn last line in metrics.jsonl does not block
the next start; a run dir that cannot be written (full, a file in the way) is one line
before Hydra or a rank writes anything."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.test_checkpoint_safety import _cfg, _save
from tests.integration.test_failure_report import _tmpfs
from trainer3d import train
from trainer3d.checkpoint import store
from trainer3d.observe.metrics import MetricsLogger
from trainer3d.parallel.topology import ParallelDims, Topology


def test_resume_never_beside_checkpoints_is_refused_and_touches_nothing(tmp_path, capsys):
    cfg = _cfg(resume="never")
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    assert train.check_resume(cfg), "an empty checkpoint dir: never starts fresh"
    old = _save(tmp_path / "ckpt", 30)
    assert train.run(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.resume=never" in err[0] and "step_00000030" in err[0], err
    assert "train.resume=auto" in err[0] and "hydra.run.dir=" in err[0], err
    assert store.published(tmp_path / "ckpt") == [(30, old)]


def _rank0_logger(run_dir, start_step: int) -> MetricsLogger:
    dims = ParallelDims(topo=Topology(tp=1, pp=1, dp=1), rank=0, mesh=None, tp_group=None, dp_group=None,
                        pp_group=None, device=torch.device("cpu"))
    return MetricsLogger(dims, str(run_dir), max_steps=10, tokens_per_step=100, start_step=start_step,
                         stream=io.StringIO())


@pytest.mark.parametrize("torn", ['{"step": 5, "loss": 2.', '{"ste', '[1, 2]', '{"step": "6"}', "\x00\x00\x00"])
def test_a_torn_metrics_line_does_not_block_the_next_start(tmp_path, capsys, torn):
    rows = [json.dumps({"step": s, "loss": 3.0 - s / 10}) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n" + torn)
    _rank0_logger(tmp_path, start_step=3)
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl" in err[0] and "dropped 1 line" in err[0], err


def test_an_earlier_runs_rows_are_not_replaced_silently(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0}) + "\n" for s in range(4)))
    _rank0_logger(tmp_path, start_step=0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "replacing 4 row(s) of an earlier run that left no checkpoint" in err[0], err


def test_an_unwritable_checkpoint_dir_is_one_line_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "launch", lambda cfg: pytest.fail("launched"))
    (tmp_path / "file").write_text("in the way")
    cfg = _cfg()
    cfg.run_dir = cfg.launcher.folder = str(tmp_path / "run")
    cfg.checkpoint.dir = str(tmp_path / "file" / "ckpt")
    assert train.run(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trainer3d: run dir error: checkpoint.dir: {tmp_path / 'file'}"), err


def _train(run_dir, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", "parallel=single",
                           "train.max_steps=1", *overrides], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _assert_one_line(proc: subprocess.CompletedProcess, path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer3d: run dir error: ") and str(path) in lines[0], lines
    assert "hydra.run.dir=" in lines[0], lines


def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("in the way")
    _assert_one_line(_train(tmp_path / "file" / "run"), tmp_path / "file" / "run")


@pytest.fixture
def full_disk(tmp_path):
    yield from _tmpfs(tmp_path / "disk", "1m")


def test_a_run_dir_on_a_full_disk_is_one_line(full_disk):
    with open(full_disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            pass
    proc = _train(full_disk / "run")
    _assert_one_line(proc, full_disk / "run")
    assert "No space left on device" in proc.stderr
    assert not (full_disk / "run" / ".hydra").exists()
