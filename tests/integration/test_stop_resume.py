"""Class: a stopped run tells its user what happened, and leaves nothing running. A signal to
``python -m trainer3d.train name=...`` (here SIGTERM, a ``kill`` or a CI time limit, to the
submitting process alone) ends the whole local job — every rank and every process a rank started,
even one in a session of its own — and the run exits 128 + the signal with one line naming the
checkpoint saved and the command that resumes the run; a named run's dir is ``outputs/<name>``,
so that command — the one typed — continues it. SIGINT and SIGHUP take the same path in the
submitting process (trainer3d/launch/interrupt.py: JobSignals); from a terminal they reach its
whole foreground group, which tests/integration/test_terminal.py sends them to."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.background import MARK, marked, spawning_child
from tests.support.runs import read_metrics
from trainer3d.checkpoint import store

STEPS = 24
ARGS = ["name=stop-test", "parallel=single", f"train.max_steps={STEPS}", "train.log_every=1", "train.seq_len=64",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.grad_accum_steps=null",
        "checkpoint.every=2", "checkpoint.async_save=false"]
SIG = signal.SIGTERM
STOP = re.compile(rf"^trainer3d: stopped on {SIG.name}; checkpoint (\S+) saved; resume with: (.+)$")


@pytest.mark.slow
def test_a_signal_ends_every_process_names_the_checkpoint_and_the_same_command_resumes_a_named_run(tmp_path):
    mark = uuid.uuid4().hex
    # every rank starts a detached grandchild (its own session): the launcher must end it too
    env = spawning_child(dict(os.environ, PYTHONUNBUFFERED="1", **{MARK: mark}), tmp_path / "site")
    proc = subprocess.Popen([sys.executable, "-m", "trainer3d.train", *ARGS], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        seen = 0
        for line in proc.stdout:
            seen += "| loss " in line
            if seen >= 3:  # three steps logged: a periodic checkpoint is written or being written
                break
        started = marked(mark)
        assert len(started) >= 4, "submitting process + controller + a rank + its grandchild"
        proc.send_signal(SIG)
        out, err = proc.communicate(timeout=120)
        time.sleep(0.5)
        left = marked(mark)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + SIG, err
    assert left == [], f"still running after the submitting process exited: {left} of {started}\n{err}"
    assert len([line for line in err.splitlines() if f"{SIG.name}: ending job" in line]) == 1, err
    last = err.strip().splitlines()[-1]
    match = STOP.match(last)
    assert match, err
    saved = tmp_path / match.group(1) if not os.path.isabs(match.group(1)) else match.group(1)
    run_dir = tmp_path / "outputs" / "stop-test"
    assert os.path.samefile(os.path.dirname(saved), run_dir / "checkpoints")
    assert store.is_complete(saved)[0]
    step = store.read_marker(saved)["step"]
    command = shlex.split(match.group(2))
    assert command == ["python", "-m", "trainer3d.train", *ARGS], "a named run resumes by the command typed"
    again = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {match.group(1)} at step {step}" in again.stdout + again.stderr
    assert store.is_complete(store.step_dir(run_dir / "checkpoints", STEPS))[0]
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] == STEPS - 1
