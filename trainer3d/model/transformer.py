"""A Llama-style decoder-only transformer, written once and untouched by parallelism.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021; optionally with
Llama 3.1's frequency scaling), SwiGLU MLP (Shazeer 2020), grouped-query attention (Ainslie
et al. 2023), optionally tied input/output embeddings, no biases, no dropout. The layout of
every weight is Hugging Face's Llama's (rotary pairs (i, i + head_dim/2)), so its
checkpoints load without permuting anything (trainer3d/hf/mapping.py).

Parallelism is applied from outside: ``parallel/tensor/layers.py`` swaps the Linear/Embedding
submodules for tensor-parallel ones, ``parallel/pipeline/schedule.py`` deletes the layers another
stage owns (setting ``tok_embeddings`` / ``norm`` / ``output`` to None). So this file
never reads ``n_heads`` to shape a tensor at run time: it reads the shapes its Linear
layers produce (a TP rank has n_heads/tp heads; with sequence parallelism the block input
holds a slice of the sequence while attention sees all of it).

Inside, activations are sequence-first, ``(seq, batch, dim)``, as in Megatron-LM: a
sequence shard is then one contiguous block of memory, which sequence parallelism's
all-gather and reduce-scatter (parallel/tensor/comm.py) use in place. Tokens go in and
logits come out batch-first: the token ids are transposed before the lookup (integers, a
view) and the logits are returned as a batch-first view of the sequence-first result.
"""

import dataclasses
import functools
import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer3d.config.schema import ModelConfig, RopeScalingConfig
from trainer3d.model.functional import apply_rotary, rms_norm, swiglu_linear
from trainer3d.model.moe import MoE, ffn_params, moe_layer


class RMSNorm(nn.Module):
    compile_operators: Optional[str] = None
    """The torch.compile backend the elementwise operators run compiled by, None: eager (set from
    outside by parallel/compile.py; also on ``Attention`` and ``FeedForward``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 whatever the activation dtype; keeps x and 1/rms (functional.py).
        return rms_norm(x, self.weight, self.eps, self.compile_operators)


def head_dim_of(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.dim // cfg.n_heads


def llama3_scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScalingConfig) -> torch.Tensor:
    """Llama 3.1's rotary scaling (as Hugging Face transformers defines it:
    ``_compute_llama3_parameters`` in src/transformers/modeling_rope_utils.py, which
    tests/integration/test_hf.py compares against): frequencies whose wavelength exceeds
    original_max_seq_len / low_freq_factor are divided by ``factor``, those shorter than
    original_max_seq_len / high_freq_factor are kept, and in between the two are blended by
    how many turns the frequency makes over the original context."""
    wavelen = 2 * math.pi / inv_freq
    original = scaling.original_max_seq_len
    long_wave, short_wave = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    scaled = torch.where(wavelen > long_wave, inv_freq / scaling.factor, inv_freq)
    blend = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    between = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(between, (1 - blend) * inv_freq / scaling.factor + blend * inv_freq, scaled)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device,
                   scaling: Optional[RopeScalingConfig] = None, positions: Optional[torch.Tensor] = None):
    """cos/sin tables of shape (seq_len, head_dim), computed in fp32, for positions
    0..seq_len-1 or the ``positions`` given (a context-parallel shard's, trainer3d/parallel/context/).

    For positions 0..seq_len-1 the tables are computed once per (seq_len, head_dim, theta,
    scaling, device) and kept outside the model (``_cached_tables``; Megatron-core keeps its
    own under ``functools.lru_cache``: megatron/core/models/common/embeddings/
    rotary_pos_embedding.py): the model holds no buffers that meta-device construction would
    have to re-materialise. Each call returns its own copy of them, as computing them did:
    ``apply_rotary`` saves the tables for backward, and the saved-activation accounting counts
    them per block and micro-batch (trainer3d/memory/activations.py ``rope_tables``, held to
    what ``saved_tensors_hooks`` sees by tests/multirank/test_activation_memory.py); no caller
    can reach the kept ones. Computed as before, not kept, for given positions, inside
    torch.compile's tracing (the graph computes them) and under a dispatch mode (one that
    counts or fakes operators sees every one: trainer3d/plan/kernels.py ``block_ops``).
    """
    if positions is None and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack():
        key = None if scaling is None or scaling.type != "llama3" else tuple(getattr(scaling, f.name) for f in dataclasses.fields(scaling))
        cos, sin = _cached_tables(seq_len, head_dim, theta, device, key)
        return cos.clone(), sin.clone()
    return _tables(seq_len, head_dim, theta, device, scaling, positions)


def _tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
            scaling: Optional[RopeScalingConfig], positions: Optional[torch.Tensor]):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is not None and scaling.type == "llama3":
        inv_freq = llama3_scaled_frequencies(inv_freq, scaling)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@functools.lru_cache(maxsize=16)
def _cached_tables(seq_len: int, head_dim: int, theta: float, device: torch.device, scaling: Optional[tuple]):
    """The tables ``rotary_cos_sin`` copies, by what they depend on (``scaling``: the llama3
    scaling's fields in their order; None without it)."""
    return _tables(seq_len, head_dim, theta, device, None if scaling is None else RopeScalingConfig(*scaling), None)


LOW_PRECISION = (torch.float16, torch.bfloat16)


def kv_expanded(device_type: str, dtype: torch.dtype, heads: int, kv_heads: int) -> bool:
    """Whether grouped-query attention repeats K and V to every query head before SDPA.

    On CUDA, SDPA's grouped-query mode (``enable_gqa``) runs in its flash kernel and in the math
    composite only (torch 2.13's own ``scaled_dot_product_attention`` docstring, "Constraints for
    GQA"; the backend choice, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
    ``select_sdp_backend``), and flash takes fp16/bf16 alone: fp32 with fewer kv heads than
    query heads falls to the math composite, which holds the seq x seq scores in fp32 per head
    (8 GiB a layer for 32 heads at 8k tokens, one sequence). With K and V repeated, the
    memory-efficient kernel takes it (fp32 on every GPU it supports) at the cost of K and V at
    the query heads' width, linear in seq. On CPU torch's flash kernel takes grouped K/V in
    every dtype."""
    return device_type == "cuda" and heads != kv_heads and dtype not in LOW_PRECISION


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, seq, head_dim) -> (batch, heads, seq, head_dim): query head i reads kv
    head i // (heads / kv_heads), the grouping ``enable_gqa`` applies (Ainslie et al. 2023)."""
    b, kv, s, d = t.shape
    return t[:, :, None].expand(b, kv, heads // kv, s, d).reshape(b, heads, s, d)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand_kv: bool) -> torch.Tensor:
    """Causal SDPA with grouped K/V taken as they are, or repeated to every head (``kv_expanded``)."""
    heads = q.shape[1]
    if expand_kv:
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != heads)


