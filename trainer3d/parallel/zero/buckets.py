"""Flat parameter and gradient buffers, their buckets, and the backward hooks that reduce them.

Every trainable parameter of this rank (all its pipeline chunks) becomes a view into one
flat parameter buffer, and its gradient a view into one flat fp32 gradient buffer with the
same layout. Parameters are laid out in reverse registration order, which is close to the
order backward produces their gradients (output head first, embedding last), and cut into
buckets of about ``parallel.bucket_mb`` MiB of gradient (a parameter is never split; one
larger than a bucket gets a bucket of its own). Each bucket is padded to a multiple of
``pad_multiple`` elements (dp for ZeRO-1, so every rank owns an equal slice of it; 1 for
stage 0, which shards nothing). With dp=4, two buckets::

    flat:   | bucket 0: head, norm, layer 3 ... pad | bucket 1: layer 2 ... embedding  pad |
    owner:  | r0 | r1 | r2 | r3 |                    | r0 | r1 | r2 | r3 |

Gradients: fp32 parameters get ``.grad`` = their view of the gradient buffer, so autograd
accumulates the micro-batches straight into it (torch's DDP ``gradient_as_bucket_view``
does the same). bf16/fp16 weights of linear layers have their gradient accumulated into
their fp32 view by the layer's backward (parallel/wgrad.py) and get no ``.grad``; other
bf16/fp16 parameters (norms, the embedding) get a fresh low-precision ``.grad`` per
micro-batch, which the post-accumulate hook adds into the fp32 buffer and frees.

Overlap: each parameter's post-accumulate hook fires once per micro-batch backward (also
when wgrad.py left it nothing to accumulate). A bucket
is launched (an async all-reduce or reduce-scatter over dp, averaging) the moment every one
of its parameters has received its last micro-batch's gradient of the step (each chunk
sees ``grad_accum_steps`` micro-batches, whatever the pipeline schedule; a parameter two of
the rank's chunks share, a V's tied embedding, is accumulated by both), so the
reduction of the head's bucket runs while backward is still in the lower layers.
``finish`` launches any bucket a hook did not (a parameter unused in forward) and waits.
"""

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.parallel import comm


