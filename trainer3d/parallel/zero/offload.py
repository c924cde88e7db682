"""ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training"):
this rank's optimizer shard and its AdamW step in host memory, for ZeRO stages 0 and 1.

What stays on the device: the model's parameters (the flat buffer, in ``train.dtype``) and
the fp32 gradient buffer cut into buckets (parallel/zero/buckets.py), reduced over dp as
without offload. What lives on the host (pinned on CUDA, so the copies are DMA transfers
that overlap compute): the fp32 master weights, both AdamW moments and an fp32 copy of the
owned gradients — 16 bytes per owned parameter that leave the device, where they cost
12-16 bytes each without offload.

One step:

- backward: as each bucket's dp reduction is launched, its owned slice is queued to the host
  (``GradsToHost``). On CUDA the copy runs on a side stream that first waits for the
  reduction (the NCCL work's ``wait`` under that stream) and then copies non-blocking into
  the pinned buffer, so backward and the later buckets' reductions go on meanwhile. Without
  a side stream (CPU ranks, where "device" and host are both main memory but the host copy
  is still a separate buffer) a bucket is copied as soon as its reduction is complete, the
  rest at ``reduce_gradients``.
- the gradient sums that follow the dp reduction (sequence-parallel norms over tp, a tied
  embedding's two copies: parallel/finalize.py) change some gradients after they were sent;
  the finalizer names those parameters (``grads_changed``) and their owned ranges go again.
- the global norm is taken on the device from the device's gradients (its all-reduce is a
  device collective); the clip coefficient and fp16's inverse loss scale become one scalar
  the host kernel divides the gradients by (``grad_scale`` of ``torch._fused_adamw_``), and
  fp16's ``found_inf`` is the kernel's skip flag. The device never waits for the host: the
  host reads the two scalars after the gradients, as it must anyway before its step.
- the host step (``HostAdamW``), then the owned parameters go back (cast on the host to
  ``train.dtype`` first: half the bytes over PCIe for bf16/fp16) and are all-gathered over dp
  by parallel/zero/param_gather.py exactly as without offload.

Checkpoints hold the same tensors under the same keys as without offload (the views point
at the host state), so a run resumes or reshards freely between offloaded and not.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from trainer3d.config.schema import Config, OptimConfig
from trainer3d.optim.adamw import Segment, adamw_groups, fused_adamw_
from trainer3d.parallel.clip import sum_of_squares
from trainer3d.optim.schedule import decays
from trainer3d.parallel.topology import ParallelDims
from trainer3d.parallel.zero.buckets import Bucket, GradReducer
from trainer3d.parallel.zero.flat import FlatZeroOptimizer
from trainer3d.parallel.zero.host_kernel import host_kernel, run_table
from trainer3d.parallel.zero.host_scalars import HostScalars, clip_divisor


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host buffer, page-locked where the device is a GPU (DMA copies, non-blocking)."""
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")


def contiguous_runs(segments: Sequence[Segment], decay: Sequence[bool]) -> List[Tuple[int, int, bool]]:
    """(start, end, decay) ranges of the owned-state buffers: neighbouring segments with the same
    weight decay merged into one. The fused kernel then gets a few long tensors, which it splits
    over the cores itself (in cache-line multiples, host_adamw.cpp), instead of one call of
    overhead per parameter."""
    runs: List[Tuple[int, int, bool]] = []
    for s, d in zip(segments, decay):
        lo, hi = s.state_offset, s.state_offset + s.numel
        if runs and runs[-1][1] == lo and runs[-1][2] == d:
            runs[-1] = (runs[-1][0], hi, d)
        else:
            runs.append((lo, hi, d))
    return runs


