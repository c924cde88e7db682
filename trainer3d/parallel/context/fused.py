"""The ring's block attention on CUDA: torch's fused flash and memory-efficient kernels, which
return the log-sum-exp the merge needs and take a final (out, lse) in backward.

The aten ops behind ``F.scaled_dot_product_attention`` (aten/src/ATen/native/native_functions.yaml:
``_scaled_dot_product_flash_attention`` / ``_efficient_attention`` and their ``_backward``), called
directly as torch's own context parallelism does
(torch/distributed/tensor/experimental/_context_parallel/_attention.py). Flash attention's
backward (Dao 2023, FlashAttention-2, Algorithm 2) reads the output only for rowsum(dO ∘ O) and
the log-sum-exp only to rebuild the probabilities, so a block's gradients from the merged
output and log-sum-exp are its part of the whole attention's (kernels.py).

- flash: fp16/bf16, head_dim a multiple of 8 up to 256, sm80 or newer; grouped K/V as they are.
- memory-efficient: fp32 too; it takes every query head's K/V (torch 2.13's docstring: grouped
  attention "works only for Flash_attention and math kernel"), so grouped K/V are repeated and
  their gradients summed back; its log-sum-exp rows are padded to a multiple of 32
  (``kAlignLSE``, aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h).

No dropout: the kernels' random-number state is not read (their ``philox_seed``/``offset`` only
matter where dropout_p > 0), so backward passes empty ones.
"""

from typing import Tuple

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward
LSE_ALIGN = 32


def _no_rng(like: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv_heads, s, d) -> (b, heads, s, d), each kv head repeated for its query heads."""
    b, kv, s, d = t.shape
    if kv == heads:
        return t
    return t[:, :, None].expand(b, kv, heads // kv, s, d).reshape(b, heads, s, d)


def fold_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The reverse of ``expand_kv`` for gradients: sum over each kv head's query heads."""
    b, heads, s, d = t.shape
    if kv_heads == heads:
        return t
    return t.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def flash_forward(q, k, v, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = _FLASH(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    # cum_seq_q/k None: dense (not variable-length) inputs, as the forward returns them
    dq, dk, dv = _FLASH_BACKWARD(dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
                                 causal, _no_rng(q), _no_rng(q), scale=scale)
    return dq, dk, dv


def efficient_forward(q, k, v, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    heads = q.shape[1]
    out, lse, *_ = _EFFICIENT(q, expand_kv(k, heads), expand_kv(v, heads), None, True, 0.0, causal, scale=scale)
    return out, lse[:, :, :q.shape[2]]


def kernel_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` (b, heads, s, d) with the memory the efficient backward kernel reads it in: (b, s, heads, d)
    rows, heads * d apart. The op takes only out's batch and head strides and steps between query
    rows by heads * head_dim (kernel_backward.h ``o_strideM()``, attention_backward.cu sets no
    o_strideM and does not make ``out`` contiguous), which is the layout its own forward returns;
    the ring's merged output is (s, b, heads, d) in memory, its rows b * heads * d apart, and the
    kernel would read another batch's rows into rowsum(dO * O). A copy only where the layout differs."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    b, heads, s, _ = q.shape
    padded = torch.zeros((b, heads, -(-s // LSE_ALIGN) * LSE_ALIGN), dtype=torch.float32, device=q.device)
    padded[:, :, :s] = lse
    dq, dk, dv, _ = _EFFICIENT_BACKWARD(dout, q, expand_kv(k, heads), expand_kv(v, heads), None, kernel_layout(out),
                                        padded, _no_rng(q), _no_rng(q), 0.0, [True, True, True, False], causal,
                                        scale=scale)
    return dq, fold_kv(dk, k.shape[1]), fold_kv(dv, v.shape[1])
