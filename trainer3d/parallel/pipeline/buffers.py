"""Pipeline receive buffers for the micro-batches in flight only.

torch 2.13's ``PipelineStage`` allocates, when it first infers shapes, one receive buffer
per micro-batch of the step for the stage's input activation and one for its output
gradient (torch/distributed/pipelining/stage.py: ``_setup_forward_recv_info`` and
``_setup_backward_recv_info`` loop over ``num_microbatches``) and keeps them for the life
of the stage, so they grow with grad_accum although 1F1B never has more than
``stages - stage index`` micro-batches in flight (Narayanan et al. 2021, sec. 2.2). At
Megatron-LM's 530B layout (pp35, 280 micro-batches of one sequence of 2048 x 20480 bf16)
that is 44 GiB a rank.

``BoundedReceiveStage`` keeps torch's receive descriptors (source, shape, dtype) but no
memory behind them: a buffer is allocated when the schedule posts its receive and freed
when the micro-batch's backward has run (both the input activation, which autograd may
hold as the first block's saved input until then, and the output gradient that backward
reads), or after the forward when no backward follows (evaluation). Megatron-LM allocates
its receive tensors per transfer the same way (megatron/core/pipeline_parallel/
p2p_communication.py, ``_communicate``). A rank then holds

    input activations   one per micro-batch in flight on each chunk but the first stage
    output gradients    one per chunk but the last stage, from its receive to its backward's end

Interleaved 1F1B posts receives ahead of the compute that reads them, so its count comes
from torch's own order with its communication (receive_count.py). Each allocation
is counted by a ``ReceiveLedger`` (live and peak bytes): tests/multirank/test_pipeline.py
holds the peak to ``receive_buffers_held`` (receive_count.py) and to torch's own allocation,
trainer3d/memory/peak.py predicts memory with it.
"""

import copy
import weakref
from typing import Dict, Tuple

import torch
from torch.distributed.pipelining import PipelineStage


class ReceiveLedger:
    """Bytes of receive buffers alive now, and the most alive at once since ``reset_peak``.

    ``free`` gives a buffer's memory back at once, by shrinking its storage to nothing: the
    schedule's own lists of posted receives (``torch.distributed.P2POp``) and, on the last
    stage, the graphs of the step's losses (torch keeps them until the step ends, and a
    graph's leaf keeps its tensor) still name the tensor after its micro-batch is done. A
    read of a freed buffer fails loudly (its storage is empty) rather than reading stale data.
    """

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0
        self._held: Dict[int, int] = {}  # id of a live buffer -> its bytes

    def allocate(self, shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        key = id(buffer)
        self._held[key] = buffer.untyped_storage().nbytes()
        self.live_bytes += self._held[key]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(buffer, self._forget, key)  # dropped without ``free``: counted out when freed
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Give back a buffer ``allocate`` made; any other tensor (a V schedule hands a stage's
        output to the next stage on the same rank without a receive) is left alone."""
        if id(buffer) not in self._held:
            return
        self._forget(id(buffer))
        buffer.untyped_storage().resize_(0)

    def _forget(self, key: int) -> None:
        self.live_bytes -= self._held.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


def _unallocated(infos: tuple) -> tuple:
    """Copies of torch's receive descriptors without their buffers (root inputs unchanged)."""
    out = []
    for info in infos:
        info = copy.copy(info)
        if not info.is_root_arg:
            info.buffer = None
        out.append(info)
    return tuple(out)


class BoundedReceiveStage(PipelineStage):
    """A PipelineStage whose receive buffers exist only while their micro-batch needs them."""

    def __init__(self, *args, ledger: ReceiveLedger, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    # ---------------------------------------------------------------- descriptors, no memory

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # one descriptor, its buffer dropped at once
        template = _unallocated(self.args_recv_info[0])
        self.args_recv_info = {mb: _unallocated(template) for mb in range(num_microbatches)}

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        super()._setup_backward_recv_info(1)
        template = _unallocated(self.grad_recv_info[0])
        self.chunks = num_microbatches
        self.grad_recv_info = {mb: _unallocated(template) for mb in range(num_microbatches)}

    # ---------------------------------------------------------------- allocate on receive

    def _allocate(self, infos: tuple) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                meta = info.tensor_meta
                info.buffer = self.ledger.allocate(meta.shape, meta.stride, meta.dtype, self.device)

    def _release(self, table: Dict[int, Tuple], mb: int) -> None:
        for info in table.get(mb, ()):
            if not info.is_root_arg and info.buffer is not None:
                self.ledger.free(info.buffer)
                info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        if not self.is_first:
            self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    # ---------------------------------------------------------------- drop after use

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not (self.has_backward and torch.is_grad_enabled()):  # no backward will read it
            self._release(self.args_recv_info, fwd_chunk_id)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args, full_backward: bool = True, **kwargs):
        super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)
        # A zero-bubble input step (full_backward=False) leaves the weight step to come, which reads
        # both: the input activation (saved by the first block) and the output gradient (the
        # gradient torch keeps for the last node before the output is that very buffer; on the
        # first stage torch runs the whole backward then).
        if full_backward:
            self._release(self.grad_recv_info, bwd_chunk_id)
            self._release(self.args_recv_info, bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._release(self.grad_recv_info, bwd_chunk_id)
        self._release(self.args_recv_info, bwd_chunk_id)
