"""How fast one GPU runs a block's kernels, by shape: GEMMs, attention, and the host's launches.

GEMM (m x k by k x n), a roofline with the two quantisation effects of a tiled kernel
(NVIDIA, "Matrix Multiplication Background User's Guide", docs.nvidia.com/deeplearning/
performance/dl-performance-matrix-multiplication: "Tile quantization", "Wave quantization"):

    t = max(2 m n k / (rate x waves(m, n) x depth(k)),  p (m k + k n + m n) / HBM bandwidth)

    waves(m, n)  output tiles over the SMs: tiles / (ceil(tiles / SMs) x SMs) times the share
                 of each tile inside the output, the best of 256x128, 128x256, 128x128, 128x64
                 and 64x128 tiles (cuBLAS picks among such; the last wave runs part-empty)
    depth(k)     k / (k + K_FILL): each tile pays a fixed prologue (filling the multi-stage
                 shared-memory pipeline) and epilogue (writing C), about two 32-deep k-steps
    rate         chosen so that the model gives the *measured* maximum achievable matmul
                 rate at the shape it was measured at (``Kernels.mamf_*``)

The measured rates are the "Maximum Achievable Matmul FLOPS comparison table" of Stas
Bekman's ML Engineering book (github.com/stas00/ml-engineering, compute/accelerator/README.md:
bf16 matmul scanned over shapes; A100 SXM 267.9 TFLOP/s at 6912x16384x2048, H100 SXM 792.1 at
6144x17920x2816, A100 PCIe 256.4 at 2304x5120x1536); the H100 figure agrees with this
project's own torch.mm measurement (790 TFLOP/s at 8192^3, devices.py).

Attention, per micro-batch on one tensor-parallel rank:

    flash  the causal half of the score FLOPs (QK^T and PV: 4 b s^2 heads d / 2), forward
           once and backward 2.5 x (FlashAttention's backward recomputes QK^T), at
           ``flash_fraction`` of the data-sheet peak: FlashAttention-2 reaches 50-73% of the
           A100's peak forward (Dao 2023, arXiv:2307.08691, abstract), its backward less, so
           0.55 for both; on H100 the FlashAttention-2 kernel torch runs reaches 35% (Shah et
           al. 2024, "FlashAttention-3", arXiv:2407.08608, abstract) at long sequences and less
           at short ones: the H100 presets take FlashAttention-2's measured rate by sequence
           length (``flash_tflops``, head dim 128, H100 80GB SXM5: the paper's Figure 5, causal
           forward, and Figure 6, backward; the backward is plotted without the mask, and the
           causal one is assumed to run at that rate), interpolated in log2(seq)
    math   unfused (torch's math SDPA; Megatron-LM 2021's baddbmm + fused softmax + bmm): every
           score computed (s^2, the mask applied after), QK^T (s x s, head dim deep) and PV
           (s x head dim, s deep) as batched GEMMs by shape, plus the s^2 scores through
           memory: written, read and written by the softmax, read by PV (4 passes forward);
           backward dP written, the softmax's gradient reading P and dP and writing dS, dS
           read by two GEMMs, P read once more (7 passes)

Launches: a block runs ``block_ops()`` aten operators forward and about twice that backward
(counted by tracing a real block, not guessed); each costs the host ``launch_us`` to dispatch.
CUDA runs kernels asynchronously, so the host's time binds only when a block's kernels are
shorter than their launches (small models): a block takes the longer of the two. 10 us per
operator is an assumption of the order of PyTorch's eager dispatch plus a CUDA kernel launch,
not a measurement; only launch-bound (small) models depend on it.

The tile set and the fill depth K_FILL are modelling assumptions (the anchor is the measured
rate); the achievable HBM bandwidth is the Device's (0.8 of the data sheet, devices.py).
"""

import functools
import math
from dataclasses import dataclass
from typing import Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer3d.config.schema import ModelConfig
from trainer3d.model.transformer import Block

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128))
K_FILL = 64