@dataclass
class Bucket:
    index: int
    start: int
    end: int
    """[start, end) of the flat buffers, padding included; (end - start) % pad_multiple == 0."""
    params: List[nn.Parameter] = field(default_factory=list)
    pending: int = 0
    """Parameters still waiting for their last micro-batch's gradient this step."""
    work: Optional[dist.Work] = None
    launched: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_buckets(numels: Sequence[int], bucket_numel: int, pad_multiple: int
                 ) -> Tuple[List[int], List[Tuple[int, int, List[int]]], int]:
    """Offsets of tensors laid out in order, buckets (start, end, member indices), total length.

    A pure function, shared with ``trainer3d.memory.states`` so the accounting pads exactly as the
    engine does. A bucket is closed before a tensor would take it past ``bucket_numel``.
    """
    offsets: List[int] = []
    buckets: List[Tuple[int, int, List[int]]] = []
    start, pos, members = 0, 0, []

    def close():
        nonlocal start, pos, members
        end = start + -(-(pos - start) // pad_multiple) * pad_multiple
        buckets.append((start, end, members))
        start, pos, members = end, end, []

    for i, n in enumerate(numels):
        if members and pos - start + n > bucket_numel:
            close()
        offsets.append(pos)
        members.append(i)
        pos += n
    if members:
        close()
    return offsets, buckets, start


class FlatBuffers:
    """One flat parameter buffer in the training dtype and one flat fp32 gradient buffer;
    the parameters' values are copied into it and each parameter becomes a view of it."""

    def __init__(self, params: Sequence[nn.Parameter], bucket_numel: int, pad_multiple: int, dtype: torch.dtype):
        self.params = list(reversed(list(params)))  # backward order: head first
        self.param_dtype = dtype
        device = self.params[0].device
        offsets, plan, total = plan_buckets([p.numel() for p in self.params], bucket_numel, pad_multiple)
        self.offset: Dict[nn.Parameter, int] = dict(zip(self.params, offsets))
        self.buckets = [Bucket(i, s, e, [self.params[j] for j in members]) for i, (s, e, members) in enumerate(plan)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.param_buffer = torch.zeros(total, dtype=self.param_dtype, device=device)
        self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p in self.params:
                view = self.param_view(p)
                view.copy_(p.data)
                p.data = view  # the same Parameter object, now backed by the flat buffer

    @property
    def numel(self) -> int:
        return self.param_buffer.numel()

    def range_of(self, p: nn.Parameter) -> Tuple[int, int]:
        start = self.offset[p]
        return start, start + p.numel()

    def param_view(self, p: nn.Parameter) -> torch.Tensor:
        start, end = self.range_of(p)
        return self.param_buffer[start:end].view(p.shape)

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        start, end = self.range_of(p)
        return self.grad_buffer[start:end].view(p.shape)


class GradReducer:
    """Launches each bucket's dp reduction from the backward hooks; ``finish`` waits for all.

    ``mode``: ``all_reduce`` leaves the averaged gradient everywhere; ``reduce_scatter``
    leaves each rank's slice of every bucket averaged (the rest stays this rank's local sum).
    """

    def __init__(self, buffers: FlatBuffers, group: comm.Collectives, dp: int, dp_rank: int, micro_batches: int,
                 mode: str, uses: Optional[Sequence[int]] = None, scale: float = 1.0):
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"mode={mode}")
        self.buffers, self.group, self.dp, self.dp_rank = buffers, group, dp, dp_rank
        self.micro_batches, self.mode = micro_batches, mode
        self.expected = [None if micro_batches is None else micro_batches * u
                         for u in (uses or [1] * len(buffers.params))]
        """Per parameter, its accumulations a step: micro-batches x the chunks using it (None where
        the count is not known: no bucket launches in backward, all reduce at ``finish``)."""
        self.scale = scale
        """A factor on every gradient before its reduction (expert parallelism's 1 / ep:
        parallel/expert/optimizer.py), so whatever reads the reduced gradients, on the device or
        the copies an offloaded step takes to the host, reads them scaled."""
        self.in_place = buffers.param_dtype == torch.float32
        # Decided once: each parameter's gradient view and bucket, looked up by its index in the
        # hook (a Tensor hashes in Python: a dict keyed by parameters costs a call per lookup).
        self.views = [buffers.grad_view(p) for p in buffers.params]
        self._bucket_of = [buffers.bucket_of[p] for p in buffers.params]
        self.counts: List[int] = [0] * len(buffers.params)
        self.launch_order: List[int] = []
        """Bucket indices in launch order this step, and how many launched inside backward."""
        self.launched_in_backward = 0
        self.on_launch: Optional[Callable[[Bucket], None]] = None
        """Called with each bucket right after its reduction is launched (parallel/zero/offload.py)."""
        for i, p in enumerate(buffers.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
        self.zero_grad()

    def zero_grad(self) -> None:
        """Start a step: zero the fp32 buffer, reset the counts, point fp32 ``.grad`` at it."""
        self.buffers.grad_buffer.zero_()
        self.counts = [0] * len(self.views)
        for b in self.buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        self.launch_order, self.launched_in_backward = [], 0
        for p, view in zip(self.buffers.params, self.views):
            want = view if self.in_place else None
            if p.grad is not want:  # assigning .grad checks shapes and devices: only where it changed
                p.grad = want

    @property
    def buckets(self) -> List[Bucket]:
        return self.buffers.buckets

    def _on_grad(self, i: int, p: nn.Parameter) -> None:
        view, grad = self.views[i], p.grad
        if grad is not None and grad is not view and grad.data_ptr() != view.data_ptr():
            # Low precision (or a .grad someone replaced): move it into the fp32 buffer.
            view.add_(grad)
            p.grad = view if self.in_place else None
        self.counts[i] += 1
        if self.counts[i] == self.expected[i]:
            bucket = self._bucket_of[i]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)
                self.launched_in_backward += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self.launch_order.append(bucket.index)
        flat = self.buffers.grad_buffer[bucket.start:bucket.end]
        if self.scale != 1.0:
            flat.mul_(self.scale)
        if self.dp > 1:
            if self.mode == "all_reduce":
                bucket.work = self.group.all_reduce_avg(flat)
            else:
                bucket.work = self.group.reduce_scatter_avg(self.shard_of(bucket, self.buffers.grad_buffer), flat)
        if self.on_launch is not None:
            self.on_launch(bucket)

    def shard_of(self, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """This dp rank's equal slice of ``bucket`` in ``flat`` (a buffer with the same layout)."""
        size = bucket.numel // self.dp
        start = bucket.start + self.dp_rank * size
        return flat[start:start + size]

    def finish(self) -> None:
        """Every bucket reduced: launch the ones no hook launched, then wait for all."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
