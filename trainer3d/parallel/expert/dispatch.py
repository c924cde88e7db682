"""Expert parallelism: each rank of an ep group holds num_experts / ep of a block's routed
experts, and the tokens travel to them and back by all-to-all (GShard, Lepikhin et al. 2021,
sec. 2.2; Megatron-Core's ``MoEAlltoAllTokenDispatcher`` in
megatron/core/transformer/moe/token_dispatcher.py; torchtitan's ``ExpertParallel`` in
torchtitan/distributed/expert_parallel.py).

The MoE block (model/moe.py) sorts its T * top_k slots by expert and calls its ``experts``
with the sorted tokens and the per-expert counts; ``apply_expert_parallel`` puts an
``ExpertParallelExperts`` there, with the same parameter names (so checkpoints and the
initialisation see the 1-rank model's tensors, this rank's slice of dim 0 marked as a
``TPShard`` with ``expert=True``). Its forward, on the ep group:

1. counts: one ``all_to_all_single`` of the (E,) counts, so each rank learns how many tokens
   every peer sends to each of its E / ep local experts (the split sizes of the next call;
   read on the host, the one sync of a block's forward);
2. dispatch: ``all_to_all_single`` of the tokens, arriving grouped by (source, local expert),
   then permuted to (local expert, source): the grouped matmul's order;
3. the local experts' grouped SwiGLU (model/experts.py) over what arrived; an expert
   receiving no token is an empty group;
4. combine: the inverse permutation and the reverse all-to-all, back in the block's order.

Backward is the same two all-to-alls with the split sizes swapped. Under ``train.compile`` all
four steps run eagerly between the block's compiled pieces: step 1 reads the counts on the host,
a data-dependent break dynamo cannot compile through, and the all-to-alls are autograd Functions
over a c10d group, as tensor parallelism's are (parallel/compile.py). ``_Dispatch`` and
``_Combine`` save only the permutation (int64, one per received token) through
``ctx.save_for_backward``, where trainer3d/memory/meter.py sees it.
"""

from typing import List

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.model.experts import grouped_swiglu
from trainer3d.model.init import TPShard
from trainer3d.model.moe import Experts, moe_blocks
from trainer3d.parallel.topology import ParallelDims


def _all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Dispatch(torch.autograd.Function):
    """Rows of x, split ``send`` ways to the ep group, received ``recv`` from it, reordered by ``order``."""

    @staticmethod
    def forward(ctx, x, order, send: List[int], recv: List[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.save_for_backward(order)
        return _all_to_all(x, recv, send, group)[order]

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        unordered = torch.empty_like(grad).index_copy_(0, order, grad)
        return _all_to_all(unordered, ctx.send, ctx.recv, ctx.group), None, None, None, None


class _Combine(torch.autograd.Function):
    """The inverse of ``_Dispatch``: rows put back in arrival order, returned to their senders."""

    @staticmethod
    def forward(ctx, y, order, send: List[int], recv: List[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.save_for_backward(order)
        unordered = torch.empty_like(y).index_copy_(0, order, y)
        return _all_to_all(unordered, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group)[order], None, None, None, None


def arrival_order(received: torch.Tensor) -> torch.Tensor:
    """received (ep, L): tokens from each source for each local expert, arriving source-major.
    The permutation that takes the arrived rows to expert-major order (expert, then source)."""
    sizes = received.reshape(-1)
    starts = (sizes.cumsum(0) - sizes).view_as(received).t().reshape(-1)  # each block's arrival start
    sizes_t = received.t().reshape(-1)
    out_starts = sizes_t.cumsum(0) - sizes_t
    total = int(sizes.sum())
    shift = torch.repeat_interleave(starts - out_starts, sizes_t, output_size=total)
    return torch.arange(total, device=received.device) + shift


class ExpertParallelExperts(nn.Module):
    """This rank's E / ep experts of one block (w1, w3 (L, dim, ffn), w2 (L, ffn, dim)), fed
    by all-to-all over the ep group."""

    EAGER_PARTS = ("_grouped", "_exchange")
    """What train.compile leaves eager (trainer3d/parallel/compile.py ``leave_eager``): the
    experts' kernel (model/experts.py) and the all-to-all's exchange, whose counts are read on the host."""

    def __init__(self, experts: Experts, dims: ParallelDims):
        super().__init__()
        num, dim, ffn = experts.w1.shape[0], experts.w1.shape[1], experts.w1.shape[2]
        self.num_experts, self.ep, self.group = num, dims.ep, dims.ep_group
        self.shard = TPShard(dim=0, rank=dims.ep_rank, size=dims.ep, full=num, expert=True)
        local, like = num // dims.ep, experts.w1
        for name, shape in (("w1", (local, dim, ffn)), ("w3", (local, dim, ffn)), ("w2", (local, ffn, dim))):
            setattr(self, name, nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype)))
        self._grouped = grouped_swiglu
        # The function, not a bound method, so a deep copy of the block (an interleaved rank's
        # chunks: parallel/pipeline/stages.py) dispatches through its own weights, as
        # model/moe.py's ``_account`` does.
        self._exchange = _exchange
        self._mark()

    def _mark(self) -> None:
        for param in (self.w1, self.w3, self.w2):
            param.tp_shard = self.shard

    def _apply(self, fn, recurse=True):
        # Module.to_empty (meta -> a device) replaces each Parameter object, dropping its
        # attributes: the marks go back on after every conversion (as parallel/tensor/layers.py's)
        super()._apply(fn, recurse)
        self._mark()
        return self

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (tokens, dim) sorted by expert, ``counts[e]`` of them for expert e of all E."""
        return self._exchange(self, x, counts)


def _exchange(experts: ExpertParallelExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Steps 1-4 of the module docstring for ``experts``' ep group."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=experts.group)
    received = received.view(experts.ep, -1)
    send = counts.view(experts.ep, -1).sum(1).tolist()
    recv = received.sum(1).tolist()
    order = arrival_order(received)
    tokens = _Dispatch.apply(x, order, send, recv, experts.group)
    y = experts._grouped(tokens, experts.w1, experts.w3, experts.w2, received.sum(0))
    return _Combine.apply(y, order, send, recv, experts.group)


def apply_expert_parallel(chunks: List[nn.Module], dims: ParallelDims) -> None:
    """Give every MoE block of ``chunks`` (on the meta device, before materialisation) this
    rank's slice of its experts and the all-to-all around them; nothing when ep == 1."""
    if dims.topo.ep == 1:
        return
    for block in moe_blocks(chunks):
        block.experts = ExpertParallelExperts(block.experts, dims)
