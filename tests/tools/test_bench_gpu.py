"""tools/bench/gpu.py: refuses a machine without CUDA in one line; its CPU smoke mode prints the table
with the model-state bytes trainer3d/memory/states.py predicts (the GPU figures come from a GPU machine)."""

import pytest
import torch

from tests.conftest import ROOT
from tests.support.run_scripts import run_all
from trainer3d.config.schema import ModelConfig
from trainer3d.memory.states import engine_model_state_bytes, format_bytes
from trainer3d.model.transformer import count_parameters

TOOL = ROOT / "tools" / "bench" / "gpu.py"
SMOKE = ["--device", "cpu", "--compile", "off", "--steps", "1", "--warmup", "1", "--seq-len", "16", "--micro-batch", "1"]


@pytest.fixture(scope="module")
def runs():
    """The tool as this file runs it, one invocation after another in one interpreter
    (tests/support/run_scripts.py: torch imported once): without arguments (only where CUDA is
    absent: the refusal) and its CPU smoke run at its smallest shape."""
    entries = {"smoke": SMOKE} if torch.cuda.is_available() else {"bare": [], "smoke": SMOKE}
    return dict(zip(entries, run_all([(TOOL, args) for args in entries.values()], timeout=300)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2(runs):
    out = runs["bare"]
    assert out.returncode == 2
    assert "no CUDA device is visible" in out.stderr and "--device cpu" in out.stderr


def test_cpu_smoke_prints_a_row_per_variant_with_the_model_state_estimate(runs):
    out = runs["smoke"]
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("tiny")]
    assert [(r[1], r[2]) for r in rows] == [("no", "no"), ("no", "yes")]
    # bf16 parameters (2 B), fp32 gradients (4), master weights (4) and Adam moments (8) per parameter
    psi = count_parameters(ModelConfig())
    estimate = engine_model_state_bytes(psi, 1, 0, "bf16").total
    assert abs(estimate - 18 * psi) / (18 * psi) < 0.01
    for r in rows:
        assert float(r[3].replace(",", "")) > 0 and r[4].endswith("%")
        assert " ".join(r[-2:]) == format_bytes(estimate)
