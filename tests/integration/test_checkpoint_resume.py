"""Checkpoints: exact resume, resharding, a kill mid-save, export. The killed run runs
``python -m trainer3d.train``, the refusal its ``run`` in this process; the other runs, the restart
after the kill among them, do its work on in-process ranks (tests/support/runs.py: train_in_ranks).

All runs use the PARITY settings (20 steps, global batch 16) and a model with 8 heads in 4
kv-groups so that tp=4 can split it; losses after a resume are compared with the same
steps of the uninterrupted 1-rank run.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.run_scripts import run as run_script
from tests.support.runs import PARITY, REL_TOL, configure, read_metrics, reference_losses, train_in_ranks
from trainer3d import train
from trainer3d.checkpoint import store
from trainer3d.rank.resume import COMMAND_VAR

MODEL = ("model.n_heads=8", "model.n_kv_heads=4")
BASE = (*PARITY, *MODEL, "parallel=single", "checkpoint.keep=10")
SAME_SCHEDULE = f"optim.decay_steps={20 - 5}"
"""The learning-rate schedule of the 20-step reference (PARITY: 5 steps of warm-up) for a run that
stops earlier, so that a run resumed from its checkpoint is held to the reference's steps."""
KILL_RUN = ("checkpoint.every=2", "train.max_steps=8", SAME_SCHEDULE)
"""A killed run's settings: a save every 2 steps, stopped at step 8 on the learning-rate schedule
of the 20-step reference (PARITY: 5 steps of warm-up), whose first 8 losses the restart is held to."""


def layout(tp, pp, dp, zero=0):
    return (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.zero_stage={zero}")


def losses_from(run_dir: Path, first: int):
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows))), "one row per step, none lost or doubled"
    return [r["loss"] for r in rows[first:]]


def assert_close(got, ref, tol=REL_TOL):
    assert len(got) == len(ref) > 0
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= tol, f"worst relative difference {worst:.2e}\n" + "\n".join(
        f"  {a:.8f} vs {b:.8f}" for a, b in zip(got, ref))
    return worst


def test_resume_continues_exactly(tmp_path):
    """8 steps, a save at 4 (the run compares with itself, not with the 20-step reference)."""
    run = tmp_path / "run"
    args = [*BASE, *layout(1, 2, 2, zero=1), "train.max_steps=8", "checkpoint.every=4"]
    train_in_ranks(run, args)
    uninterrupted = losses_from(run, 0)
    # A restart after step 4: the step-8 checkpoint and the rows of steps 4+ never happened.
    import shutil
    shutil.rmtree(store.step_dir(run / "checkpoints", 8))
    stdout = train_in_ranks(run, args)
    assert f"resumed from {store.step_dir(run / 'checkpoints', 4)} at step 4" in stdout
    resumed = losses_from(run, 0)
    assert resumed[:4] == uninterrupted[:4]  # rows before the resume kept
    assert resumed[4:] == uninterrupted[4:], "same layout: the resumed run is bit-identical"


@pytest.mark.slow
def test_reshard_chain_with_tp_changes(tmp_path, session_tmp):
    """2x2x2 (z1) -> 1x4x2 (z1) -> 1x1x2 (ZeRO-3) -> 2x1x1 (z1) -> 4x1x1 -> 1x1x1, each continuing
    from the previous one's checkpoint: tensor, pipeline and data parallel degrees change along it,
    and ZeRO-3's fp32 shards (FSDP2: no masters, trainer3d/checkpoint/precision.py) load into a
    tensor-parallel ZeRO-1 run.

    Each link stops one step after the save the next one resumes from (its ``checkpoint.every``
    is that step: a save in the background while training goes on, as in a long run), with the
    learning-rate schedule of the 20-step reference (optim.decay_steps = 20 - warm-up): the 20
    steps are trained once along the chain, each against the reference, instead of every link
    training to step 20."""
    ref = reference_losses(session_tmp, [*PARITY, *MODEL])
    chain = [(layout(2, 2, 2, zero=1), None), (layout(1, 4, 2, zero=1), 4), (layout(1, 1, 2, zero=3), 8),
             (layout(2, 1, 1, zero=1), 12), (layout(4, 1, 1), 15), (layout(1, 1, 1), 18)]
    previous = None
    for i, (lay, start) in enumerate(chain):
        run = tmp_path / f"run{i}"
        save, stop = (chain[i + 1][1], chain[i + 1][1] + 1) if i + 1 < len(chain) else (0, 20)  # 0: no save
        resume = [f"train.resume={store.step_dir(previous / 'checkpoints', start)}"] if start else []
        stdout = train_in_ranks(run, [*BASE, *lay, f"checkpoint.every={save}", SAME_SCHEDULE,
                                      f"train.max_steps={stop}", *resume])
        if start:
            assert "layout changed since the checkpoint" in stdout
            if lay == layout(2, 1, 1, zero=1):
                assert "zero_stage 3 -> 1" in stdout, stdout
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == list(range(start or 0, stop))
        got = [r["loss"] for r in rows]
        print(f"{' '.join(lay)} from step {start or 0}: worst {assert_close(got, ref[start or 0:stop]):.1e}")
        previous = run


