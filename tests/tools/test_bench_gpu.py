"""tools/bench/gpu.py: refuses a machine without CUDA in one line; its CPU smoke mode prints the table
with the model-state bytes trainer3d/memory/states.py predicts (the GPU figures come from a GPU machine)."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from trainer3d.config.schema import ModelConfig
from trainer3d.memory.states import engine_model_state_bytes, format_bytes
from trainer3d.model.transformer import count_parameters

TOOL = [sys.executable, str(ROOT / "tools" / "bench" / "gpu.py")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    out = subprocess.run(TOOL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no CUDA device is visible" in out.stderr and "--device cpu" in out.stderr


def test_cpu_smoke_prints_a_row_per_variant_with_the_model_state_estimate():
    out = subprocess.run([*TOOL, "--device", "cpu", "--compile", "off", "--steps", "1", "--warmup", "1"],
                         capture_output=True, text=True, timeout=300)
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
