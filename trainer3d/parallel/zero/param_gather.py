"""ZeRO-1's parameter all-gather, overlapped with the next forward.

After the update each dp rank holds new values for its own slice of every bucket only; the
model needs all of them again by the next forward. Rather than wait for the whole gather at
the end of ``step()``, the optimizer launches one asynchronous all-gather per bucket (in
forward order: the embedding's bucket first) and hands the work handles here. Each is waited
for just before the first module that reads the bucket's parameters runs: a forward
pre-hook on every transformer block and on every other module that holds parameters itself
(the embedding, the final norm, the head; the final norm's also waits for the head's, which a
chunked loss reads without calling the head). The first micro-batch's forward - inside the
pipeline schedule too, where each stage only ever waits for its own buckets - therefore
computes while the later buckets are still arriving (Megatron-LM's distributed optimizer
overlaps its parameter all-gather with the forward the same way, ``overlap_param_gather``).

The hooks are registered once and stay: with nothing pending they return at once. That
makes them no-ops where a module runs a second time (activation recomputation inside
backward, a tied embedding used as the head) and keeps the hook set constant, so a block
compiled with ``Module.compile`` is traced once; the hook itself runs outside the graph
(``torch._dynamo.disable``), as FSDP2's pre-forward hook does on torchtitan's compiled blocks.

Readers that do not go through a module's forward wait for everything first
(``wait_all``): checkpoint saves and loads, ``parameters()``, the end of training, and the
next ``step()`` before its update writes the slices this gather sends from (a bucket whose
parameters took no part in the forward is still pending there).

The all-gather's timeout: every rank launches it at the same point (the end of ``step()``),
so the collective itself completes within the group's ``parallel.timeout_s`` however late a
rank waits for it (gloo runs it on its worker threads, NCCL on its stream, from the launch).

fp16 steps skipped for a non-finite gradient are gathered all the same: knowing the step was
skipped takes a host sync on the device's ``found_inf``, and the gather of unchanged values
is correct, just redundant.
"""

import time
from typing import Dict, Iterable, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn


def hook_units(chunk: nn.Module) -> List[Tuple[nn.Module, List[nn.Parameter]]]:
    """The modules whose forward pre-hook waits, each with the parameters it reads: every
    transformer block with all of its own (the unit ``train.compile`` compiles), and every
    other module holding parameters directly (a tied Parameter appears under each holder)."""
    blocks = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
    inside = {id(m) for block in blocks for m in block.modules()}
    units = [(block, list(block.parameters())) for block in blocks]
    head, norm = getattr(chunk, "output", None), getattr(chunk, "norm", None)
    for module in chunk.modules():
        direct = list(module.parameters(recurse=False))
        if head is not None and module is norm:
            # The loss may apply the head itself, never calling its forward (Transformer.head_in_loss,
            # parallel/tensor/loss.py): the final norm, which runs just before, waits for it too.
            direct += [p for p in head.parameters() if all(p is not q for q in direct)]
        if direct and id(module) not in inside:
            units.append((module, direct))
    return units


class DeferredGather:
    """Holds the in-flight all-gather of each bucket until the parameters are first read.

    ``bucket_of``: each trained parameter's bucket index. ``waited_s`` adds up the time spent
    waiting (the gather time the forward did not hide).
    """

    def __init__(self, chunks: Sequence[nn.Module], bucket_of: Dict[nn.Parameter, int]):
        self.pending: Dict[int, dist.Work] = {}
        self.waited_s = 0.0
        for chunk in chunks:
            for module, params in hook_units(chunk):
                buckets = sorted({bucket_of[p] for p in params if p in bucket_of}, reverse=True)  # launch order
                if buckets:
                    module.register_forward_pre_hook(self._hook(buckets))

    def _hook(self, buckets: List[int]):
        @torch._dynamo.disable
        def wait_for_buckets(module, args):
            if self.pending:
                self.wait(buckets)
        return wait_for_buckets

    def hand_over(self, works: Dict[int, dist.Work]) -> None:
        """Take the launched gathers (bucket index -> work), the previous ones all waited for."""
        if self.pending:
            raise RuntimeError("a parameter all-gather was launched while the previous one was still pending")
        self.pending = dict(works)

    def wait(self, buckets: Iterable[int]) -> None:
        started = time.perf_counter()
        for index in buckets:
            work = self.pending.pop(index, None)
            if work is not None:
                work.wait()
        self.waited_s += time.perf_counter() - started

    def wait_all(self) -> None:
        """Every bucket's parameters hold the gathered values (the order they were launched in)."""
        if self.pending:
            self.wait(list(self.pending))
