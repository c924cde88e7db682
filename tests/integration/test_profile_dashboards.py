"""Where users look: a profiler trace, TensorBoard event files and wall-clock times, each read
back by its own reader — the trace's JSON (Chrome trace format: ``traceEvents``), and
tensorboard's ``EventAccumulator``, which TensorBoard itself reads event files with."""

import json
import time

import pytest

from tests.support.runs import read_metrics, train_in_ranks

RUN = ("model=tiny", "parallel=dp2", "train.max_steps=6", "train.log_every=1", "train.seq_len=64",
       "train.micro_batch_size=2", "train.global_batch_size=8", "train.grad_accum_steps=null",
       "train.eval_every=3", "train.eval_steps=1", "train.profile=[2,4]", "logger=tensorboard",
       "checkpoint.save_final=false")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboards") / "run"
    started = time.time()
    train_in_ranks(root, RUN)
    return root, started, time.time()


@pytest.mark.slow
def test_the_profile_window_writes_a_chrome_trace_on_every_rank(run):
    root, _, _ = run
    for rank in (0, 1):
        trace = json.loads((root / "profile" / f"trace_rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
        assert {n for n in names if n.startswith("trainer3d step")} == {"trainer3d step 2", "trainer3d step 3"}
    assert not (root / "profile" / "memory_rank0.pickle").exists(), "a memory snapshot is CUDA's allocator only"


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_step_at_its_wall_clock_time(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, started, ended = run
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == list(range(6))
    assert all(started <= r["time"] <= ended for r in rows), "metrics rows carry unix seconds"
    events = EventAccumulator(str(root / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "grad_norm", "val_loss"} <= set(events.Tags()["scalars"])
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in rows]
    for e, r in zip(loss, rows):
        assert abs(e.value - r["loss"]) <= 1e-6 * abs(r["loss"]) and abs(e.wall_time - r["time"]) < 1e-3
    assert [e.step for e in events.Scalars("val_loss")] == [r["step"] for r in rows if "val_loss" in r]
