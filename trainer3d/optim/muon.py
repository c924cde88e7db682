"""Muon's arithmetic: which parameters it trains, the Newton-Schulz orthogonalisation and the
update's scale (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025,
"Muon is Scalable for LLM Training", arXiv 2502.16982).

Per Muon matrix W with reduced (and clipped) gradient G and momentum buffer B, one step is::

    B <- momentum * B + (1 - momentum) * G            (torch's lerp form)
    U <- G + momentum * (B - G)  if nesterov  else  B
    O <- NS(U)                                        (ns_steps quintic iterations, bf16)
    W <- W * (1 - lr * weight_decay) - adjust(lr, shape(W)) * O

the arithmetic of ``torch.optim.Muon`` (torch/optim/_muon.py), written out here so that one
process's step equals torch's bit for bit, and every layout's equals one process's up to the
order of the gradient's sums. The momentum and the look-ahead are elementwise (they run on any
shard); NS needs the whole matrix, which the layout assembles (parallel/zero/muon.py).
"""

import math
from typing import List, Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic's (a, b, c), torch's and Keller Jordan's defaults."""


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """Muon trains the matrices inside the blocks (attention's q/k/v/o, the SwiGLU's w1/w2/w3,
    the router, the experts' stacked matrices); AdamW the embedding, head and norms."""
    return name.startswith("layers.") and param.ndim >= 2


def matrices(t: torch.Tensor) -> List[torch.Tensor]:
    """The matrices Muon orthogonalises one by one: a 2-D weight, or each expert's slice of a
    stacked 3-D (experts, in, out) weight (model/moe.py)."""
    return [t] if t.ndim == 2 else list(t.unbind(0))


def matrix_shape(full_shape: Sequence[int]) -> Sequence[int]:
    """The shape of one matrix of a parameter of ``full_shape`` (its logical, unsharded shape)."""
    return tuple(full_shape[-2:])


def adjusted_lr(lr: float, adjust_lr: str, shape: Sequence[int]) -> float:
    """The update's scale for a matrix of ``shape`` (rows, cols): ``original`` sqrt(max(1, rows /
    cols)), ``match_rms_adamw`` 0.2 sqrt(max(rows, cols)), as torch's ``_adjust_lr``."""
    rows, cols = shape
    if adjust_lr == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"optim.muon.adjust_lr={adjust_lr} is not one of original, match_rms_adamw")


def newton_schulz(g: torch.Tensor, steps: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz iteration toward the orthogonal factor of ``g`` (2-D), in
    ``dtype`` (bf16: torch's and Keller Jordan's arithmetic, op for op): a matrix of g's shape."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


@torch.no_grad()
def momentum_lookahead_(grads: List[torch.Tensor], bufs: List[torch.Tensor], momentum: float,
                        nesterov: bool) -> None:
    """The elementwise half of the step, in place on matching (any) shards: ``bufs`` advance,
    ``grads`` become what NS orthogonalises."""
    if not grads:
        return
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    if nesterov:
        torch._foreach_lerp_(grads, bufs, momentum)
    else:
        torch._foreach_copy_(grads, bufs)