@dataclass(frozen=True)
class Kernels:
    """The kernel figures of one GPU preset (sources in the module docstring)."""

    sms: int
    peak_tflops: float
    """Dense 16-bit data-sheet peak."""
    mamf_tflops: float
    """Measured maximum achievable bf16 matmul rate ..."""
    mamf_shape: Tuple[int, int, int]
    """... and the (m, n, k) it was measured at."""
    hbm_gbps: float
    """Achievable memory bandwidth, GB/s."""
    flash_fraction: float
    """FlashAttention forward + backward, of the data-sheet peak."""
    launch_us: float = 10.0
    """Host time to dispatch one eager operator."""
    flash_tflops: Tuple[Tuple[int, float, float], ...] = ()
    """Measured FlashAttention rates by sequence length: (seq, forward, backward TFLOP/s of the
    causal half); empty: ``flash_fraction`` of the peak at every length."""

    def flash_rates(self, s: int) -> Tuple[float, float]:
        """FLOP/s of the flash kernel's forward and backward at sequence length ``s``."""
        if not self.flash_tflops:
            rate = self.flash_fraction * self.peak_tflops * 1e12
            return rate, rate
        table = sorted(self.flash_tflops)
        x = math.log2(min(max(s, table[0][0]), table[-1][0]))
        for (s0, f0, b0), (s1, f1, b1) in zip(table, table[1:]):
            if x <= math.log2(s1):
                w = (x - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return (f0 + w * (f1 - f0)) * 1e12, (b0 + w * (b1 - b0)) * 1e12
        return table[-1][1] * 1e12, table[-1][2] * 1e12

    @property
    def rate(self) -> float:
        """FLOP/s of a GEMM free of quantisation, such that ``gemm_s`` reproduces the measurement."""
        m, n, k = self.mamf_shape
        return self.mamf_tflops * 1e12 / (waves(m, n, self.sms) * depth(k))

    def gemm_s(self, m: int, n: int, k: int, bytes_per: int = 2, batch: int = 1) -> float:
        """Seconds of ``batch`` independent (m x k) @ (k x n) products."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        compute = flops / (self.rate * waves(m, n, self.sms, batch) * depth(k))
        memory = batch * bytes_per * (m * k + k * n + m * n) / (self.hbm_gbps * 1e9)
        return max(compute, memory)

    def linear_s(self, tokens: int, n_in: int, n_out: int, bytes_per: int = 2) -> Tuple[float, float]:
        """Forward and backward (input gradient + weight gradient) of a linear layer."""
        fwd = self.gemm_s(tokens, n_out, n_in, bytes_per)
        bwd = self.gemm_s(tokens, n_in, n_out, bytes_per) + self.gemm_s(n_in, n_out, tokens, bytes_per)
        return fwd, bwd

    def attention_s(self, kernel: str, b: int, s: int, heads: int, head_dim: int, bytes_per: int = 2
                    ) -> Tuple[float, float]:
        """Forward and backward seconds of the attention core (scores to output) of ``heads``
        local heads over a micro-batch of ``b`` sequences of ``s`` tokens."""
        if kernel == "flash":
            flops = 4.0 * b * s * s * heads * head_dim / 2
            fwd_rate, bwd_rate = self.flash_rates(s)
            return flops / fwd_rate, 2.5 * flops / bwd_rate
        if kernel != "math":
            raise ValueError(f"attention kernel {kernel!r}: flash or math")
        n = b * heads
        scores = self.gemm_s(s, s, head_dim, bytes_per, n)            # Q K^T
        mix = self.gemm_s(s, head_dim, s, bytes_per, n)               # P V
        traffic = bytes_per * n * s * s / (self.hbm_gbps * 1e9)       # one pass over the scores
        fwd = scores + mix + 4 * traffic
        bwd = 2 * mix + scores + self.gemm_s(head_dim, s, s, bytes_per, n) + 7 * traffic
        return fwd, bwd


@functools.lru_cache(maxsize=4096)  # a search asks for the same few GEMM shapes per layout
def waves(m: int, n: int, sms: int, batch: int = 1) -> float:
    """Share of the SMs' tile slots doing work, the best tile shape's."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        used = (m * n * batch) / (tiles * tm * tn)  # tile quantisation: padding inside edge tiles
        best = max(best, used * tiles / (math.ceil(tiles / sms) * sms))
    return best


def depth(k: int) -> float:
    return k / (k + K_FILL)


@functools.lru_cache(maxsize=1)
def block_ops() -> Tuple[int, int]:
    """aten operators of one transformer block's forward and backward, counted by running a
    small block (the count does not depend on its size) under a dispatch mode."""
    class Count(TorchDispatchMode):
        calls = 0

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            """No: a mode that says yes has its ``__torch_dispatch__`` wrapped in
            ``torch._disable_dynamo``, whose first call imports torch._dynamo
            (torch/utils/_python_dispatch.py ``__init_subclass__``, torch/_compile.py): seconds
            of CPU in a planner that compiles nothing."""
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    block = Block(ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=8))
    x = torch.randn(8, 1, 32, requires_grad=True)
    with Count():
        out = block(x)
    fwd, Count.calls = Count.calls, 0
    with Count():
        out.sum().backward()
    return fwd, Count.calls


# FlashAttention-2 on an H100 80GB SXM5, head dim 128 (Shah et al. 2024, arXiv:2407.08608, Figures 5 and 6):
# (seq, causal forward, backward) TFLOP/s. FlashAttention is compute-bound: the H200 (same SMs and clocks) runs
# it at the same rates; the PCIe card at its peak's share (756 / 989).
H100_FLASH2 = ((512, 191.0, 214.0), (1024, 260.0, 260.0), (2048, 298.0, 291.0), (4096, 319.0, 310.0),
               (8192, 333.0, 318.0), (16384, 335.0, 322.0))
H100_PCIE_FLASH2 = tuple((s, f * 756 / 989, b * 756 / 989) for s, f, b in H100_FLASH2)

# Per preset; sources in the module docstring. Achievable bandwidth: 0.8 of the data sheet (devices.py).
KERNELS = {
    "a100": Kernels(sms=108, peak_tflops=312, mamf_tflops=267.9, mamf_shape=(6912, 16384, 2048), hbm_gbps=1600,
                    flash_fraction=0.55),
    "a100-40g": Kernels(sms=108, peak_tflops=312, mamf_tflops=267.9, mamf_shape=(6912, 16384, 2048),
                        hbm_gbps=1244, flash_fraction=0.55),
    "h100": Kernels(sms=132, peak_tflops=989, mamf_tflops=792.1, mamf_shape=(6144, 17920, 2816), hbm_gbps=2680,
                    flash_fraction=0.35, flash_tflops=H100_FLASH2),
    # no published MAMF for the PCIe card: the SXM's, scaled by the data sheets' peaks
    "h100-pcie": Kernels(sms=114, peak_tflops=756, mamf_tflops=792.1 * 756 / 989, mamf_shape=(6144, 17920, 2816),
                         hbm_gbps=1600, flash_fraction=0.35, flash_tflops=H100_PCIE_FLASH2),
    "h200": Kernels(sms=132, peak_tflops=989, mamf_tflops=792.1, mamf_shape=(6144, 17920, 2816), hbm_gbps=3840,
                    flash_fraction=0.35, flash_tflops=H100_FLASH2),
}
