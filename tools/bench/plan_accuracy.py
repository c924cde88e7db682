#!/usr/bin/env python
"""How well the planner's step-time model predicts this machine: layouts of one model run
through the real engine, predicted vs measured step time.

    python -m trainer3d.plan --calibrate          # once: this machine's figures
    python tools/bench/plan_accuracy.py [--rounds 2] [--calibration FILE] [--only 0,3,5] [--save steps.json]
    python tools/bench/plan_accuracy.py --measured steps.json    # predict again after recalibrating

Each layout runs as ``python -m trainer3d.train <COMMON> <layout>`` for ``--steps`` steps
(its ranks on this node, started as torchrun starts them: trainer3d/plan/probe.py; gloo), ``--rounds`` times, the layouts interleaved; its measured step time is
the fastest ``step_time_s`` of metrics.jsonl after ``--warmup`` steps over the rounds (on a
machine shared with other jobs: the least disturbed step, the footing --calibrate measures
on; the median is printed beside it). The prediction is trainer3d.plan's
(``search.evaluate``) for the same validated config on the calibrated Device, with the
layout's ranks on one node. The
table ends with the Spearman rank correlation, the median absolute error, and the layout
the planner would pick among these (the fastest predicted) against the measured fastest.
Timing is never asserted in the test suite; the README records a run.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer3d.plan.devices import DEFAULT_CALIBRATION, load_calibration  # noqa: E402
from trainer3d.plan.probe import measured_step_s, training_config  # noqa: E402
from trainer3d.plan.search import evaluate  # noqa: E402
from trainer3d.tools import output  # noqa: E402

# One model (2.2M parameters: dim 256, 4 blocks, grouped-query attention) and one global batch.
COMMON = ("model=tiny", "model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
          "model.ffn_dim=704", "train.seq_len=64", "train.global_batch_size=8", "train.grad_accum_steps=null",
          "train.dtype=fp32", "optim.warmup_steps=2", "parallel.timeout_s=600")

LAYOUTS = (
    "parallel=single train.micro_batch_size=4",
    "parallel=single parallel.dp=2 train.micro_batch_size=4",
    "parallel=single parallel.tp=2 train.micro_batch_size=4",
    "parallel=single parallel.pp=2 train.micro_batch_size=2",
    "parallel=single parallel.pp=2 parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual_stages=2 "
    "train.micro_batch_size=2 train.activation_checkpointing=true",
    "parallel=single parallel.tp=2 parallel.dp=2 parallel.sequence_parallel=true train.micro_batch_size=2",
    "parallel=single parallel.pp=4 parallel.pp_schedule=gpipe train.micro_batch_size=1",
    "parallel=single parallel.dp=4 parallel.zero_stage=1 train.micro_batch_size=2",
    "parallel=tp2-pp2-dp2 train.micro_batch_size=2",
)


def ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", default=DEFAULT_CALIBRATION)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every layout, interleaved")
    parser.add_argument("--save", help="write the measured step times here (JSON)")
    parser.add_argument("--measured", help="predict the step times --save wrote, without running anything")
    parser.add_argument("--only", help="comma-separated layout indices")
    args = parser.parse_args()
    if args.save:
        try:
            output.check(args.save, [args.measured] if args.measured else [])
        except output.OutputError as err:
            raise SystemExit(f"plan_accuracy: {err}") from None
    device = load_calibration(args.calibration)
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(LAYOUTS))
    steps = {i: [] for i in chosen}
    if args.measured:  # step times of an earlier run: predict again (after --calibrate), run nothing
        steps.update({int(i): v for i, v in json.loads(Path(args.measured).read_text()).items() if int(i) in steps})
    prediction = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(0 if args.measured else args.rounds):
            for i in chosen:
                overrides = [*COMMON, *LAYOUTS[i].split()]
                steps[i] += measured_step_s(overrides, args.steps, args.warmup, Path(tmp) / f"{round_}-{i}")
                print(f"round {round_} #{i}: fastest step so far {min(steps[i]):.3f} s, load "
                      f"{os.getloadavg()[0]:.1f}: {LAYOUTS[i]}", flush=True)
                if args.save:
                    with output.new_file(Path(args.save)) as saved:  # never torn by a stopped bench
                        saved.write_text(json.dumps(steps))
    for i in chosen:
        cfg = training_config([*COMMON, *LAYOUTS[i].split()])
        world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
        prediction[i] = (world, evaluate(cfg, device, world, "gloo").step.total)
    rows = [(i, LAYOUTS[i], *prediction[i], min(steps[i]), statistics.median(steps[i]))
            for i in chosen]
    print("\n| # | layout | ranks | predicted s | measured s (fastest step) | error | median step s |\n"
          "|---|---|---|---|---|---|---|")
    for i, layout, world, pred, fastest, median in rows:
        print(f"| {i} | `{layout}` | {world} | {pred:.3f} | {fastest:.3f} | {(pred - fastest) / fastest:+.0%} | "
              f"{median:.3f} |")
    predicted, measured = [r[3] for r in rows], [r[4] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    print(f"\nSpearman rank correlation {spearman(predicted, measured):.2f}, median |error| "
          f"{statistics.median(errors):.0%} over {len(rows)} layouts ({device.source})")
    pick, best = min(rows, key=lambda r: r[3]), min(rows, key=lambda r: r[4])
    print(f"the planner's pick: #{pick[0]} (measured {pick[4]:.3f} s); measured fastest: #{best[0]} ({best[4]:.3f} s)"
          + ("" if pick is best else f", the pick is {pick[4] / best[4] - 1:.0%} slower"))


if __name__ == "__main__":
    main()
