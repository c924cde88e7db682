"""Tied input/output embeddings across pipeline stages (pp > 1).

With tied embeddings the first stage looks tokens up in the embedding matrix and the last
stage multiplies by it in the head, so with a pipeline each holds a copy, both named
``tok_embeddings.weight`` (parallel/pipeline/stages.py). They start equal (the parameter source
gives both the same values) and stay equal: every step, after the dp reduction and before
clipping, the two copies' gradients are summed, so both take the same update, and the sum
is what one process's shared Parameter accumulates. Megatron-LM does the same over its
"embedding group" (``_allreduce_embedding_grads`` in
megatron/core/distributed/finalize_model_grads.py).

The sum works on what the optimizer steps from (``optimizer.grad(param)``):

- replicated optimizer (ZeRO-0) or dp = 1: every rank holds the whole dp-averaged
  gradient, and the two ends of each (dp, tp) column all-reduce it
  (``dims.embedding_group``);
- ZeRO-1 with dp > 1: each dp rank holds only the part of the gradient it owns, and the two
  stages own different parts (their flat buffers are laid out differently). Every rank puts
  its owned parts into a zero tensor, and one all-reduce over both ends of all dp ranks of
  the tp column (``dims.embedding_dp_group``) counts each element once per stage: every
  rank gets the whole sum (and fp16's unscaling, applied to owned parts only, holds).

Counted once: the global gradient norm skips the last stage's copy (``is_tied_copy``), and
checkpoints store the first stage's copy only (``drop_tied_copies``), under the embedding's
own name, which any layout loads into both copies.
"""

from typing import Dict, Iterable

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.model.init import canonical_name
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.parallel.topology import ParallelDims

TIED = "tok_embeddings.weight"


def is_tied_copy(name: str, dims: ParallelDims) -> bool:
    """The last stage's copy of a tied embedding: an embedding held off the first pp rank."""
    return name == TIED and dims.pp_rank != 0


def drop_tied_copies(state: Dict[str, object], dims: ParallelDims) -> Dict[str, object]:
    """A checkpoint state dict without this rank's tied copy (``model.``/``optim.*.`` keys):
    the first stage writes the embedding and its optimizer state once."""
    if dims.pp_rank == 0:
        return state
    return {k: v for k, v in state.items() if not k.endswith("." + TIED)}


def sum_tied_gradients(chunks: Iterable[nn.Module], optimizer: ZeroOptimizer, dims: ParallelDims,
                       sharded: bool) -> None:
    """Sum the first and last stage's embedding gradients (after the dp reduction); a no-op
    without tied embeddings across stages. ``sharded``: the optimizer is ZeRO-1 (each dp rank
    owns a part of every gradient)."""
    if dims.embedding_group is None:
        return
    param = next(p for chunk in chunks for n, p in chunk.named_parameters() if canonical_name(n) == TIED)
    grad = optimizer.grad(param).view(-1)
    if not sharded or dims.dp_cp == 1:
        dist.all_reduce(grad, group=dims.embedding_group)
        return
    owned = torch.zeros_like(grad)
    for view in optimizer.checkpoint_views():  # the ranges whose optimizer state this rank owns
        if view.name == TIED and "exp_avg" in view.tensors:
            owned[view.start:view.end] = grad[view.start:view.end]
    dist.all_reduce(owned, group=dims.embedding_dp_group)
    grad.copy_(owned)
