"""The GPU tier: what only a CUDA device can show. Every test is marked ``gpu`` and skips, with
the reason, where no CUDA device is visible (CI has none): run ``pytest -m gpu`` on a GPU machine.

One GPU is one NCCL rank, so these run ``parallel=single`` (a mesh of size 1 on NCCL) through
the real entry point, 20 steps of the tiny model at the parity settings (tests/support/runs.py).
"""

import pytest
import torch

from tests.support.runs import PARITY, assert_parity, losses, read_metrics, run_train
from trainer3d.config.schema import ModelConfig
from trainer3d.model.flops import flops_per_token, peak_tflops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "needs one; run `pytest -m gpu` on a GPU machine)")]

CUDA = ("parallel=single", "train.device=cuda")
BF16_REL_TOL = 2e-2
"""bf16 against fp32, per step over 20 steps: bf16 keeps 8 bits of mantissa (relative rounding
2^-8 = 3.9e-3 per operation); the fp32 master weights and fp32 loss keep the drift to a
few roundings, well inside 2%, while a wrong cast or a lost gradient moves the loss more."""
COMPILE_REL_TOL = 1e-4
"""Compiled against eager on the GPU, fp32: inductor fuses and reorders reductions (the CPU
parity is 1e-5; GPU kernels differ more in summation order)."""


@pytest.fixture(scope="module")
def fp32_cuda(tmp_path_factory):
    return losses(tmp_path_factory.mktemp("fp32"), [*PARITY, *CUDA])


def test_entry_point_runs_bf16_on_nccl_with_cuda_memory_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # NCCL announces itself: proof the mesh was built on it
    run_train(tmp_path, [*PARITY, *CUDA, "train.dtype=bf16"])
    rows = read_metrics(tmp_path)
    assert len(rows) == 20 and rows[-1]["loss"] < rows[0]["loss"]
    log = "".join(p.read_text() for p in (tmp_path / "submitit").glob("*_0_log.*"))
    assert "NCCL INFO" in log
    for row in rows:
        assert row["mem_allocated_bytes"] > 0 and row["mem_reserved_bytes"] >= row["mem_allocated_bytes"]
        assert "mem_rss_bytes" not in row
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops(name, "bf16")
    if peak is None:
        pytest.skip(f"{name} is not in trainer3d/model/flops.py's data-sheet table")
    row = rows[-1]
    tflops = flops_per_token(ModelConfig(), 64) * row["tokens_per_s_per_rank"] / 1e12  # seq 64: PARITY
    assert row["mfu"] == pytest.approx(tflops / peak, rel=1e-3)


def test_bf16_tracks_fp32(tmp_path, fp32_cuda):
    got = losses(tmp_path, [*PARITY, *CUDA, "train.dtype=bf16"])
    worst = assert_parity(got, fp32_cuda, rel_tol=BF16_REL_TOL)
    print(f"bf16 vs fp32: worst relative loss difference {worst:.1e}")


def test_compiled_matches_eager_on_gpu(tmp_path, fp32_cuda):
    got = losses(tmp_path, [*PARITY, *CUDA, "train.compile=true"])
    worst = assert_parity(got, fp32_cuda, rel_tol=COMPILE_REL_TOL)
    print(f"compiled vs eager on CUDA: worst relative loss difference {worst:.1e}")


def test_profile_window_on_cuda_writes_a_trace_with_kernels_and_a_memory_snapshot(tmp_path):
    """train.profile on CUDA: the trace holds the GPU's kernels, and the memory snapshot is the
    allocator's (what pytorch.org/memory_viz reads: a pickle with segments and traces)."""
    import json
    import pickle

    run_train(tmp_path / "run", [*CUDA, *PARITY, "train.profile=[2,4]"])
    trace = json.loads((tmp_path / "run" / "profile" / "trace_rank0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"]), "CUDA kernels in the trace"
    snapshot = pickle.loads((tmp_path / "run" / "profile" / "memory_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0], "allocations recorded in the window"
