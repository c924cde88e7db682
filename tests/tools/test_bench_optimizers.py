"""tools/bench/optimizers.py at its smallest budget: the tables it prints, not their numbers."""

import re

import pytest

from tests.conftest import ROOT
from tests.support.run_scripts import run_here


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 4 single-process runs and 8 ranks building 3 engines: minutes on a busy 2-core host
def test_optimizers_bench_prints_the_sweep_the_tokens_and_the_step_time_ratios():
    """Its smallest budget: one step a run (a loss of 100 is reached at the first), one rate and two
    seeds (the sweep's column, then the second seed trained at the rate it chose: both rounds of
    runs; a choice between two rates would be a tie, as a run's one logged loss precedes its first
    update), one timed step of the fewest micro-batches 1F1B takes (two of one sequence)."""
    proc = run_here(ROOT / "tools" / "bench" / "optimizers.py", [
        "--steps", "1", "--seeds", "2", "--lrs", "1e-2", "--window", "1", "--target", "100", "--jobs", "2",
        "--time-steps", "1", "--time-warmup", "0", "--time-micro-batch", "1", "--time-grad-accum", "2",
        "--timeout", "600"])  # a hung run ends its ranks and fails the test (its threads run in this process)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for name in ("adamw", "muon"):
        assert re.search(rf"^{name}\s+\d+\.\d{{4}}$", out, re.M), out  # the sweep: a loss per lr
        # every seed reaches a loss of 100 at its first step: 4,096 tokens
        assert re.search(rf"^{name}\s+0\.01\s+4,096\s+4,096\s+4,096$", out, re.M), out
    assert re.search(r"^muon / adamw tokens: 1\.00 x$", out, re.M), out
    for name in ("adamw", "muon-bf16", "muon-fp32"):
        assert re.search(rf"^{name}\s+\d+\.\d\dx$", out, re.M), out
    assert re.search(r"^adamw\s+1\.00x$", out, re.M), out
