"""tools/parity.py: PASS for a correct layout, FAIL (and where) for a planted gradient bug.

The correct check runs both layouts once (a module fixture); the planted-bug check compares
with that check's one-process run (``--reuse-b``): the bug lives on rank 1 only."""

import logging
import textwrap

import pytest

from tests.conftest import ROOT
from tests.support import run_scripts

# No final checkpoint and a given peak for the MFU column: the tool compares losses, and each
# rank would otherwise import and run DCP for a save no check reads, and rank 0 measure its
# matmul rate (tests/support/runs.py: PARITY_RUN_DEFAULTS, left out of parity runs the same way).
COMMON = ("train.seq_len=64 train.micro_batch_size=2 train.global_batch_size=8 optim.warmup_steps=2 "
          "parallel.timeout_s=60 checkpoint.save_final=false train.peak_tflops=1")

# Rank 1's micro-batch losses (hence its gradients) are scaled by 1.5 before the dp reduction:
# the bug a wrong loss/gradient scaling in a data-parallel path makes. It sits in a
# sitecustomize module, which every Python process of the run imports at start; only the ranks
# (submitit's task variable, as tests/support/background.py tells them) import the trainer for
# it, not the tool, the submitting processes or submitit's controller.
PLANTED = textwrap.dedent("""
    import os
    if os.environ.get("TRAINER3D_PLANTED_BUG") and os.environ.get("SUBMITIT_LOCAL_GLOBALID") is not None:
        import torch.distributed as dist
        from trainer3d import trainer

        _call = trainer.MicroBatchLoss.__call__

        def _scaled(self, output, targets):
            loss = _call(self, output, targets)
            return loss * 1.5 if dist.is_initialized() and dist.get_rank() == 1 else loss

        trainer.MicroBatchLoss.__call__ = _scaled
""")


# The tool is under test, not the layout (tests/multirank holds dp2 to one process over 20+ steps):
# a few steps show a per-step table, a PASS, and the planted bug from its first update (step 1) on.
STEPS = 4


def _parity(tmp_path, layout, *extra, planted=False, steps=STEPS):
    """tools/parity.py run to its end in this process as ``python tools/parity.py`` runs it (the
    tool is a launcher: its runs are processes of their own, which import the planted module)."""
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(PLANTED)
    args = [layout, "--common", COMMON, "--steps", str(steps), "--out", str(tmp_path / "runs"), *extra]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(tmp_path / "site"))
        env.setenv("WANDB_MODE", "offline")
        if planted:
            env.setenv("TRAINER3D_PLANTED_BUG", "1")
        else:
            env.delenv("TRAINER3D_PLANTED_BUG", raising=False)
        env.chdir(tmp_path)
        return run_scripts.run_here(ROOT / "tools" / "parity.py", args)


@pytest.fixture(scope="module")
def correct_check(tmp_path_factory):
    """dp2 against one process through the tool, once for this file's tests (one xdist worker
    runs them: tests/conftest.py xdist_scope): its finished process and its directory."""
    root = tmp_path_factory.mktemp("parity-tool")
    return _parity(root, "parallel=single parallel.dp=2"), root


@pytest.mark.slow
def test_parity_tool_passes_a_correct_layout(correct_check):
    proc, root = correct_check
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("max relative difference") and lines[-1].endswith("PASS")
    assert sum(line.split()[0].isdigit() for line in lines if line.strip()) == STEPS  # one row per step
    assert "A | step" in proc.stdout and "B | step" in proc.stdout  # progress of the runs is shown
    assert (root / "runs" / "parity.txt").read_text().strip().endswith("PASS")


@pytest.mark.slow
def test_parity_tool_catches_a_planted_gradient_bug(tmp_path, correct_check):
    checked, root = correct_check
    assert checked.returncode == 0, checked.stdout + checked.stderr
    reference = root / "runs" / "b"
    proc = _parity(tmp_path, "parallel=single parallel.dp=2", "--reuse-b", str(reference), planted=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = proc.stdout.splitlines()[-1]
    assert "FAIL" in verdict and "first over tolerance at step 1" in verdict, proc.stdout
    # Step 0's loss is computed before any update: equal in both runs; the bug shows from step 1.
    assert "<-- over tolerance" in proc.stdout
    assert f"reused: {reference}" in proc.stdout and "B | step" not in proc.stdout
    assert not (tmp_path / "runs" / "b").exists()


def test_reuse_b_refuses_a_run_of_other_overrides(tmp_path):
    """A finished run made with other overrides (here: another seed) cannot stand for layout B."""
    run = tmp_path / "other"
    (run / ".hydra").mkdir(parents=True)
    made = [*COMMON.split(), "train.max_steps=2", "train.log_every=1", "train.grad_accum_steps=null",
            "parallel=single"]
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in [*made, "train.seed=7"]))
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.0}\n')
    proc = _parity(tmp_path, "parallel=single parallel.dp=2", "--reuse-b", str(run), steps=2)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--reuse-b is refused" in proc.stderr and "train.seed=7" in proc.stderr
    assert not (tmp_path / "runs" / "a" / "metrics.jsonl").exists()
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in made))
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "lo')  # a torn last row
    proc = _parity(tmp_path, "parallel=single parallel.dp=2", "--reuse-b", str(run), steps=2)
    # read as every reader of metrics.jsonl reads it (trainer3d/config/rows.py: a torn row is skipped),
    # so B is a run that did not finish, and is refused as one
    assert proc.returncode == 2 and "logged 1 of its 2 steps (it did not finish)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')  # a run that ended early
    proc = _parity(tmp_path, "parallel=single parallel.dp=2", "--reuse-b", str(run), steps=2)
    assert proc.returncode == 2 and "logged 1 of its 2 steps (it did not finish)" in proc.stderr, proc.stderr


def test_parity_tool_refuses_a_bad_layout_before_running(tmp_path):
    """... and leaves this process's logging as it was: the dry run composes with Hydra in this
    process, and Hydra's default job logging would put its handlers (the run dir's train.log, a
    captured stdout) on the root logger and set its level (trainer3d/tools/parity.py ``QUIET``)."""
    root, named = logging.getLogger(), logging.getLogger("tests.parity_tool")
    named.setLevel(logging.WARNING)
    before = (root.handlers[:], root.level, named.handlers[:], named.level)
    proc = _parity(tmp_path, "parallel=single parallel.dp=3", steps=2)
    assert (root.handlers, root.level, named.handlers, named.level) == before
    assert proc.returncode == 2
    assert "layout A is refused" in proc.stderr and "global_batch_size" in proc.stderr
    assert not (tmp_path / "runs" / "a" / "metrics.jsonl").exists()
