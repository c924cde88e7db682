"""Goodput's accounting (trainer3d/observe/goodput.py) on hand-made rows, and the work lost to a
restart as metrics.jsonl's resume sees it."""

import json

import pytest
import torch

from trainer3d.observe.goodput import Prediction, split_step, summarize, summary_lines
from trainer3d.observe.metrics import MetricsLogger
from trainer3d.parallel.topology import ParallelDims, Topology


def test_a_step_splits_into_bubble_exposed_comm_stall_and_compute():
    parts = split_step({"step_time_s": 2.0, "bubble": 0.25, "comm_s": 0.3, "ckpt_stall_s": 0.2})
    assert parts == {"bubble_s": 0.5, "ckpt_stall_mean_s": 0.2, "compute_s": pytest.approx(1.0)}
    assert split_step({"step_time_s": 1.0})["compute_s"] == 1.0  # no pipeline, no comm, no save


def test_summary_adds_the_rows_and_the_lost_work_and_puts_the_prediction_beside():
    rows = [{"step": s, "step_time_s": 2.0, "tokens_per_s": 100.0, "compute_s": 1.5, "bubble_s": 0.25,
             "comm_s": 0.25, "ckpt_stall_mean_s": 0.0} for s in range(4)]
    predicted = Prediction(step_s=1.6, compute_s=1.2, bubble_s=0.3, comm_s=0.1, tokens_per_s=125.0, device="cpu")
    out = summarize(rows, lost_s=2.0, prediction=predicted)
    assert out["train_s"] == 8.0 and out["compute_s"] == 6.0 and out["lost_s"] == 2.0
    assert out["goodput"] == pytest.approx(6.0 / 10.0)  # compute over all the time spent, lost work included
    assert out["measured_over_predicted_step_time"] == pytest.approx(2.0 / 1.6)
    assert out["predicted"]["tokens_per_s"] == 125.0
    lines = summary_lines(out)
    assert lines[0].startswith("goodput: 60.0% of 10.00 s") and "lost to restarts 2.00 s" in lines[0]
    assert "x1.25" in lines[1]


def test_summary_tokens_per_s_is_the_tokens_over_the_time_not_a_mean_of_rates():
    # 4,096 tokens a step: one slow interval of 2 steps at 9 s, then 8 steps at 0.5 s (10 steps,
    # 22 s); a mean of the rows' rates would say (2 x 455 + 8 x 8,192) / 10 = 6,645 tok/s
    times = [9.0] * 2 + [0.5] * 8
    rows = [{"step": s, "step_time_s": t, "tokens_per_s": 4096 / t} for s, t in enumerate(times)]
    out = summarize(rows, lost_s=0.0, prediction=None)
    assert out["tokens_per_s"] == pytest.approx(10 * 4096 / 22.0)
    assert out["step_time_s"] == pytest.approx(2.2)


def test_a_resume_counts_the_steps_it_redoes_as_lost(tmp_path):
    dims = ParallelDims(topo=Topology(tp=1, pp=1, dp=1), rank=0, mesh=None, tp_group=None, dp_group=None,
                        pp_group=None, device=torch.device("cpu"))
    (tmp_path / "goodput.json").write_text(json.dumps({"lost_s": 1.5}))  # an earlier restart's
    rows = [{"step": s, "loss": 1.0, "step_time_s": 0.5 + s} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = MetricsLogger(dims, str(tmp_path), max_steps=10, tokens_per_step=1, start_step=3)
    assert logger.lost_s == pytest.approx(1.5 + 3.5 + 4.5)  # steps 3 and 4 are done again
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]