@pytest.mark.slow
def test_kill_mid_save_keeps_the_previous_checkpoint(tmp_path, session_tmp):
    run = tmp_path / "run"
    # Rank 1 killed: the follower sees its pid gone and ends the job (parallel.timeout_s bounds a rank that hangs instead).
    args = [*BASE, *layout(1, 1, 2), *KILL_RUN, "parallel.timeout_s=12"]
    plugin = Path(__file__).resolve().parents[1] / "support" / "plugins" / "stall_save"  # its sitecustomize stalls rank 1 in the step-4 save
    env = dict(os.environ, TRAINER3D_TEST_STALL_SAVE="1:4", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marker = run / "checkpoints" / "stalled-rank1"
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert marker.exists(), "rank 1 never reached the step-4 save"
    time.sleep(0.5)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # rank 1 dies after writing, before publication
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    # named dead at once (its pid gone, trainer3d/launch/follow.py), the survivor's fate shown too
    assert "rank 1: exited without a result" in out and "--- rank 1 log tail" in out, out
    assert "\n  rank 0: " in out, out
    root = run / "checkpoints"
    # Never published; rank 0 removes the partial directory of the failed save when it gets
    # the chance before the job is ended (and a stale one is removed by the next save).
    assert not store.step_dir(root, 4).exists()
    assert store.latest_complete(root)[0] == 2
    marker.unlink(missing_ok=True)
    # The restart picks step 2 and the run ends as if nothing had happened.
    stdout = train_in_ranks(run, [*args[:-1], "parallel.timeout_s=60"])
    assert "resumed from" in stdout and "step_00000002 at step 2" in stdout
    ref = reference_losses(session_tmp, [*PARITY, *MODEL])
    assert_close(losses_from(run, 0), ref[:8])
    assert not store.partial_dir(root, 4).exists()  # the stale partial save was cleaned up


def test_exported_weights_give_the_same_loss_in_the_1_rank_model(tmp_path):
    from safetensors.torch import load_file

    from trainer3d.checkpoint.export import model_config_of
    from trainer3d.data.loader import build_readers
    from trainer3d.model.transformer import Transformer, cross_entropy_loss
    from trainer3d.config.validate import validate
    from tests.unit.test_validate import make

    run = tmp_path / "run"  # step 4's checkpoint and its loss: the run stops there
    train_in_ranks(run, [*BASE, *layout(2, 2, 1), "checkpoint.every=4", "train.max_steps=5",
                         "checkpoint.save_final=false"])
    rows = read_metrics(run)
    out = tmp_path / "export"
    # the script as ``python tools/export_model.py`` runs it, in this process (tests/support/run_scripts.py)
    done = run_script("tools/export_model.py", [str(store.step_dir(run / "checkpoints", 4)), str(out),
                                                "--format", "trainer3d"])
    assert done["code"] == 0, done["stderr"]
    import json
    model_cfg = model_config_of({"model": json.loads((out / "config.json").read_text())})
    model = Transformer(model_cfg)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)  # every name, every shape
    data, _ = build_readers(validate(make([*BASE, *layout(2, 2, 1)])), dp=1, dp_rank=0)  # the run's batches
    inputs, targets = data.batch(4)
    with torch.no_grad():
        loss = torch.stack([cross_entropy_loss(model(inputs[m]), targets[m]) for m in range(8)]).mean()
    assert abs(loss.item() - rows[4]["loss"]) / rows[4]["loss"] <= REL_TOL


def test_explicit_resume_path_is_checked_before_launch(tmp_path, capsys, monkeypatch):
    """The entry point's ``run`` in this process, on the config Hydra composes for that command
    line (as tests/integration/test_runlock.py's checkpoint.dir test): the refusal is its return
    status 2 and one line, before anything is launched."""
    monkeypatch.setenv(COMMAND_VAR, "")  # run() records the resume command here; restored after
    cfg = configure(tmp_path / "run", [*BASE, f"train.resume={tmp_path}/nope"])
    assert train.run(cfg) == 2
    err = capsys.readouterr().err
    assert f"train.resume={tmp_path}/nope is not a usable checkpoint" in err, err
    assert not (tmp_path / "run" / "submitit").exists()


# as tests/multirank/test_parity_matrix.py's Muon cases: fp32 Newton-Schulz, a small model
MUON = ("optim=muon", "optim.muon.ns_dtype=fp32", "model.dim=64", "model.ffn_dim=192", "model.n_layers=2")


@pytest.mark.slow
def test_muon_momentum_reshards_tp2_dp2_to_dp2(tmp_path, session_tmp):
    """optim=muon: the checkpoint carries each matrix's momentum buffer (optim.momentum_buffer.<name>,
    cut by tp and ZeRO-1 on save, by ZeRO-1 alone on load); the dp2 run resumed at step 10 from
    tp2 x dp2 ZeRO-1 goes on as the uninterrupted 1-rank Muon run (a lost or misplaced momentum
    moves the next step's update by the whole buffer)."""
    ref = reference_losses(session_tmp, [*PARITY, *MODEL, *MUON])
    first, second = tmp_path / "tp2dp2", tmp_path / "dp2"
    train_in_ranks(first, [*BASE, *MUON, *layout(2, 1, 2, zero=1), "checkpoint.every=10", SAME_SCHEDULE,
                           "train.max_steps=11"])  # stops one step after the save (as the ZeRO-3 test's)
    resume = f"train.resume={store.step_dir(first / 'checkpoints', 10)}"
    assert "layout changed since the checkpoint" in train_in_ranks(second, [*BASE, *MUON, *layout(1, 1, 2, zero=1),
                                                                           SAME_SCHEDULE, resume])
    rows = read_metrics(second)
    assert [r["step"] for r in rows] == list(range(10, 20))
    print(f"worst {assert_close([r['loss'] for r in rows], ref[10:]):.1e}")
