"""kill -9 of the whole job during a background write (the submitting process first, then every
process it started, as a lost machine would). Nothing of the interrupted save is
published, ``auto`` picks the checkpoint before it, and the restarted run ends as if nothing
had happened. The restart is a plain one: it runs on forkserver ranks (tests/support/runs.py:
train_in_ranks), which choose the checkpoint as the entry point's ranks do (checkpoint/choose.py);
the entry point is under test for the kill, not for the restart. A rank killed alone mid-save
is tests/integration/test_checkpoint_resume.py's test_kill_mid_save_keeps_the_previous_checkpoint
(rank 1 stalled after its files are written, before the gather that leads to publication: the
later point of a save, where rank 0 would publish first if it did not wait for its peers).

Rank 1's background write of the step-4 checkpoint stalls with its data files written and
not yet read back (tests/support/plugins/stall_save, ``1:4:write``) while training goes on;
the kill comes when the loop has reached the next save (step 6), which waits for it. The run
stops at step 8 on the learning-rate schedule of the 20-step reference (``KILL_RUN``), so the
restart's losses are compared with the reference's first 8.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.test_checkpoint_resume import BASE, KILL_RUN, MODEL, assert_close, layout, losses_from
from tests.support.background import Run
from tests.support.runs import PARITY, read_metrics, reference_losses, train_in_ranks
from trainer3d.checkpoint import store

PLUGIN = Path(__file__).resolve().parents[1] / "support" / "plugins" / "stall_save"


@pytest.mark.slow
def test_kill_9_during_a_background_write_publishes_nothing(tmp_path, session_tmp):
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = [*BASE, *layout(1, 1, 2), *KILL_RUN, "parallel.timeout_s=12"]
    env = dict(os.environ, TRAINER3D_TEST_STALL_SAVE="1:4:write", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN), os.environ.get("PYTHONPATH")])))
    with Run(run, args, env=env) as job:
        marker = root / "stalled-rank1"
        deadline = time.time() + 300
        while not (marker.exists() and (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 6):
            assert time.time() < deadline and job.proc.poll() is None, f"no stalled write at step 6:\n{job.text()}"
            time.sleep(0.2)
        assert not store.step_dir(root, 4).exists(), "published before rank 1's files were read back"
        os.kill(job.proc.pid, signal.SIGKILL)
        job.kill_leftovers()
    assert not store.step_dir(root, 4).exists()
    assert store.latest_complete(root)[0] == 2 and store.is_complete(store.step_dir(root, 2))[0]
    marker.unlink(missing_ok=True)
    stdout = train_in_ranks(run, [*args[:-1], "parallel.timeout_s=60"])  # no plugin: a plain restart
    assert "step_00000002 at step 2" in stdout, stdout[-3000:]
    assert_close(losses_from(run, 0), reference_losses(session_tmp, [*PARITY, *MODEL])[:8])
    assert not store.partial_dir(root, 4).exists()  # the stale partial save was cleaned up
