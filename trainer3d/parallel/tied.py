"""Tied input/output embeddings across pipeline stages (pp > 1).

With tied embeddings the first stage looks tokens up in the embedding matrix and the last
stage multiplies by it in the head, so with a pipeline each holds a copy, both named
``tok_embeddings.weight`` (parallel/pipeline/stages.py). They start equal (the parameter source
gives both the same values) and stay equal: every step, after the dp reduction and before
clipping, the two copies' gradients are summed, so both take the same update, and the sum
is what one process's shared Parameter accumulates. Megatron-LM does the same over its
"embedding group" (``_allreduce_embedding_grads`` in
megatron/core/distributed/finalize_model_grads.py).

``TiedEmbedding`` (called by trainer3d/parallel/finalize.py) sums what the optimizer steps
from (``optimizer.grad(param)``):

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

A V schedule (``zbv``, ``dualpipev``: parallel/pipeline/placement.py) puts the first and the
last stage on pp rank 0, so there is no second rank to sum with: ``share_embedding`` points the
last chunk's head at the first chunk's embedding module, one Parameter as in a one-process
tied model. Both stages' backwards (and W steps) accumulate into its one ``.grad``; the ZeRO
buffers hold it once and its bucket waits for both stages' micro-batches (parallel/zero/
flat.py); it is in no embedding group (parallel/topology.py) and no copy.
"""

from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.model.init import canonical_name
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.parallel.topology import ParallelDims

TIED = "tok_embeddings.weight"


def share_embedding(chunks: List[nn.Module]) -> None:
    """Make every later chunk of this rank that holds the embedding (as its tied head's weight)
    use the first one's module itself; a no-op unless two chunks hold it (a V's pp rank 0)."""
    holders = [c for c in chunks if getattr(c, "tok_embeddings", None) is not None]
    for chunk in holders[1:]:
        chunk.tok_embeddings = holders[0].tok_embeddings
        chunk.tie_weights()


def is_tied_copy(name: str, dims: ParallelDims) -> bool:
    """The last stage's copy of a tied embedding: an embedding held off the first pp rank."""
    return name == TIED and dims.pp_rank != 0


def drop_tied_copies(state: Dict[str, object], dims: ParallelDims) -> Dict[str, object]:
    """A checkpoint state dict without this rank's tied copy (``model.``/``optim.*.`` keys):
    the first stage writes the embedding and its optimizer state once."""
    if dims.pp_rank == 0:
        return state
    return {k: v for k, v in state.items() if not k.endswith("." + TIED)}


class TiedEmbedding:
    """This rank's copy of a tied embedding held on both ends of a pipeline, and the sum of
    the two copies' gradients (after the dp reduction, before clipping)."""

    def __init__(self, param: nn.Parameter, optimizer: ZeroOptimizer, dims: ParallelDims):
        self.param, self.optimizer, self.dims = param, optimizer, dims
        self.owned = optimizer.owned_ranges(param)
        """The ranges of the flattened gradient whose update this rank owns (all of it unless
        the optimizer shards its state over dp)."""
        self.sharded = optimizer.shards_state and dims.dp_cp > 1

    @classmethod
    def find(cls, chunks: Iterable[nn.Module], optimizer: ZeroOptimizer, dims: ParallelDims) -> Optional["TiedEmbedding"]:
        """None without tied embeddings across stages (no ``dims.embedding_group``)."""
        if dims.embedding_group is None:
            return None
        param = next(p for chunk in chunks for n, p in chunk.named_parameters() if canonical_name(n) == TIED)
        return cls(param, optimizer, dims)

    def sum_gradients(self) -> None:
        grad = self.optimizer.grad(self.param).view(-1)
        if not self.sharded:
            dist.all_reduce(grad, group=self.dims.embedding_group)
            return
        owned = torch.zeros_like(grad)
        for lo, hi in self.owned:
            owned[lo:hi] = grad[lo:hi]
        dist.all_reduce(owned, group=self.dims.embedding_dp_group)
        grad.copy_(owned)
