"""Goodput: where each step's time went, with the planner's prediction for the run's own layout beside it.

Every metrics.jsonl row splits its measured step (seconds, ``step_time_s``: the mean over its
logging interval, and so are its parts) into

    bubble_s      the pipeline bubble: the step's share its pipeline ranks waited on their
                  neighbours (``bubble``, 1 - stage compute / schedule wall, mean over ranks:
                  trainer3d/parallel/pipeline/bubble.py) times the step time; 0 without a pipeline
    comm_s        exposed communication: host time in communication calls after the backward
                  (the data-parallel reduction's unhidden share, the sequence-parallel tp sum,
                  the gradient norm's all-reduce; trainer3d/observe/telemetry.py), mean over ranks
    ckpt_stall_mean_s  the loop's standstill for checkpoint saves (the interval's mean; the row
                  where a save started keeps its own ``ckpt_stall_s``)
    compute_s     the rest: forward and backward compute, the optimizer, the host's own work

and carries the planner's prediction for the layout it runs (``predicted_*``,
trainer3d/plan/step_time.py: ``predicted_step_time_s``, ``predicted_compute_s``,
``predicted_bubble_s`` (the fill and drain plus the stage hand-overs: what a rank spends
waiting on its neighbours), ``predicted_comm_s`` (exposed data-parallel communication),
``predicted_tokens_per_s``). At the end of training ``summarize`` adds up the run's rows and
the work lost to restarts (``lost_s``: the measured time of steps done before a restart and
done again after it, the rows dropped from metrics.jsonl on resume, summed over every
restart): ``goodput = compute_s / (train_s + lost_s)``. Rank 0 prints it, writes it to
``<run_dir>/goodput.json`` and hands it to the sinks (wandb's run summary).

No framework compares its measured goodput with a prediction; here every run checks the
planner on its own layout.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

SUMMARY_FILE = "goodput.json"
PARTS = ("compute_s", "bubble_s", "comm_s", "ckpt_stall_mean_s")


@dataclass(frozen=True)
class Prediction:
    """The planner's step for this run's layout, seconds (trainer3d/plan/step_time.py's terms)."""

    step_s: float
    compute_s: float
    bubble_s: float
    comm_s: float
    tokens_per_s: float
    device: str
    """The device preset (or calibration) the prediction is made for."""

    def columns(self) -> Dict[str, float]:
        """The ``predicted_*`` columns of every metrics row."""
        return {"predicted_step_time_s": self.step_s, "predicted_compute_s": self.compute_s,
                "predicted_bubble_s": self.bubble_s, "predicted_comm_s": self.comm_s,
                "predicted_tokens_per_s": self.tokens_per_s}


def split_step(mean: dict) -> Dict[str, float]:
    """An interval's mean step (``step_time_s``, ``bubble``, ``comm_s``, ``ckpt_stall_s``) in
    goodput's parts: ``bubble_s``, ``ckpt_stall_mean_s`` and ``compute_s``, the rest."""
    step = mean["step_time_s"]
    bubble = mean.get("bubble", 0.0) * step
    stall = mean.get("ckpt_stall_s", 0.0)
    return {"bubble_s": bubble, "ckpt_stall_mean_s": stall,
            "compute_s": max(0.0, step - bubble - mean.get("comm_s", 0.0) - stall)}


def lost_before(run_dir: Path, dropped_rows: List[dict]) -> float:
    """Work lost to restarts so far: what an earlier end of this run recorded (goodput.json),
    plus the measured time of the rows this resume drops (steps it will do again)."""
    earlier = 0.0
    summary = Path(run_dir) / SUMMARY_FILE
    if summary.is_file():
        earlier = json.loads(summary.read_text()).get("lost_s", 0.0)
    return earlier + sum(row.get("step_time_s", 0.0) for row in dropped_rows)


def summarize(rows: List[dict], lost_s: float, prediction: Optional[Prediction]) -> dict:
    """The run's totals by part, its goodput, and the prediction beside the measurement."""
    totals = {part: sum(row.get(part, 0.0) for row in rows) for part in PARTS}
    totals["ckpt_stall_s"] = totals.pop("ckpt_stall_mean_s")
    train_s = sum(row["step_time_s"] for row in rows)
    steps = len(rows)
    out = {"steps": steps, "train_s": train_s, **totals, "lost_s": lost_s,
           "goodput": totals["compute_s"] / (train_s + lost_s) if train_s + lost_s > 0 else None,
           "step_time_s": train_s / steps if steps else None,
           # total tokens over total time: a mean of per-step rates lets a few fast steps outweigh
           # the slow ones (a row's rate times its step time is its step's tokens)
           "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / train_s if train_s > 0 else None}
    if prediction is not None:
        out["predicted"] = asdict(prediction)
        if steps and prediction.step_s > 0:
            out["measured_over_predicted_step_time"] = out["step_time_s"] / prediction.step_s
    return out


def summary_lines(summary: dict) -> List[str]:
    """The console summary at the end of training."""
    total = summary["train_s"] + summary["lost_s"]
    if summary["steps"] == 0 or total <= 0:
        return ["goodput: no step measured"]
    parts = ", ".join(f"{name} {summary[key]:.2f} s" for name, key in (
        ("compute", "compute_s"), ("pipeline bubble", "bubble_s"), ("exposed communication", "comm_s"),
        ("checkpoint stall", "ckpt_stall_s"), ("lost to restarts", "lost_s")))
    lines = [f"goodput: {100 * summary['goodput']:.1f}% of {total:.2f} s ({parts})"]
    predicted = summary.get("predicted")
    if predicted is None:
        lines.append("predicted: none for this device (trainer3d/plan/devices.py has no preset for it)")
        return lines
    lines.append(f"per step, measured / predicted for this layout on {predicted['device']}: "
                 f"{summary['step_time_s']:.4f} / {predicted['step_s']:.4f} s "
                 f"(x{summary['measured_over_predicted_step_time']:.2f}); compute "
                 f"{summary['compute_s'] / summary['steps']:.4f} / {predicted['compute_s']:.4f}, bubble "
                 f"{summary['bubble_s'] / summary['steps']:.4f} / {predicted['bubble_s']:.4f}, comm "
                 f"{summary['comm_s'] / summary['steps']:.4f} / {predicted['comm_s']:.4f}; tokens/s "
                 f"{summary['tokens_per_s']:,.0f} / {predicted['tokens_per_s']:,.0f}")
    return lines


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path
