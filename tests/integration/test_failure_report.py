"""Class: misleading headlines. Whatever escapes a rank — DCP's CheckpointException (a
BaseException), any other BaseException, a full disk — is reported as the real cause in one
line, and a failed save leaves no ``.partial`` directory filling the disk."""

import errno
import os
import shutil
import subprocess
import traceback

import pytest

from tests.support.background import Run
from tests.support.runs import read_metrics, train_in_ranks
from trainer3d.checkpoint import store
from trainer3d.observe.failure import RankFailed, headline, rank_failures

SMALL = ("parallel=dp2", "train.max_steps=20", "train.log_every=1", "train.seq_len=64", "train.micro_batch_size=2",
         "train.global_batch_size=16", "train.grad_accum_steps=null", "parallel.timeout_s=60", "checkpoint.every=2")


def _checkpoint_exception(inner: BaseException):
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException("save failed", {1: (inner, traceback.StackSummary()), 3: (ValueError("later"), None)})


def test_a_base_exception_escaping_a_rank_is_reported_with_its_cause():
    class Halt(BaseException):
        pass

    with pytest.raises(RankFailed, match="^Halt: stuck in the tokenizer$"):
        with rank_failures():
            raise Halt("stuck in the tokenizer")
    with pytest.raises(RankFailed, match=r"^KeyError: 'lm_head.weight'$"):  # the lowest failing rank's own error
        with rank_failures():
            raise _checkpoint_exception(KeyError("lm_head.weight"))
    with pytest.raises(SystemExit):  # a rank leaving on purpose is not a failure
        with rank_failures():
            raise SystemExit(75)


def test_a_full_disk_is_named_with_its_path(tmp_path):
    err = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "__1_0.distcp"))
    assert headline(_checkpoint_exception(err)) == f"no space left on device at {tmp_path / 'ckpt' / '__1_0.distcp'}"
    try:  # a write to an open file names no file: the full file system among the run's directories is named
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as nameless:
        assert headline(nameless, ["/nonexistent/run"]).startswith("no space left on device at ")


def _tmpfs(disk, size: str):
    """A tmpfs of ``size`` at ``disk`` (a real ENOSPC once it is full), unmounted afterwards."""
    disk.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs under CI: {proc.stderr.strip()}")
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture
def one_checkpoint_disk(tmp_path):
    """A 16 MiB tmpfs: one checkpoint of the model (10.5 MB) fits, a second one does not."""
    yield from _tmpfs(tmp_path / "disk", "16m")


def test_a_disk_filling_during_a_background_write_keeps_the_last_good_checkpoint(tmp_path, one_checkpoint_disk):
    """The step-8 save runs out of space in the background while training goes on: the run ends
    with the one-line cause (the path, not an out-of-memory guess), nothing of it is published or
    left (the failed save's ``.partial`` directory removed by rank 0: trainer3d/checkpoint/saver.py
    ``write``), and step 4 resumes exactly."""
    disk, args = one_checkpoint_disk, [*SMALL[:-1], "checkpoint.every=4"]
    with Run(tmp_path / "run", [*args, f"checkpoint.dir={disk}"]) as run:
        code = run.wait(timeout=300)
    assert code == 1, run.text()
    headlines = [line for line in run.err if "failed:" in line]
    assert len(headlines) == 1 and f"no space left on device at {disk}" in headlines[0], run.text()
    assert "killed, out of memory" not in run.text()
    assert [s for s, _ in store.published(disk)] == [4] and store.is_complete(store.step_dir(disk, 4))[0]
    # the run's lock on its checkpoint dir (trainer3d/rank/runlock.py) stays, as in the run dir
    left = {p.name for p in disk.iterdir()} - {"run.lock"}
    assert left == {store.step_dir(disk, 4).name}, f"the failed save's .partial must be gone: {left}"
    rows = read_metrics(tmp_path / "run")
    assert len(rows) > 8, "training went on while the step-8 save was being written"
    copy = tmp_path / "step_00000004"
    shutil.copytree(store.step_dir(disk, 4), copy)
    # the resume happens on the ranks (checkpoint/manager.py), so it runs on forkserver ranks
    # (tests/support/runs.py: train_in_ranks); the entry point is under test for the failed save
    train_in_ranks(tmp_path / "again", [*args[:1], "train.max_steps=8", *args[2:], f"train.resume={copy}",
                                        "checkpoint.every=0", "checkpoint.save_final=false"])
    again = read_metrics(tmp_path / "again")
    assert [r["loss"] for r in again] == [r["loss"] for r in rows[4:8]]