class CausalAttention(nn.Module):
    """Causal attention over a sequence held whole: positions 0..seq-1, torch's fused kernel.

    The one part of attention that reads other tokens. Context parallelism, where a rank holds
    only chunks of the sequence, replaces it with its own (trainer3d/parallel/context/apply.py)."""

    def positions(self, seq: int, device: torch.device) -> Optional[torch.Tensor]:
        """The positions of the tokens held (None: 0..seq-1)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim)."""
        return causal_sdpa(q, k, v, kv_expanded(q.device.type, q.dtype, q.shape[1], k.shape[1]))


def rotate_per_token(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, attn: "Attention"):
    """q and k (seq, batch, heads, head_dim) rotated by (batch, seq) positions, each sequence its
    own (document masking, model/documents.py): the tables get one row per token, seq-major as
    q and k hold them, and the rotation sees (seq x batch) rows of one sequence each."""
    seq, batch = q.shape[:2]
    cos, sin = rotary_cos_sin(seq * batch, attn.head_dim, attn.rope_theta, q.device, attn.rope_scaling,
                              positions.t().reshape(-1))
    rows = [t.reshape(seq * batch, 1, *t.shape[2:]) for t in (q, k)]
    return tuple(apply_rotary(r, cos, sin, attn.compile_operators).view(t.shape) for r, t in zip(rows, (q, k)))


