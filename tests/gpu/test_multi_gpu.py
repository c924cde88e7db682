"""The parity matrix on NCCL: every layout trains, on GPUs, the model one GPU trains.

The CPU matrix (tests/multirank/test_parity_matrix.py, test_context_parity.py) proves the
engine's arithmetic on gloo; what it cannot see is what only a GPU rank does: NCCL's
collectives and their streams, a rank bound to ``cuda:<local rank>``, pinned host buffers and
side streams of offload, the checkpoint's device-to-host staging. Each case here runs the
real entry point (``python -m trainer3d.train``: submitit's local launcher starts one process
per rank, each on its own GPU, NCCL between them) for 20 fp32 steps at the PARITY settings and
compares its per-step losses with a one-GPU run of the same config (``assert_parity``, the
project's relative 1e-5: fp32 matmuls on CUDA are not TF32 unless asked for, torch's default,
so only the reduction order differs, as on CPU).

Each case skips, saying so, where the node has fewer GPUs than it needs; one node of 8 GPUs
runs them all (slurm/gpu_check.sbatch). Marked ``gpu``.
"""

import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from tests.support.runs import PARITY, assert_parity, losses, read_metrics, run_train
from trainer3d.checkpoint import store

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.slow,  # runs of 2-8 ranks; skipped on one GPU anyway
              pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (the gpu tier needs one; run "
                                 "`pytest -m gpu` on a GPU machine)")]

CUDA = ("parallel=single", "train.device=cuda")
KV4 = ("model.n_heads=8", "model.n_kv_heads=4")
"""8 heads in 4 kv-groups: tp=4 can split it, cp and tp=2 keep grouped-query attention."""
RUN_TIMEOUT = 900
"""Seconds for one layout's 20 steps, start-up (NCCL's communicators, CUDA contexts) included."""


def layout(tp=1, pp=1, dp=1, cp=1, zero=0) -> Tuple[str, ...]:
    return (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.cp={cp}",
            f"parallel.zero_stage={zero}")


def case(gpus: int, lay: Sequence[str], model: Sequence[str] = KV4, extra: Sequence[str] = (), id: str = ""):
    """A layout needing ``gpus`` GPUs, skipped below that."""
    return pytest.param(gpus, tuple(model), (*lay, *extra), id=id,
                        marks=pytest.mark.skipif(GPUS < gpus, reason=f"needs {gpus} GPUs, {GPUS} visible"))


MATRIX = [
    case(2, layout(tp=2), id="tp2"),
    case(2, layout(pp=2), id="pp2"),
    case(2, layout(dp=2, zero=1), id="dp2-z1"),
    case(2, layout(dp=2, zero=3), id="dp2-z3-fsdp2"),
    case(2, layout(dp=2, zero=1), extra=("parallel.offload_optimizer=true",), id="dp2-z1-offload"),
    case(2, layout(dp=2, zero=3), extra=("parallel.offload_optimizer=true",), id="dp2-z3-offload"),
    case(2, layout(cp=2), id="cp2"),
    case(4, layout(tp=4), id="tp4"),
    case(4, layout(tp=2, dp=2, zero=1), extra=("parallel.sequence_parallel=true",), id="tp2-dp2-z1-sp"),
    case(8, layout(tp=2, pp=2, dp=2, zero=1), id="tp2-pp2-dp2-z1"),
    case(8, layout(tp=2, pp=2, dp=2, zero=1), extra=("train.activation_checkpointing=true",),
         id="tp2-pp2-dp2-z1-recompute"),
]

_REFERENCES: Dict[Tuple[str, ...], List[float]] = {}


def one_gpu_losses(root: Path, model: Sequence[str]) -> List[float]:
    """The one-GPU run of ``model`` at PARITY, once per module (the cases share it)."""
    key = tuple(model)
    if key not in _REFERENCES:
        _REFERENCES[key] = losses(root / f"one-gpu-{len(_REFERENCES)}", [*PARITY, *CUDA, *model],
                                  timeout=RUN_TIMEOUT)
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def reference_root(tmp_path_factory):
    return tmp_path_factory.mktemp("one-gpu")


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("gpus,model,lay", MATRIX)
def test_layout_on_nccl_matches_one_gpu(tmp_path, reference_root, gpus, model, lay):
    ref = one_gpu_losses(reference_root, model)
    got = losses(tmp_path, [*PARITY, *CUDA, *model, *lay], timeout=RUN_TIMEOUT)
    print(f"{' '.join(lay)} on {gpus} GPUs: worst relative loss difference {assert_parity(got, ref):.1e}")


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.skipif(GPUS < 4, reason=f"needs 4 GPUs, {GPUS} visible")
def test_resume_on_nccl_into_another_layout(tmp_path, reference_root):
    """dp2 ZeRO-3 (FSDP2's shards, staged from the GPUs) saves at step 10; tp2 x dp2 ZeRO-1 and
    pp2 resume it (the directions tests/integration/test_checkpoint_resume.py proves on gloo):
    the steps after each resume are the one-GPU run's."""
    ref = one_gpu_losses(reference_root, KV4)
    first = tmp_path / "dp2-z3"
    run_train(first, [*PARITY, *CUDA, *KV4, *layout(dp=2, zero=3), "checkpoint.every=10", "checkpoint.keep=5"],
              timeout=RUN_TIMEOUT)
    for name, lay in (("tp2-dp2-z1", layout(tp=2, dp=2, zero=1)), ("pp2", layout(pp=2))):
        run = tmp_path / name
        proc = run_train(run, [*PARITY, *CUDA, *KV4, *lay, f"train.resume={store.step_dir(first / 'checkpoints', 10)}"],
                         timeout=RUN_TIMEOUT)
        assert "resumed from" in proc.stdout, proc.stdout[-2000:]
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == list(range(10, 20)), [r["step"] for r in rows]
        got = [r["loss"] for r in rows]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref[10:]))
        assert worst <= 1e-5, f"{name} resumed from dp2 ZeRO-3: worst relative difference {worst:.2e}"


BF16_REL_TOL = 2e-2
"""As tests/gpu/test_gpu.py: bf16 against fp32 over 20 steps."""


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
def test_bf16_dp2_zero1_on_nccl_tracks_fp32(tmp_path, reference_root):
    """bf16 parameters with NCCL's reduction of fp32 gradients over two GPUs: within bf16's
    rounding of the one-GPU fp32 run, and every rank's telemetry a CUDA device's."""
    ref = one_gpu_losses(reference_root, KV4)
    got = losses(tmp_path, [*PARITY, *CUDA, *KV4, *layout(dp=2, zero=1), "train.dtype=bf16"], timeout=RUN_TIMEOUT)
    assert_parity(got, ref, rel_tol=BF16_REL_TOL)
    assert all(r["mem_allocated_bytes"] > 0 and "mem_rss_bytes" not in r for r in read_metrics(tmp_path))


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
def test_the_parity_tool_passes_tp2_against_one_gpu(tmp_path):
    """What a user runs on a new cluster (trainer3d/tools/parity.py): tp2 on two GPUs against
    one GPU, PASS and exit 0."""
    own = ("train.max_steps", "train.log_every", "train.grad_accum_steps")  # the tool sets these itself
    common = " ".join([*(o for o in PARITY if not o.startswith(own)), *KV4, "train.device=cuda"])
    proc = subprocess.run([sys.executable, "-m", "trainer3d.tools.parity", "parallel=single parallel.tp=2",
                           "--steps", "20",
                           "--common", common, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=2 * RUN_TIMEOUT)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PASS"), proc.stdout[-3000:] + proc.stderr[-3000:]