class HostAdamW:
    """AdamW state of the owned pieces in host memory, and its step there.

    The step is the compiled kernel of host_kernel.py (bit for bit torch's fused CPU AdamW,
    ``torch._fused_adamw_``; all the runs in one call split over torch's intra-op threads,
    prefetching its streams), or torch's kernel itself on those runs where that one cannot be
    built. Measured on the same state (tools/bench/offload.py, figures in docs/offload.md):
    torch's kernel ran at 0.93x DeepSpeed's CPUAdam (AdamW mode, OpenMP), the compiled one
    above it; the foreach path is 5-10x slower (one pass over memory per operation).

    Same layout as trainer3d/optim/adamw.py's ``FlatAdamW`` (the owned pieces one after the
    other), so a segment's state offset is the same; the fp32 masters always exist on the host
    (for fp32 models they are the host's copy of the owned parameters)."""

    def __init__(self, segments: List[Segment], pieces: Sequence[Tuple[int, int]], param_buffer: torch.Tensor,
                 grad_buffer: torch.Tensor, cfg: OptimConfig):
        self.segments, self.pieces, self.cfg = segments, list(pieces), cfg
        self.device = param_buffer.device
        self.param_buffer, self.grad_buffer = param_buffer, grad_buffer
        numel = sum(hi - lo for lo, hi in self.pieces)
        self.master = host_empty(numel, torch.float32, self.device)
        self.exp_avg = host_empty(numel, torch.float32, self.device)
        self.exp_avg_sq = host_empty(numel, torch.float32, self.device)
        self.grad = host_empty(numel, torch.float32, self.device)
        self.separate_master = param_buffer.dtype != torch.float32
        """Mixed precision: the masters are state of their own (checkpointed as ``master``)."""
        # bf16/fp16: the updated parameters are cast on the host, into a pinned staging buffer
        self.outgoing = host_empty(numel, param_buffer.dtype, self.device) if self.separate_master else self.master
        self.step_count = torch.zeros((), dtype=torch.float32)
        self.offsets = []
        """Where each owned piece starts in the host buffers."""
        at = 0
        for lo, hi in self.pieces:
            self.offsets.append(at)
            at += hi - lo
        self.grad_views = [grad_buffer[s.start:s.end] for s in segments]
        """The device's gradients of the segments (the norm is taken from them)."""
        self.decay = [decays(s.name, s.param) for s in segments]
        self.runs = contiguous_runs(segments, self.decay)
        # The fused calls' lists, made once (the views and the counter are the same every step).
        views = [[t[lo:hi] for lo, hi, _ in self.runs] for t in (self.master, self.grad, self.exp_avg, self.exp_avg_sq)]
        self.groups = adamw_groups(*views, [d for _, _, d in self.runs], self.step_count, cfg)
        self.kernel = host_kernel()
        self.run_rows = run_table(self.runs)
        self.master_from_params()

    @torch.no_grad()
    def master_from_params(self) -> None:
        """The host masters := the device's owned parameters (as built, or as a checkpoint loaded
        them into an fp32 model)."""
        for (lo, hi), at in zip(self.pieces, self.offsets):
            self.master[at:at + hi - lo].copy_(self.param_buffer[lo:hi])

    @torch.no_grad()
    def step(self, lr: float, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
        """One AdamW update of the host masters from the host gradients divided by ``grad_scale``
        (skipped if ``found_inf``), then the cast for the device."""
        if self.kernel is None:
            fused_adamw_(self.groups, self.step_count, lr, self.cfg, found_inf, grad_scale)
        else:  # the same counter protocol as fused_adamw_: advanced, and back where skipped
            self.step_count += 1
            c = self.cfg
            self.kernel.adamw_step(self.master, self.grad, self.exp_avg, self.exp_avg_sq, self.run_rows,
                                   self.step_count, lr, c.beta1, c.beta2, c.weight_decay, c.eps, grad_scale,
                                   found_inf, -1)
            if found_inf is not None:
                self.step_count -= found_inf.squeeze()
        if self.separate_master:
            self.outgoing.copy_(self.master)

    @torch.no_grad()
    def params_to_device(self) -> None:
        """The owned pieces of the device's parameter buffer := the host's values (queued
        non-blocking on the current stream, before the all-gather that sends them)."""
        pinned = self.outgoing.is_pinned()
        for (lo, hi), at in zip(self.pieces, self.offsets):
            self.param_buffer[lo:hi].copy_(self.outgoing[at:at + hi - lo], non_blocking=pinned)

    def state_views(self) -> List[Tuple[Segment, Dict[str, torch.Tensor]]]:
        """As ``FlatAdamW.state_views``: the same kinds, so the checkpoints are the same."""
        out = []
        for s in self.segments:
            lo, hi = s.state_offset, s.state_offset + s.numel
            kinds = {"exp_avg": self.exp_avg[lo:hi], "exp_avg_sq": self.exp_avg_sq[lo:hi]}
            if self.separate_master:
                kinds["master"] = self.master[lo:hi]
            out.append((s, kinds))
        return out

    def host_tensors(self) -> List[torch.Tensor]:
        out = [self.master, self.exp_avg, self.exp_avg_sq, self.grad, self.step_count]
        return out + [self.outgoing] if self.separate_master else out


class GradsToHost:
    """The owned slice of each bucket's reduced gradient, copied to the host buffer as the
    bucket's reduction is launched (CUDA: on a side stream behind the reduction) or completes."""

    def __init__(self, reducer: GradReducer, adam: HostAdamW):
        self.reducer, self.adam = reducer, adam
        self.owned: Dict[int, List[Tuple[int, int, int]]] = {}
        """Per bucket, its owned ranges: (start, end) in the flat buffers and where they start in
        the host buffers (ZeRO-1: this rank's slice of the bucket; stage 0: all of it)."""
        for b in reducer.buckets:
            self.owned[b.index] = [(max(b.start, lo), min(b.end, hi), at + max(b.start, lo) - lo)
                                   for (lo, hi), at in zip(adam.pieces, adam.offsets) if max(b.start, lo) < min(b.end, hi)]
        self.stream = torch.cuda.Stream(adam.device) if adam.device.type == "cuda" else None
        self.queued: List[Bucket] = []
        """Launched buckets whose copy is not issued yet (no side stream only)."""
        self.done_event: Optional[torch.cuda.Event] = None
        reducer.on_launch = self.launched

    def _copy_bucket(self, bucket: Bucket) -> None:
        for lo, hi, at in self.owned[bucket.index]:
            self.adam.grad[at:at + hi - lo].copy_(self.adam.grad_buffer[lo:hi], non_blocking=self.stream is not None)

    def launched(self, bucket: Bucket) -> None:
        if self.stream is None:
            self.queued.append(bucket)
            self._copy_completed()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.adam.device))  # the gradients were made there
        with torch.cuda.stream(self.stream):
            if bucket.work is not None:
                bucket.work.wait()  # NCCL: this stream waits for the reduction, the host does not
            self._copy_bucket(bucket)

    def _copy_completed(self) -> None:
        """No side stream: copy every queued bucket whose reduction has finished."""
        still = []
        for bucket in self.queued:
            if bucket.work is None or bucket.work.is_completed():
                if bucket.work is not None:
                    bucket.work.wait()
                self._copy_bucket(bucket)
            else:
                still.append(bucket)
        self.queued = still

    def finish(self) -> None:
        """After the reducer's ``finish``: every bucket's copy issued."""
        for bucket in self.queued:
            self._copy_bucket(bucket)
        self.queued = []

    def again(self, segments: Sequence[Segment]) -> None:
        """Copy these segments' gradients once more (changed on the device since they were sent)."""
        def copy():
            for s in segments:
                self.adam.grad[s.state_offset:s.state_offset + s.numel].copy_(
                    self.adam.grad_buffer[s.start:s.end], non_blocking=self.stream is not None)
        if self.stream is None:
            copy()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.adam.device))
        with torch.cuda.stream(self.stream):
            copy()

    def wait(self) -> None:
        """The host holds every copy issued (a host wait on the side stream only)."""
        if self.stream is not None:
            self.stream.synchronize()


