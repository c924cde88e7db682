"""tools/bench/pipeline.py runs the project's pipeline on stages of fixed duration and prints
the measured bubble next to theory, for 1F1B and GPipe.

The stages sleep (30 ms forward, 60 ms backward per micro-batch: no CPU), so on an idle
machine the schedule alone decides how long each stage waits and the bubble is theory plus
the hand-over (about 0.01-0.03, the tool's docstring). A loaded
machine stretches both: a stage's small compute around its sleeps (embedding, head, loss)
waits for a core, which counts as busy and makes the stages unequal, and a woken rank
waits, which counts as idle. So the bounds are not a timing window but what a broken
measurement would cross: counting the waits as busy reads near 0, under theory / 2; missing
the backward (2/3 of each stage's work) reads 1 - m f / ((m + p - 1)(f + b)) = 0.78 at m = 2
and 0.70 at m = 8, above theory + (1 - theory) / 2 = 0.67 and 0.56; a bubble that does not
shrink with more micro-batches is no pipeline's.
"""

from tests.conftest import ROOT
from tests.support.run_scripts import run_here
from trainer3d.parallel.pipeline.bubble import bubble_theory


def test_bench_pipeline_prints_measured_bubble_and_theory():
    proc = run_here(ROOT / "tools" / "bench" / "pipeline.py", ["--model", "sleep", "--schedules", "1f1b,gpipe", "--pp", "2",
                                                               "--multiples", "1,4", "--steps", "2", "--warmup", "1"])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    points = [(r[0], int(r[1]), int(r[2])) for r in rows]
    assert points == [("1f1b", 2, 2), ("1f1b", 2, 8), ("gpipe", 2, 2), ("gpipe", 2, 8)], proc.stdout
    measured = {}
    for (schedule, pp, m), row in zip(points, rows):
        theory = bubble_theory(pp, m)  # (pp - 1) / (m + pp - 1): 1/3 and 1/9
        assert abs(float(row[3]) - theory) < 1e-3, row
        measured[schedule, m] = float(row[4])
        assert theory / 2 <= measured[schedule, m] < theory + (1 - theory) / 2, proc.stdout
    for schedule in ("1f1b", "gpipe"):  # the fill and drain shrink as m grows (theory: 0.33 -> 0.11)
        assert measured[schedule, 8] < measured[schedule, 2], proc.stdout
