"""The GPU tier: what only a CUDA device can show. Every test is marked ``gpu`` and skips, with
the reason, where no CUDA device is visible (CI has none): run ``pytest -m gpu`` on a GPU machine.

One GPU is one NCCL rank, so these run ``parallel=single`` (a mesh of size 1 on NCCL) through
the real entry point, 20 steps of the tiny model at the parity settings (tests/support/runs.py).
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.support.runs import PARITY, assert_parity, losses, read_metrics, run_train
from trainer3d.config.schema import ModelConfig
from trainer3d.model.flops import peak_tflops
from trainer3d.model.transformer import Transformer, cross_entropy_loss

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


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """This GPU's bf16 matmul rate, measured: ``reps`` products of n x n matrices timed by CUDA
    events after a warm-up (the shape of devices.py's 790 TFLOP/s H100 figure)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.mm(a, b, out=out)
    end.record()
    end.synchronize()
    return 2.0 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def counted_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """FLOPs of one token's forward and backward as torch's FlopCounterMode counts the model's
    aten ops on this GPU (its own formulas for mm and the CUDA attention kernels): a count
    independent of trainer3d/model/flops.py's formula."""
    model = Transformer(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (1, seq + 1), device="cuda")
    with FlopCounterMode(display=False) as counter:
        cross_entropy_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    return counter.get_total_flops() / seq


def test_entry_point_runs_bf16_on_nccl_with_cuda_memory_and_mfu(tmp_path, monkeypatch):
    """bf16 on one NCCL rank: CUDA memory telemetry, and an MFU that is what torch's own FLOP
    count says at the logged throughput, under the matmul rate this GPU was measured at in
    the same test (no step runs faster than the chip's best matmul)."""
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
    achieved = counted_flops_per_token(ModelConfig(), 64) * row["tokens_per_s_per_rank"] / 1e12  # seq 64: PARITY
    assert row["mfu"] * peak == pytest.approx(achieved, rel=0.03)
    measured = matmul_tflops()
    print(f"{name}: bf16 matmul {measured:.0f} TFLOP/s measured, {peak:.0f} on the data sheet; "
          f"the tiny run {achieved:.2f} TFLOP/s (MFU {row['mfu']:.2%})")
    assert row["mfu"] * peak < measured <= 1.05 * peak, "an MFU above the chip's measured matmul rate, or a " \
        "data-sheet peak below what the chip does: trainer3d/model/flops.py's table is wrong for this GPU"


def test_bf16_tracks_fp32(tmp_path, fp32_cuda):
    got = losses(tmp_path, [*PARITY, *CUDA, "train.dtype=bf16"])
    worst = assert_parity(got, fp32_cuda, rel_tol=BF16_REL_TOL)
    print(f"bf16 vs fp32: worst relative loss difference {worst:.1e}")


def test_compiled_matches_eager_on_gpu(tmp_path, fp32_cuda):
    got = losses(tmp_path, [*PARITY, *CUDA, "train.compile=true"])
    worst = assert_parity(got, fp32_cuda, rel_tol=COMPILE_REL_TOL)
    print(f"compiled vs eager on CUDA: worst relative loss difference {worst:.1e}")


@pytest.mark.slow  # two compilations: trainer3d-gpu-check runs it on one GPU with --full-tier only
@pytest.mark.parametrize("extra", [("parallel.zero_stage=3",), ("train.activation_checkpointing=true",)],
                         ids=["zero3-fsdp2", "recompute"])
def test_compiled_with_zero3_or_recomputation_matches_eager(tmp_path, fp32_cuda, extra):
    """train.compile with FSDP2's hooks around each compiled block (ZeRO-3 on a mesh of one) or
    with each block's forward recomputed in backward: the eager one-GPU losses."""
    got = losses(tmp_path, [*PARITY, *CUDA, "train.compile=true", *extra])
    worst = assert_parity(got, fp32_cuda, rel_tol=COMPILE_REL_TOL)
    print(f"compiled, {extra[0]}: worst relative loss difference {worst:.1e}")


FP16_REL_TOL = 2e-2
"""fp16 keeps 10 bits of mantissa, finer than bf16's 8: bf16's tolerance holds."""


def test_fp16_with_the_default_loss_scale_tracks_fp32(tmp_path, fp32_cuda):
    """fp16 on CUDA at the default scale (2^16): no step overflows on this model, the scale
    used is logged every step, and the losses track fp32."""
    got = losses(tmp_path, [*PARITY, *CUDA, "train.dtype=fp16"])
    rows = read_metrics(tmp_path)
    assert all(r["loss_scale"] == 2.0 ** 16 and not r["skipped"] for r in rows), [(r["loss_scale"], r["skipped"])
                                                                                  for r in rows]
    print(f"fp16 vs fp32: worst relative loss difference {assert_parity(got, fp32_cuda, rel_tol=FP16_REL_TOL):.1e}")


def test_fp16_backs_off_an_overflowing_loss_scale_and_trains_on(tmp_path):
    """fp16 from a scale of 2^32: any gradient element above 2^-16 overflows fp16's largest value
    (65504) once scaled, so the first steps are skipped, and each halves the scale
    (torch.amp.GradScaler's rule, backoff 0.5, growth only after 2000 clean steps); by 2^15 a
    gradient element up to 2 is finite, so within about 17 skips the run trains on, with finite
    losses that fall (the last 10 of the 40 steps clean)."""
    steps = ("train.max_steps=40",)
    run_train(tmp_path, [*(o for o in PARITY if not o.startswith("train.max_steps")), *steps, *CUDA,
                         "train.dtype=fp16", f"train.loss_scale_init={2.0 ** 32}"])
    rows = read_metrics(tmp_path)
    skipped = [bool(r["skipped"]) for r in rows]
    assert skipped[0] and not any(skipped[-10:]), skipped  # overflows first, clean at the end
    k = skipped.index(False)
    expected, scale = [], 2.0 ** 32
    for skip in skipped:
        expected.append(scale)
        scale *= 0.5 if skip else 1.0
    assert [r["loss_scale"] for r in rows] == expected
    kept = [r["loss"] for r in rows[k:]]
    assert all(math.isfinite(x) for x in kept) and kept[-1] < kept[0]


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
