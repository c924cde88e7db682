"""The key/value exchange of context parallelism, over the cp group.

``Ring``: each rank sends the block it holds to the next cp rank and receives the previous
one's (``batch_isend_irecv``, asynchronous), so after cp − 1 hops every rank has seen every
block while holding at most two; the transfer runs while the current block is computed
(Liu et al. 2023, sec. 3). Backward passes the key/value gradients around the same ring
with the blocks, and one more hop brings each block's gradient home.

``gather_blocks`` / ``scatter_grads``: every block at once (an all-gather, Llama 3's
choice with grouped-query attention, whose keys and values are small), and the sum of the
key/value gradients back to their owners (a reduce-scatter; on gloo an all-reduce and a
slice, which is faster there: trainer3d/parallel/zero/flat.py, ``reduce_mode``).
"""

from typing import List, Tuple

import torch
import torch.distributed as dist

from trainer3d.parallel.comm import all_gather_single, backend_of, reduce_scatter_single

BLOCK_TAG, GRAD_TAG = 0, 1  # gloo matches p2p messages by tag: blocks and gradients never cross


class Ring:
    """Point-to-point hops to the next cp rank (from the previous one) in ``group``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (me + 1) % size)
        self.prev = dist.get_global_rank(group, (me - 1) % size)

    def start(self, send: torch.Tensor, tag: int = BLOCK_TAG) -> Tuple[torch.Tensor, List[dist.Work]]:
        """Send ``send`` on and receive the previous rank's tensor of the same shape; returns
        (the receive buffer, the works to wait for before reading it or writing ``send``)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def wait(works: List[dist.Work]) -> None:
    for w in works:
        w.wait()


def gather_blocks(block: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every cp rank's ``block`` stacked in cp rank order: (cp, *block.shape)."""
    size = dist.get_world_size(group)
    out = torch.empty((size, *block.shape), dtype=block.dtype, device=block.device)
    all_gather_single(out.view(size * block.shape[0], *block.shape[1:]), block.contiguous(), group=group)
    return out


def scatter_grads(grads: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``grads`` (cp, *block) over the cp group; return this rank's (*block)."""
    me = dist.get_rank(group)
    if backend_of(group) == "gloo":
        dist.all_reduce(grads, group=group)
        return grads[me]
    out = torch.empty_like(grads[me])
    reduce_scatter_single(out, grads, group=group)
    return out