class OffloadedOptimizer(FlatZeroOptimizer):
    """ZeRO stage 0 or 1 with the optimizer state and step on the host (``parallel.offload_optimizer``)."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims, sharded: bool,
                 overlap_gather: bool = True, **part):
        # ``part``: FlatZeroOptimizer's trains / replicas / grad_factor, for the two halves of an
        # expert-parallel layout (parallel/expert/optimizer.py)
        super().__init__(chunks, cfg, dims, sharded, overlap_gather, **part)
        self.to_host = GradsToHost(self.reducer, self.adam)
        self._grad_scale: Optional[torch.Tensor] = None
        """This step's divisor of the gradients (device): 1 / (clip coefficient x inverse loss scale)."""
        self._host_scalars = HostScalars(dims.device)

    def _make_adam(self, segments: List[Segment], owned_numel: int):
        return HostAdamW(segments, self.pieces, self.buffers.param_buffer, self.buffers.grad_buffer, self.cfg.optim)

    def reduce_gradients(self) -> None:
        """Wait for every bucket's reduction; every owned gradient on its way to the host. fp16
        gradients stay scaled: the host divides them by the scale with the clip coefficient."""
        self.reducer.finish()
        self.to_host.finish()

    def grads_changed(self, params: Sequence[nn.Parameter]) -> None:
        changed = set(params)
        self.to_host.again([s for s in self.adam.segments if s.param in changed])

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm, divisor = clip_divisor(sum_of_squares(self._counted, self.dims.device), max_norm, self.scaler)
        self.divide_grads_by(divisor)
        return norm

    def divide_grads_by(self, divisor: Optional[torch.Tensor]) -> None:
        """This step's divisor of the gradients (a device scalar; None: 1), applied by the host
        kernel as it reads them: set by ``clip_grad_norm``, or by an optimizer whose one norm
        spans this one and another (parallel/expert/optimizer.py)."""
        self._grad_scale = divisor

    def _scalars_on_host(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """This step's gradient divisor and fp16 skip flag, read by the host (after the gradients)."""
        return self._host_scalars.fetch(self._grad_scale, self.scaler)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.wait_params()  # the new values go where the last gather sends from
        grad_scale, found_inf = self._scalars_on_host()
        self.to_host.wait()
        self.adam.step(lr, grad_scale, found_inf)
        if self.scaler is not None:
            self.scaler.update()
        self.adam.params_to_device()
        self._gather_params(defer=True)

    @torch.no_grad()
    def after_load(self) -> None:
        self.wait_params()
        if self.adam.separate_master:  # the parameters are the masters' cast
            self.adam.outgoing.copy_(self.adam.master)
            self.adam.params_to_device()
            self._gather_params()
        else:  # fp32: the checkpoint loaded the parameters, the masters are their copy
            self.adam.master_from_params()

    def state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        a = self.adam
        return {"params": [self.buffers.param_buffer], "grads": [self.buffers.grad_buffer, a.grad],
                "master": [a.master, *([a.outgoing] if a.separate_master else [])],
                "optimizer": [a.exp_avg, a.exp_avg_sq, a.step_count,
                              *(self.scaler.tensors().values() if self.scaler is not None else [])]}
