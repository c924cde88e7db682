"""Attention of a query block on one key/value block, with its log-sum-exp, and the merge.

Blockwise attention (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, sec. 3.1):
softmax attention over keys K = K_1 ∪ K_2 is a weighted sum of the attention over each
part, weighted by each part's share of the normaliser: with lse_j the log-sum-exp of the
scores on K_j,

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 − lse) out_1 + exp(lse_2 − lse) out_2.

Backward of one block needs only the final ``out`` and ``lse`` (FlashAttention's backward,
Algorithm 4): P_j = exp(S_j − lse), dS_j = P_j ∘ (dP_j − rowsum(dO ∘ O)), so each block's
gradients are computed on their own and summed.

Tensors are (batch, heads, seq, head_dim); keys and values may have fewer heads than the
queries (grouped-query attention: query head h uses key/value head h // (heads / kv_heads)).
``causal`` is the top-left-aligned mask of a square diagonal block (a rank's own keys,
whose positions are those of its queries). Which kernel does the work (``block_kernel``): on
CPU, torch's flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, both GQA-aware); on CUDA, torch's fused flash or memory-efficient kernels (fused.py);
elsewhere, or where neither takes the dtype and head width, the same maths in plain torch ops,
scores in fp32 (or the inputs' dtype when wider), a tile of query rows at a time so the scores
never span the whole block.
"""

import functools
from typing import Optional, Tuple

import torch

from trainer3d.parallel.context import fused
from trainer3d.parallel.context.fused import expand_kv as _expand_kv
from trainer3d.parallel.context.fused import fold_kv as _fold_kv

_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")
LOW_PRECISION = (torch.float16, torch.bfloat16)


def block_kernel(device_type: str, dtype: torch.dtype, head_dim: int,
                 capability: Optional[Tuple[int, int]] = None) -> str:
    """Which kernel computes a block (one of ``KERNELS``), by torch's own admission rules
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): flash takes fp16/bf16 with a head
    width a multiple of 8 up to 256 on sm80 or newer (``capability``); the memory-efficient
    kernel fp32 and fp16 anywhere, bf16 from sm80, a head width a multiple of 8 (fp16/bf16) or
    4 (fp32); the plain-torch maths takes anything."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda":
        return "math"
    sm80 = capability is not None and capability >= (8, 0)
    if dtype in LOW_PRECISION and sm80 and head_dim <= 256 and head_dim % 8 == 0:
        return "cuda_flash"
    admitted = dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and sm80)
    if admitted and head_dim % (8 if dtype in LOW_PRECISION else 4) == 0:
        return "cuda_efficient"
    return "math"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def kernel_for(q: torch.Tensor) -> str:
    """``block_kernel`` for a block whose queries are ``q``."""
    cuda = q.device.type == "cuda"
    return block_kernel(q.device.type, q.dtype, q.shape[-1], _capability(q.device.index or 0) if cuda else None)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What scores and accumulators are kept in: fp32, or the inputs' dtype when wider."""
    return torch.promote_types(dtype, torch.float32)


TILE = 1024
"""Query rows per tile of the plain-torch kernels: their scores take tile x keys, not queries x keys."""


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, row0: int = 0,
            ids: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Scores of query rows row0.. of a block on its keys; ``causal``: key j hidden from row i where j > i;
    ``ids`` (the block's query rows' and keys' document ids, (batch, rows) and (batch, keys)): key j
    hidden from row i of another document (document masking under cp, documents.py)."""
    wide = acc_dtype(q.dtype)
    s = torch.matmul(q.to(wide), _expand_kv(k, q.shape[1]).to(wide).transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(row0, row0 + s.shape[-2], device=s.device)[:, None]
        s = s.masked_fill(torch.arange(s.shape[-1], device=s.device)[None, :] > rows, float("-inf"))
    if ids is not None:
        q_ids = ids[0][:, row0:row0 + s.shape[-2]]
        s = s.masked_fill((q_ids[:, None, :, None] != ids[1][:, None, None, :]), float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that attend to nothing (-inf) at 0, so exp(scores - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse in fp32 of shape (batch, heads, seq_q))."""
    kernel = kernel_for(q)
    if kernel == "cpu_flash":
        out, lse = _CPU_FORWARD(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if kernel == "cuda_flash":
        return fused.flash_forward(q, k, v, causal, scale)
    if kernel == "cuda_efficient":
        return fused.efficient_forward(q, k, v, causal, scale)
    return math_forward(q, k, v, causal, scale)


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 tile: int = TILE, ids: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``block_forward`` in plain torch ops (any device), ``tile`` query rows at a time; with
    ``ids`` (``_scores``) document-masked, a row that sees no key getting out 0 and lse -inf."""
    outs, lses = [], []
    values = _expand_kv(v, q.shape[1])
    for row0 in range(0, q.shape[2], tile):
        s = _scores(q[:, :, row0:row0 + tile], k, causal, scale, row0, ids)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), values.to(s.dtype)).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block's part of the attention whose final output is ``out`` with
    log-sum-exp ``lse`` (the merged ones, not this block's own)."""
    kernel = kernel_for(q)
    if kernel == "cpu_flash":
        return _CPU_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        return fused.flash_backward(dout, q, k, v, out, lse, causal, scale)
    if kernel == "cuda_efficient":
        return fused.efficient_backward(dout, q, k, v, out, lse, causal, scale)
    return math_backward(dout, q, k, v, out, lse, causal, scale)


def math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, tile: int = TILE,
                  ids: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_backward`` in plain torch ops (any device), ``tile`` query rows at a time; ``ids``
    as for ``math_forward``."""
    heads, kv_heads, wide = q.shape[1], k.shape[1], acc_dtype(q.dtype)
    keys, values = _expand_kv(k, heads).to(wide), _expand_kv(v, heads).to(wide)
    dk, dv, dqs = torch.zeros_like(keys), torch.zeros_like(values), []
    for row0 in range(0, q.shape[2], tile):
        rows = slice(row0, row0 + tile)
        p = torch.exp(_scores(q[:, :, rows], k, causal, scale, row0, ids) - _finite(lse[:, :, rows]).unsqueeze(-1))
        do = dout[:, :, rows].to(wide)
        dv += torch.matmul(p.transpose(-1, -2), do)
        delta = (do * out[:, :, rows].to(wide)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, values.transpose(-1, -2)) - delta) * scale
        dqs.append(torch.matmul(ds, keys).to(q.dtype))
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, rows].to(wide))
    return torch.cat(dqs, dim=2), _fold_kv(dk, kv_heads).to(k.dtype), _fold_kv(dv, kv_heads).to(v.dtype)


def merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the accumulators (``acc_dtype``; views allowed), in place."""
    lse = lse.to(acc_lse.dtype)
    new_lse = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
    acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse - new_lse).unsqueeze(-1))
    acc_lse.copy_(new_lse)
