"""tools/bench/deepspeed_pair.py: both halves train through their own entry points and print tokens/s."""

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.support import run_scripts

BENCH = str(ROOT / "tools" / "bench" / "deepspeed_pair.py")


def _run(*args: str) -> str:
    """One pair of 4 steps, all timed (--warmup 0: the first, with its start-up, too): the loss of
    the last follows 3 optimizer steps, below ln 257 by more than half a nat."""
    proc = subprocess.run([sys.executable, BENCH, "--pairs", "1", "--steps", "4", "--warmup", "0", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_trainer3d_half_trains_through_its_entry_point():
    out = _run("--only", "trainer3d")
    rate = re.search(r"^pair 1: trainer3d ([\d,]+) tok/s \(loss ([\d.]+)\)", out, re.M)
    assert rate and float(rate.group(1).replace(",", "")) > 0, out
    assert float(rate.group(2)) < 5.55  # below uniform guessing over 257 ids (ln 257): it trained


@pytest.mark.slow
def test_the_pair_prints_its_ratio_last():
    pytest.importorskip("deepspeed")
    out = _run()
    assert re.search(r"both models multiply [\d,]+ weights per token", out), out
    assert re.search(r"trainer3d / deepspeed tokens/s, median of 1 pairs: \d+\.\d{3}$", out.strip()), out
    losses = re.search(r"deepspeed [\d,]+ tok/s \(loss ([\d.]+)\)", out)
    assert losses and float(losses.group(1)) < 5.55, out  # DeepSpeed's side trains too (below ln 257)


def test_blocks_prints_each_models_block_time_and_their_ratio():
    """``--blocks`` at its fewest calls, run to its end in this process as ``python BENCH`` runs it
    (tests/support/run_scripts.py: torch is imported here already; the bench puts this thread's
    intra-op thread count back)."""
    done = run_scripts.run(BENCH, ["--blocks", "1", "--reps", "2"])
    assert done["code"] == 0, done["stderr"][-3000:]
    got = re.search(r"best thread time of 1 x 2: trainer3d Llama ([\d.]+) ms, GPT-2 ([\d.]+) ms, ratio ([\d.]+)",
                    done["stdout"])
    assert got, done["stdout"]
    llama, gpt2, ratio = map(float, got.groups())
    assert llama > 0 and gpt2 > 0 and ratio == pytest.approx(llama / gpt2, abs=2e-3)