class Attention(nn.Module):
    compile_operators: Optional[str] = None  # as RMSNorm's

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.core = CausalAttention()
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        seq, batch = q.shape[:2]  # the projections' shapes, not x's (see module docstring)
        q = q.view(seq, batch, -1, self.head_dim)
        k = k.view(seq, batch, -1, self.head_dim)
        v = v.view(seq, batch, -1, self.head_dim)
        positions = self.core.positions(seq, x.device)
        if positions is not None and positions.dim() == 2:
            q, k = rotate_per_token(q, k, positions, self)
        else:
            cos, sin = rotary_cos_sin(seq, self.head_dim, self.rope_theta, x.device, self.rope_scaling, positions)
            q, k = (apply_rotary(t, cos, sin, self.compile_operators) for t in (q, k))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # views (batch, heads, seq, head_dim)
        out = self.core(q, k, v)
        # Back to (seq, batch, heads x head_dim): a view where the kernel writes its output in
        # q's memory order (torch's CPU flash kernel does), else one copy.
        return self.wo(out.permute(2, 0, 1, 3).reshape(seq, batch, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). w2's matmul runs inside ``swiglu_linear``, which
    keeps w1 x and w3 x and recomputes the product for w2's weight gradient; a w2 that
    sums partial products over ranks (a row-parallel one, parallel/tensor/layers.py) does
    it in its ``reduce``, which its own forward calls after the same matmul."""

    compile_operators: Optional[str] = None  # as RMSNorm's

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w1(x), self.w3(x)
        if _is_dtensor(self.w2.weight):  # torch's own tensor parallelism: w2's hooks shard and reduce
            return self.w2(F.silu(a) * b)
        out = swiglu_linear(a, b, self.w2.weight, self.compile_operators)
        reduce = getattr(self.w2, "reduce", None)
        return reduce(out) if reduce is not None else out


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing torch.distributed.tensor: that import
    pulls sympy (about a second of CPU in every process that imports the model), and no tensor
    can be a DTensor before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class Block(nn.Module):
    """Attention and a feed-forward, each behind its norm; the feed-forward is the dense
    SwiGLU or, for the blocks ``model.moe`` picks (model/moe.py ``moe_layer``), a mixture of experts."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if moe_layer(cfg, index) else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(rows, dim)``; on the meta device without its N(0, 1) draw, which makes no
    values there and whose meta implementation (``torch._refs.normal``, behind
    ``torch._disable_dynamo``) imports torch._dynamo: seconds of CPU in every process that
    builds a meta model (every rank, the launcher's memory estimate, the planner). A meta draw
    leaves the random generators untouched, so a built model's values are the same."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab), a view of sequence-first memory; with
    ``head_in_loss`` the hidden states the head would read, sequence-first (seq, batch, dim).

    A pipeline stage keeps a subset: after the first stage (``embeds_tokens`` False) it takes
    hidden states, without ``output`` it returns them, both sequence-first (seq, batch, dim)
    (a sequence shard of them under sequence parallelism). Layers live in a ModuleDict keyed by
    their global index, so parameter names (``layers.7.attention.wq.weight``) are the same in
    every layout — checkpoints and the layout-independent initialisation rely on it.

    Tied embeddings: ``output.weight`` is the ``tok_embeddings.weight`` Parameter itself, so
    it is listed once, under the embedding's name. A last pipeline stage keeps its own
    ``tok_embeddings`` (not looked up, only the head's weight): a copy kept equal to the first
    stage's by summing their gradients (trainer3d/parallel/tied.py), named like it too.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embeds_tokens = True
        self.tok_embeddings = _embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.head_in_loss = False
        """Return the final norm's output, the loss applying ``output`` to it chunk by chunk
        (parallel/tensor/loss.py's ``chunked_head_loss``; set by ``build_loss_fn``)."""
        self.tie_weights()

    def tie_weights(self) -> None:
        """Point the head at the embedding matrix (tied models holding both; idempotent)."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # Conversions that make new Parameters (``to_empty`` from meta) replace each module's
        # reference separately, which would untie the head from the embedding.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x.t()) if self.embeds_tokens else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or self.head_in_loss:
            return h
        return self.output(h).transpose(0, 1)


def token_rows(logits: torch.Tensor, targets: torch.Tensor):
    """(batch, seq, vocab) logits and (batch, seq) targets as (tokens, vocab) and (tokens,),
    the tokens in the logits' memory order: sequence-major for the model's logits (a view,
    only the integer targets are copied), batch-major for contiguous ones. A mean over
    tokens does not depend on their order."""
    if not logits.is_contiguous() and logits.transpose(0, 1).is_contiguous():
        logits, targets = logits.transpose(0, 1), targets.transpose(0, 1)
    return logits.flatten(0, 1), targets.flatten(0, 1)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32."""
    logits, targets = token_rows(logits, targets)
    return F.cross_entropy(logits.float(), targets)


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full (1-rank, unpadded) model, from its shapes alone (a tied
    embedding counted once; every expert of an MoE block)."""
    attn = cfg.dim * head_dim_of(cfg) * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    layers = sum(attn + ffn_params(cfg, i) + 2 * cfg.dim for i in range(cfg.n_layers))
    embeddings = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.dim
    return layers + embeddings + cfg.dim


def output_projection_std(cfg: ModelConfig) -> float:
    """Residual-branch output projections start smaller (GPT-2, Radford et al. 2019, sec. 2.3)."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)
