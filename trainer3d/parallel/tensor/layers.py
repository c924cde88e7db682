"""Tensor parallelism, Megatron-style, on plain tensors.

Shoeybi et al. 2019 ("Megatron-LM", sec. 3): in each block, attention is split by heads
and the MLP by its hidden width, so a block costs one all-reduce forward and one backward
per sub-layer. ``apply_tensor_parallel`` swaps the model's Linear/Embedding layers for the
sharded ones below; the model code (model/transformer.py) does not change, it reads head
counts from its projections' output shapes.

    attention:  wq, wk, wv  column-parallel (heads / kv-heads split, GQA groups stay whole)
                wo          row-parallel
    SwiGLU:     w1, w3      column-parallel (FFN width split)
                w2          row-parallel
    tok_embeddings          vocabulary-parallel (rows split; padded to a multiple of tp)
    output                  column-parallel over the padded vocabulary, never gathered:
                            the loss is vocabulary-parallel (loss.py)
    norms                   replicated

The communication that opens a column-parallel region is done once per module (a forward
pre-hook on ``attention`` / ``feed_forward``), not once per projection: wq, wk and wv share
one input, so their input gradients are summed locally and reduced once.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): between blocks the hidden state
is sharded along the sequence, so norms and residual adds run on 1/tp of the tokens; a
region opens with an all-gather instead of an identity and closes with a reduce-scatter
instead of an all-reduce (same bytes on the wire, 1/tp of the activations kept); the
projections behind the all-gather keep the shard and gather it again in backward
(sequence.py). The norm
weights then see only their shard's tokens: trainer3d/parallel/finalize.py sums their
gradients over tp.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.init import mark_tp_shard
from trainer3d.model.moe import MoE
from trainer3d.parallel.tensor.comm import ENTER, LEAVE
from trainer3d.parallel.tensor.sequence import SequenceParallelEntry, gathered_linears
from trainer3d.parallel.wgrad import linear
from trainer3d.parallel.topology import ParallelDims


def padded_size(full: int, tp: int) -> int:
    """``full`` rounded up to a multiple of ``tp`` (the vocabulary; everything else divides)."""
    return -(-full // tp) * tp


class _TPShardedModule(nn.Module):
    """A layer whose parameters are tp shards, described by ``mark_tp_shard``.

    ``Module.to_empty`` (meta -> a device) replaces each Parameter object, dropping its
    attributes, so the marks are put back after every conversion: the layout-independent
    init and the optimizer's gradient-norm count read them after materialisation.
    """

    def __init__(self, dims: ParallelDims):
        super().__init__()
        self.tp_group = dims.tp_group
        self.tp_rank = dims.tp_rank
        self.tp_size = dims.tp
        self._shards: Dict[str, Tuple[int, int]] = {}  # parameter name -> (dim, full length)

    def _shard(self, name: str, shape: List[int], dim: int, full: int, device, dtype) -> None:
        self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self._shards[name] = (dim, full)
        self._mark()

    def _mark(self) -> None:
        for name, (dim, full) in self._shards.items():
            mark_tp_shard(getattr(self, name), dim, self.tp_rank, self.tp_size, full)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._mark()
        return self


class ColumnParallelLinear(_TPShardedModule):
    """y_r = x A_r^T with A split along its output features: rank r holds rows
    [r * out/tp, (r + 1) * out/tp) (the last rank's tail is padding when tp does not divide).

    ``input_comm``: "copy" (replicated input), "gather" (sequence-sharded input, sequence
    parallelism) or None (the caller already entered the region, see ``enter_tp_region``).
    The output stays sharded along its last dim.
    """

    def __init__(self, in_features: int, out_features: int, dims: ParallelDims, input_comm: Optional[str] = "copy",
                 device=None, dtype=None):
        super().__init__(dims)
        self.in_features, self.out_features = in_features, out_features
        self.input_comm = input_comm
        self.entered: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        """(sequence shard, this projection's output) set by a ``SequenceParallelEntry``."""
        local = padded_size(out_features, self.tp_size) // self.tp_size
        self._shard("weight", [local, in_features], 0, out_features, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entered is not None:
            return self.take_entered(x)
        if self.input_comm == "gather" and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return gathered_linears(x, [self.weight], self.tp_group)[0]  # keeps the shard (sequence.py)
        if self.input_comm is not None:
            x = ENTER[self.input_comm](x, self.tp_group)
        return linear(x, self.weight)

    def take_entered(self, x: torch.Tensor) -> torch.Tensor:
        """The output its module's ``SequenceParallelEntry`` computed from ``x``, handed over once."""
        shard, out = self.entered
        self.entered = None
        if shard is not x:
            raise RuntimeError(f"{self}: called on another input than its region was entered with")
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}/{self.tp_size}, input_comm={self.input_comm}"


class RowParallelLinear(_TPShardedModule):
    """y = sum_r x_r B_r^T with B split along its input features (x arrives split the same
    way, from a column-parallel layer). ``output_comm``: "all_reduce", or "reduce_scatter"
    (the sum lands sequence-sharded, sequence parallelism)."""

    def __init__(self, in_features: int, out_features: int, dims: ParallelDims, output_comm: str = "all_reduce",
                 device=None, dtype=None):
        super().__init__(dims)
        if in_features % self.tp_size:
            raise ValueError(f"row-parallel input width {in_features} is not divisible by tp={self.tp_size}")
        self.in_features, self.out_features = in_features, out_features
        self.output_comm = output_comm
        self._shard("weight", [out_features, in_features // self.tp_size], 1, in_features, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over tp of each rank's x_r B_r^T (also called by the model's SwiGLU,
        which computes w2's matmul itself: model/functional.py)."""
        return LEAVE[self.output_comm](partial, self.tp_group)

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.tp_size}, out={self.out_features}, output_comm={self.output_comm}"


class VocabParallelEmbedding(_TPShardedModule):
    """Rank r holds embedding rows [r * V'/tp, (r + 1) * V'/tp) of the vocabulary padded to
    V' (a multiple of tp). A token outside this range contributes zeros here; the sum over
    ranks ("all_reduce", or "reduce_scatter" into sequence shards) is the full lookup.
    Padding rows are never looked up (tokens < V), so their gradient is always zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dims: ParallelDims,
                 output_comm: str = "all_reduce", device=None, dtype=None):
        super().__init__(dims)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.output_comm = output_comm
        self.rows = padded_size(num_embeddings, self.tp_size) // self.tp_size
        self.row_start = self.tp_rank * self.rows
        self._shard("weight", [self.rows, embedding_dim], 0, num_embeddings, device, dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.row_start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)  # also zeroes row 0's gradient from outside tokens
        return LEAVE[self.output_comm](h, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (rows {self.row_start}..{self.row_start + self.rows - 1}), {self.embedding_dim}"


class enter_tp_region:
    """Forward pre-hook that opens a module's column-parallel region once for all of its
    column-parallel projections (``copy`` or sequence ``gather`` of the module's input)."""

    def __init__(self, comm: str, group):
        self.comm, self.group = comm, group

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (ENTER[self.comm](args[0], self.group), *args[1:])


# ---------------------------------------------------------------------------- parallelize

def _column(linear: nn.Linear, dims: ParallelDims, input_comm: Optional[str], what: str) -> ColumnParallelLinear:
    if linear.bias is not None:
        raise NotImplementedError(f"{what}: tensor-parallel layers with biases")
    if linear.out_features % dims.tp:
        raise ValueError(f"{what} has {linear.out_features} outputs, not divisible by parallel.tp={dims.tp}")
    w = linear.weight
    return ColumnParallelLinear(linear.in_features, linear.out_features, dims, input_comm, w.device, w.dtype)


def _row(linear: nn.Linear, dims: ParallelDims, output_comm: str, what: str) -> RowParallelLinear:
    if linear.bias is not None:
        raise NotImplementedError(f"{what}: tensor-parallel layers with biases")
    w = linear.weight
    return RowParallelLinear(linear.in_features, linear.out_features, dims, output_comm, w.device, w.dtype)


def _entry(comm: str, projections: List[nn.Module], dims: ParallelDims):
    """The pre-hook opening a module's region: the sequence shard kept for backward under
    sequence parallelism (sequence.py), else the copy (f) of the replicated input."""
    if comm == "gather":
        return SequenceParallelEntry(projections, dims.tp_group)
    return enter_tp_region(comm, dims.tp_group)


def _comms(sp: bool) -> Tuple[str, str]:
    """How a region is entered and left: sequence-sharded between blocks, or replicated."""
    return ("gather", "reduce_scatter") if sp else ("copy", "all_reduce")


def parallelize_attention(attn: nn.Module, dims: ParallelDims, sp: bool, name: str = "attention") -> None:
    """wq/wk/wv column-parallel, wo row-parallel: rank r keeps q heads [r H/tp, (r+1) H/tp) and
    kv heads [r KV/tp, (r+1) KV/tp), exactly the kv heads its q heads attend with under GQA."""
    enter, leave = _comms(sp)
    for proj in ("wq", "wk", "wv"):
        setattr(attn, proj, _column(getattr(attn, proj), dims, None, f"{name}.{proj}"))
    attn.wo = _row(attn.wo, dims, leave, f"{name}.wo")
    attn.register_forward_pre_hook(_entry(enter, [attn.wq, attn.wk, attn.wv], dims))


def parallelize_feed_forward(ffn: nn.Module, dims: ParallelDims, sp: bool, name: str = "feed_forward") -> None:
    """SwiGLU split by FFN width: w1, w3 column-parallel (silu(w1 x) * w3 x is elementwise,
    so it stays local), w2 row-parallel."""
    enter, leave = _comms(sp)
    for proj in ("w1", "w3"):
        setattr(ffn, proj, _column(getattr(ffn, proj), dims, None, f"{name}.{proj}"))
    ffn.w2 = _row(ffn.w2, dims, leave, f"{name}.w2")
    ffn.register_forward_pre_hook(_entry(enter, [ffn.w1, ffn.w3], dims))


def apply_tensor_parallel(model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
    """Shard ``model`` (a Transformer or a pipeline stage of one, usually on the meta
    device) over ``dims.tp_group`` in place. New parameters are created on the device and
    dtype of the ones they replace, uninitialised: ``build_model_chunks`` materialises and
    initialises them (each shard = its slice of the 1-rank tensor, padding zero).

    With sequence parallelism the stage's input (when it has no embedding) and output
    (when it has no output layer) are sequence shards ``(seq / tp, batch, dim)``.
    """
    sp = cfg.parallel.sequence_parallel
    if dims.tp == 1:
        return
    layers = getattr(model, "layers", None)
    for name, block in (layers.items() if layers is not None else ()):
        parallelize_attention(block.attention, dims, sp, f"layers.{name}.attention")
        if not isinstance(block.feed_forward, MoE):  # experts stay whole: parallel/expert/tokens.py
            parallelize_feed_forward(block.feed_forward, dims, sp, f"layers.{name}.feed_forward")
    emb = getattr(model, "tok_embeddings", None)
    if emb is not None:
        model.tok_embeddings = VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, dims, _comms(sp)[1],
                                                      emb.weight.device, emb.weight.dtype)
    out = getattr(model, "output", None)
    if out is not None:
        # Not divisibility-checked like the projections: the vocabulary is padded instead.
        model.output = ColumnParallelLinear(out.in_features, out.out_features, dims, _comms(sp)[0],
                                            out.weight.device, out.weight.dtype)
    # A tied head is the embedding matrix again: both split the padded vocabulary by rows,
    # rank r holding rows [r V'/tp, (r+1) V'/tp) of each, so the shards coincide.
    model.tie_weights()
