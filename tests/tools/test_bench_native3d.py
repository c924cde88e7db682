"""tools/bench/native3d.py trains the same model with torch's own 3D stack and this engine."""

import re

import pytest

from tests.conftest import ROOT
from tests.support.run_scripts import run_here


@pytest.mark.slow
def test_native3d_trains_the_same_model_and_prints_a_ratio():
    """A small run that still compares trained models: a block per stage, two micro-batches (1F1B's
    fewest) of one sequence, three steps: the loss at the third follows two optimizer steps, enough
    for a learning rate off by half in one engine to move it past rel 1e-4 (one step is not)."""
    proc = run_here(ROOT / "tools" / "bench" / "native3d.py", ["--dim", "32", "--layers", "2", "--seq-len", "16",
                                                               "--micro-batch", "1", "--grad-accum", "2", "--steps", "2",
                                                               "--warmup", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(trainer3d|torch-native)\s+[\d.]+\s+([\d.]+)$",
                                                               proc.stdout, re.M)}
    assert rows.keys() == {"trainer3d", "torch-native"}, proc.stdout
    assert rows["trainer3d"] == pytest.approx(rows["torch-native"], rel=1e-4), proc.stdout  # the same model
    assert re.search(r"torch-native / trainer3d: \d+\.\d\d x step time$", proc.stdout.strip()), proc.stdout
