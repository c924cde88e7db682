"""Activation memory: what one micro-batch leaves saved for backward, term by term (how many
micro-batches a pipeline stage holds at once is trainer3d/memory/in_flight.py).

Saved activations are the tensors autograd keeps from forward to backward, each storage
counted once (views share it); ``trainer3d/memory/meter.py`` measures exactly
these with ``torch.autograd.graph.saved_tensors_hooks`` and tests/multirank/test_activation_memory.py
holds this file to the measurement, stage by stage, through the real pipeline. The
derivation, next to Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2: 34sbh + 5as^2b per layer for GPT), is docs/memory.md. In
their notation: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree;
here also h_kv = kv-heads x head_dim, f = FFN width, V = vocabulary, p = bytes of an
activation (4 fp32, 2 bf16/fp16). With context parallelism s is a cp rank's tokens,
seq_len / cp: every term below is per token except none, so each divides by cp (the cp
attention saves what the flash kernel saves, trainer3d/parallel/context/attention.py).
Per layer, with the flash kernel:

    norms         2 x (p sbh + 4sb)          input (activation dtype), 1/rms (each /t with SP)
    inputs        2 x p sbh                  what wq/wk/wv and w1/w3 read (/t with SP: the shard,
                                             gathered again in backward: parallel/tensor/sequence.py)
    attention     p sb (2h + 2h_kv)/t + 4asb/t   q, k, v after RoPE, output, log-sum-exp
                                             (fp32 grouped-query attention on CUDA: k and v
                                             repeated to every head, 2h for 2h_kv, and the
                                             memory-efficient kernel's log-sum-exp rows padded
                                             to a multiple of 32: model/transformer.py kv_expanded)
    SwiGLU        2 p sbf/t                  w1 x and w3 x (silu and the product are recomputed)
    RoPE tables   8 s head_dim               cos and sin, fp32 (8 sb head_dim with data.document_mask:
                                             each sequence its own positions); each block's own
                                             copy of the kept tables (model/transformer.py
                                             rotary_cos_sin), so one per block and micro-batch

(the norm, RoPE and SwiGLU are autograd Functions that save no more: model/functional.py).
A mixture-of-experts block replaces the SwiGLU term by its own (``moe_layer_terms``: the router,
the tokens sorted by expert, the experts' projections per routed slot, the combine;
trainer3d/memory/moe.py derives each).

The math kernel keeps the attention probabilities instead (the paper's 5as^2b is our
p as^2b/t) and 4 p sbh/t of copies of q, k, v and the output; activation checkpointing keeps only the block input
(p sbh, /t with SP) and recomputes the rest in backward (trainer3d/parallel/recompute.py).
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.memory.moe import MoESizes, moe_ffn_terms
from trainer3d.model.transformer import head_dim_of, kv_expanded

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ATTENTION_KERNELS = ("flash", "math")
INT64, FP32 = 8, 4


def config_on_cuda(cfg: Config) -> bool:
    """Whether the config itself puts the ranks on CUDA (launcher.gpus_per_node, train.device=cuda,
    parallel.backend=nccl); ``train.device=auto`` is CUDA only where a GPU is visible, which the
    caller knows (trainer3d/preflight/memory_check.py passes it)."""
    return cfg.launcher.gpus_per_node > 0 or cfg.train.device == "cuda" or cfg.parallel.backend == "nccl"


def head_dim(model: ModelConfig) -> int:
    """The width of one attention head (the one place the formulas read it: the model's own rule)."""
    return head_dim_of(model)


@dataclass(frozen=True)
class Sizes:
    """What one micro-batch's activations on one tensor-parallel rank depend on."""

    b: int
    """Micro-batch size (sequences)."""
    s: int
    h: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    t: int
    sp: bool
    p: int
    """Bytes per activation element (train.dtype)."""
    kernel: str = "flash"
    """Which SDPA kernel runs: flash (CPU fp32/bf16, CUDA flash/memory-efficient) or math."""
    cp: int = 1
    """Context-parallel degree (``s`` is already this cp rank's share of the sequence)."""
    loss_chunk: int = 0
    """Tokens per chunk of the loss that applies the head itself (train.loss_chunk_tokens);
    0: the model's whole logits go to the loss."""
    documents: bool = False
    """data.document_mask: RoPE tables per token, and the mask (model/documents.py)."""
    loss_mask: bool = False
    """data.loss_mask: the whole-logits loss keeps each target's local index and mask, at any tp
    (parallel/tensor/loss.py), and no view of the step's targets."""
    cuda: bool = False
    """The ranks run on CUDA: fp32 attention runs torch's memory-efficient kernel there, and
    grouped K/V are repeated to every head for it (model/transformer.py ``kv_expanded``)."""
    moe: Optional[MoESizes] = None
    """A mixture-of-experts model's MoE blocks (trainer3d/memory/moe.py); None: dense."""

    @classmethod
    def of(cls, cfg: Config, kernel: str = "flash", cuda: Optional[bool] = None) -> "Sizes":
        """``cuda``: whether the ranks run on CUDA (None: as the config says, ``config_on_cuda``)."""
        m, p = cfg.model, cfg.parallel
        return cls(b=cfg.train.micro_batch_size, s=cfg.train.seq_len // p.cp, h=m.dim, heads=m.n_heads,
                   kv_heads=m.n_kv_heads, head_dim=head_dim(m), ffn=m.ffn_dim, vocab=m.vocab_size, t=p.tp,
                   sp=p.sequence_parallel, p=ACT_BYTES[cfg.train.dtype], kernel="flash" if p.cp > 1 else kernel,
                   cp=p.cp, loss_chunk=cfg.train.loss_chunk_tokens, documents=cfg.data.document_mask,
                   loss_mask=cfg.data.loss_mask, moe=MoESizes.of(cfg),
                   cuda=config_on_cuda(cfg) if cuda is None else cuda)

    @property
    def expand_kv(self) -> bool:
        """Grouped K/V repeated to every query head before SDPA (the model's own rule); the
        cp attention saves its shard's K/V as they are (parallel/context/attention.py)."""
        dtype = torch.float32 if self.p == 4 else torch.bfloat16
        if self.documents and self.cuda:  # FlexAttention takes grouped K/V as they are
            return False
        return self.cp == 1 and kv_expanded("cuda" if self.cuda else "cpu", dtype, self.heads, self.kv_heads)

    @property
    def lse_rows(self) -> int:
        """Log-sum-exp entries per head of a micro-batch: one per query, padded to a multiple of 32
        per sequence in CUDA's memory-efficient kernel (fp32; its ``kAlignLSE``,
        aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h)."""
        if self.cuda and self.p == 4 and self.cp == 1 and not self.documents:  # cp and Flex: unpadded
            return self.b * -(-self.s // 32) * 32
        return self.n

    @property
    def n(self) -> int:
        """Tokens of the micro-batch (s b)."""
        return self.b * self.s

    @property
    def n_norm(self) -> int:
        """Tokens in a norm region on this rank: all of them, or 1/t under sequence parallelism."""
        return self.n // self.t if self.sp else self.n

    @property
    def vocab_local(self) -> int:
        """Logit columns per tp rank: the vocabulary padded to a multiple of t, over t."""
        return -(-self.vocab // self.t)

    def hidden_bytes(self) -> int:
        """One hidden state between blocks (a pipeline hand-over): p sbh, /t with SP."""
        return self.p * self.n_norm * self.h


def _norm(z: Sizes) -> int:
    """RMSNorm (model/functional.py's ``rms_norm``): its input, in the activation dtype (the
    residual stream's own storage), and 1/rms in fp32."""
    return z.p * z.n_norm * z.h + FP32 * z.n_norm


def _attention(z: Sizes) -> Dict[str, int]:
    local_heads, local_kv = z.heads // z.t, z.kv_heads // z.t
    q = z.p * z.n * local_heads * z.head_dim       # one tensor shaped like q (or like SDPA's output)
    kv = q if z.expand_kv else z.p * z.n * local_kv * z.head_dim
    if z.kernel == "flash":
        # SDPA's inputs (q and k after RoPE, v: repeated to every head where kv_expanded), its
        # output (which wo reads through a view) and the log-sum-exp per query and head
        terms = {"q_k_v": q + 2 * kv, "attention": q + FP32 * z.lse_rows * local_heads}
    elif z.kernel == "math":
        # the composite keeps its own contiguous copies instead of the inputs: scaled q,
        # k^T and v (expanded to every query head), the probabilities, and the output copy wo reads
        terms = {"attention": 4 * q + z.p * local_heads * z.s * z.s * z.b}
    else:
        raise ValueError(f"attention kernel {z.kernel!r}: one of {ATTENTION_KERNELS}")
    return terms


def layer_terms(z: Sizes) -> Dict[str, int]:
    """Saved bytes of one transformer block for one micro-batch (no recomputation)."""
    return {
        "attention_norm": _norm(z),
        "attention_input": z.p * z.n_norm * z.h,
        "rope_tables": 2 * FP32 * z.s * z.head_dim * (z.b if z.documents else 1),  # per token with documents
        **_attention(z),
        "ffn_norm": _norm(z),
        "ffn_input": z.p * z.n_norm * z.h,
        "swiglu": 2 * z.p * z.n * (z.ffn // z.t),
    }


def moe_layer_terms(z: Sizes, worst: bool = False) -> Dict[str, int]:
    """An MoE block: the dense block's terms with its SwiGLU replaced by the mixture of experts
    over the tokens the block routes on this rank (trainer3d/memory/moe.py); ``worst``: with
    ep > 1, the dropless worst case of the slots its experts receive."""
    terms = {name: value for name, value in layer_terms(z).items() if name != "swiglu"}
    terms.update({f"moe.{name}": value for name, value in moe_ffn_terms(z.moe, z.n_norm, z.p, z.h, worst).items()})
    return terms


def recomputed_layer_terms(z: Sizes) -> Dict[str, int]:
    """With activation checkpointing a block keeps its input alone."""
    return {"block_input": z.hidden_bytes()}


def embedding_terms(z: Sizes) -> Dict[str, int]:
    """The first stage's lookup. tp = 1: the token ids it indexes with (a view of the step's
    batch, counted per step: ``shared_terms``); tp > 1: this rank's shifted ids and mask."""
    return {} if z.t == 1 else {"embedding_ids": INT64 * z.n + z.n}


def _targets_copied(z: Sizes) -> bool:
    """Whether the loss reads a copy of the targets: it takes them in the logits' token order,
    sequence-major (``token_rows`` in model/transformer.py), a copy of the batch-first
    targets unless the micro-batch is a single sequence (then both orders are one)."""
    return z.b > 1


def head_terms(z: Sizes) -> Dict[str, int]:
    """The last stage: the final norm, then

    - the chunked loss (``loss_chunk`` > 0): the gradients it computes in forward, w.r.t. the
      hidden states (all tokens: the gathered sequence under SP) and the head's weight (this
      rank's padded vocabulary rows), both in the activation dtype; the logits exist one
      chunk at a time and are not kept (``loss_transient_bytes``);
    - whole logits: the head's input (the shard under SP) and the loss's one fp32 buffer, the softmax over this
      rank's vocabulary columns (padding columns included: parallel/tensor/loss.py), with at
      tp > 1 or under a loss mask the targets' local index and mask; else the targets themselves, in token
      order (``_targets_copied``; else a view of the step's batch: ``shared_terms``)."""
    if z.loss_chunk:
        return {"final_norm": _norm(z), "loss": z.p * z.n * z.h + z.p * z.vocab_local * z.h}
    if z.t > 1 or z.loss_mask:
        targets = INT64 * z.n + z.n
    else:
        targets = INT64 * z.n if _targets_copied(z) else 0
    loss = FP32 * z.n * z.vocab_local + targets
    return {"final_norm": _norm(z), "head_input": z.p * z.n_norm * z.h, "loss": loss}


def shared_terms(z: Sizes, micro_batches: int, first: bool, last: bool, pp: int) -> Dict[str, int]:
    """Saved per step, not per micro-batch: with tp = 1 the embedding (and the loss, when it
    reads the targets uncopied) keep views of the step's token batch. Without a pipeline,
    inputs and targets are two views of one (micro_batches, b, s + 1) tensor; in a pipeline
    the first stage reads the inputs and the last the targets, each a (micro_batches, b, s)
    tensor (trainer3d/data/loader.py), as are a cp rank's inputs and targets (its two chunks
    of each, copied out); the chunked loss keeps no targets."""
    if z.t > 1:
        return {}
    if pp == 1 and z.cp == 1:
        return {"token_batch": INT64 * micro_batches * z.b * (z.s + 1)}
    uses = int(first) + int(last and not z.loss_chunk and not _targets_copied(z) and not z.loss_mask)
    return {"token_batch": uses * INT64 * micro_batches * z.n} if uses else {}


def loss_transient_bytes(z: Sizes) -> int:
    """The chunked loss's working set in forward (parallel/tensor/loss.py): one chunk's logits
    (activation dtype; their gradient is written back over them), their fp32 exponentials
    (16-bit activations; fp32 ones are exponentiated in place), the fp32 sum of the head's
    gradient and one chunk's share of it in the activation dtype."""
    rows = min(z.loss_chunk, z.n)
    exp = FP32 if z.p != FP32 else 0
    return (z.p + exp) * rows * z.vocab_local + (FP32 + z.p) * z.vocab_local * z.h


def chunk_terms(z: Sizes, n_layers: int, first: bool, last: bool, recompute: bool, moe_layers: int = 0,
                worst: bool = False) -> Dict[str, int]:
    """Saved bytes of one micro-batch through one pipeline chunk of ``n_layers`` blocks, of
    which ``moe_layers`` are mixtures of experts, term by term."""
    if recompute:
        kinds = [(recomputed_layer_terms(z), n_layers)]
    else:
        kinds = [(layer_terms(z), n_layers - moe_layers), (moe_layer_terms(z, worst) if moe_layers else {}, moe_layers)]
    terms: Dict[str, int] = {}
    for layer, count in kinds:
        for name, value in layer.items():
            if count:
                terms[f"layers.{name}"] = terms.get(f"layers.{name}", 0) + count * value
    if first:
        terms.update(embedding_terms(z))
    if last:
        terms.update(head_terms(z))
    if z.documents and not recompute:
        terms.update(document_mask_terms(z))
    return terms


FLEX_BLOCK = 128
"""FlexAttention's default block (torch/nn/attention/flex_attention.py ``_DEFAULT_SPARSE_BLOCK_SIZE``)."""


def document_mask_terms(z: Sizes) -> Dict[str, int]:
    """The document mask a micro-batch's blocks save, once per chunk (one tensor every block
    reads, model/documents.py): on CPU the dense additive mask, b s^2 in the activation dtype;
    on CUDA FlexAttention's block mask, int32 block counts and indices of its partial and full
    blocks, both directions: 4 x 4 b nb (nb + 1) bytes for nb = ceil(s / 128) blocks. Under
    context parallelism no mask is kept: the blocks' cp attention saves the whole window's
    int32 document ids, 4 b s cp bytes (parallel/context/documents.py builds each chunk pair's
    mask as it computes it: ``cp_document_pair_bytes``). Under recomputation the blocks save
    nothing of it (the mask or ids are then one micro-batch's transient)."""
    if z.cp > 1:
        return {"document_ids": FP32 * z.b * z.s * z.cp}
    if z.cuda:
        nb = -(-z.s // FLEX_BLOCK)
        return {"document_mask": 4 * 4 * z.b * nb * (nb + 1)}
    return {"document_mask": z.p * z.b * z.s * z.s}


CP_TILE = 1024
"""Query rows per tile of the cp attention's plain-torch kernel (parallel/context/kernels.py ``TILE``)."""


def cp_document_pair_bytes(z: Sizes) -> int:
    """The working set of one document-masked chunk pair under cp (parallel/context/documents.py,
    on the plain-torch kernel, a tile of query rows at a time): a tile's boolean mask and up
    to four fp32 tensors of its scores per head (scores, masked scores, probabilities and
    their gradient in backward), for chunk = s / 2 tokens. A transient, freed after each tile."""
    chunk = z.s // 2
    rows = min(CP_TILE, chunk)
    return z.b * rows * chunk * (1 + 4 * FP32 * (z.heads // z.t))
