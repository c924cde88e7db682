"""Pipeline parallelism: a step's micro-batches through 1F1B, GPipe, interleaved 1F1B or the
zero-bubble zb1p, zbv and dualpipev (their weight step through weight_grad.py; zbv and dualpipev
on two stages per rank in a V, placement.py).

The schedules are torch.distributed.pipelining's (tests/multirank/test_pipeline.py holds their losses
and gradients to a single process). This module builds them over ``dims.pp_group`` and guards their
pitfalls:

- gradient scaling: ``scale_grads=False``. The ``MicroBatchLoss`` (parallel/pipeline/losses.py) is the
  schedule's loss function and already divides each micro-batch's loss by grad_accum
  (torch's own scaling divides the whole ``.grad``, including any earlier gradient);
- equal micro-batch shapes: the step's (grad_accum, micro_batch, seq) batch is handed
  over flattened, and torch splits it back into exactly grad_accum equal chunks (a
  ragged chunk raises on the last stage while the others hang);
- losses exist on the last stage only, recorded in the trainer's ``StepLosses``
  (losses.py); torch's shape inference on the first step calls the loss function once
  more on a copy of micro-batch 0, inside ``StepLosses.not_recorded``, so the record holds
  exactly grad_accum losses;
- micro-batch counts a schedule cannot run (1F1B: fewer than the stages) are refused by
  the config validation and again here, with the same message, before any rank sends;
- a dead or stuck neighbour: the pp group carries ``parallel.timeout_s`` (trainer3d/parallel/topology.py),
  so a receive fails instead of hanging and the launcher ends the job.

Stage compute is timed (``StageClock``) so the bubble is measured, not assumed.

Memory: 1F1B bounds the saved activations at (stages - stage index) micro-batches
(tests/multirank/test_pipeline.py measures it), and the receive buffers with them: a buffer
exists from its receive to its micro-batch's backward (buffers.py), where torch 2.13's
PipelineStage keeps one per micro-batch of the step. A stage's output is kept until its
backward although only its graph is needed then (Megatron frees the data).
"""

from typing import List, Optional

import torch
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from trainer3d.config.schema import Config
from trainer3d.model.moe import moe_blocks, not_counted
from trainer3d.parallel.pipeline.bubble import StageClock, bubble_theory
from trainer3d.parallel.pipeline.buffers import BoundedReceiveStage, ReceiveLedger
from trainer3d.parallel.pipeline.losses import StepLosses
from trainer3d.parallel.pipeline.stages import stages_of_rank
from trainer3d.parallel.pipeline.timeline import Action
from trainer3d.parallel.pipeline.weight_grad import backward_weight
from trainer3d.parallel.topology import ParallelDims
from trainer3d.config.validate_pipeline import pipeline_micro_batch_problem

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zb1p": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
SINGLE_STAGE = ("1f1b", "gpipe")
"""Schedules built on one stage per rank; the others take the rank's list of stages."""


class TimedStage(BoundedReceiveStage):
    """A stage whose forward and backward compute count as busy time, and whose shape
    inference's loss is not one of the step's (``StepLosses.not_recorded``), nor its MoE
    blocks' routing counts and balance losses (model/moe.py ``not_counted``): torch runs the
    chunk forward on micro-batch 0's copy, or on stand-in tensors of the received shapes
    (torch/distributed/pipelining/stage.py, ``_forward_metadata_inference``).

    With document masking (``segments``, model/documents.py) the blocks read the segments of
    the micro-batch the schedule runs: set before each micro-batch's forward and again before
    its backward (which recomputes the forward under activation checkpointing), from the
    step's ``step_segments`` (grad_accum, micro_batch, seq)."""

    def __init__(self, *args, clock: StageClock, losses: StepLosses, segments=None, executed=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.losses = losses
        self.segments = segments
        self.step_segments: Optional[torch.Tensor] = None
        self.executed: List[Action] = executed if executed is not None else []
        """The (kind, stage, micro-batch) compute actions this rank ran in the current step, in
        order (timeline.py): F, B, or the zero-bubble halves I and W."""

    def _record(self, kind: str, chunk_id: int) -> None:
        if self.clock.in_step:
            self.executed.append((kind, self.stage_index, chunk_id))

    def _use_segments(self, chunk_id: int) -> None:
        if self.segments is not None:
            self.segments.set(self.step_segments[chunk_id])

    def _prepare_forward_infra(self, *args, **kwargs):
        with not_counted(moe_blocks([self.submod])):  # a forward on a stand-in micro-batch
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        with self.losses.not_recorded():
            return super()._prepare_backward_infra(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._use_segments(fwd_chunk_id)
        self._record("F", fwd_chunk_id)
        with self.clock.busy():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, full_backward: bool = True, **kwargs):
        self._use_segments(bwd_chunk_id)
        self._record("B" if full_backward else "I", bwd_chunk_id)
        with self.clock.busy():
            return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._use_segments(bwd_chunk_id)
        self._record("W", bwd_chunk_id)
        with self.clock.busy():
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """torch's, but the zero-bubble weight step through the gradient path (weight_grad.py)."""
        if backward_type == "weight":
            backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"])
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


class Pipeline:
    """This rank's stage(s) of the pipeline and the schedule that runs a step through them."""

    def __init__(self, chunks: List[nn.Module], micro_loss, cfg: Config, dims: ParallelDims, segments=None):
        p = cfg.parallel
        self.n_micro = cfg.train.grad_accum_steps
        problem = pipeline_micro_batch_problem(p.pp_schedule, p.pp, self.n_micro)
        if problem:
            raise ValueError(problem)
        stage_ids = stages_of_rank(dims.pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule)
        if len(chunks) != len(stage_ids):
            raise ValueError(f"pp rank {dims.pp_rank} runs stages {stage_ids} but has {len(chunks)} chunks")
        n_stages = p.pp * p.pp_virtual_stages
        self.micro_loss = micro_loss
        self.clock = StageClock(dims.device)
        self.receive = ReceiveLedger()
        self.executed: List[Action] = []
        self.stages = [TimedStage(chunk, stage, n_stages, dims.device, group=dims.pp_group, clock=self.clock,
                                  losses=micro_loss.losses, ledger=self.receive, segments=segments,
                                  executed=self.executed)
                       for chunk, stage in zip(chunks, stage_ids)]
        self.holds_first = 0 in stage_ids
        self.holds_last = n_stages - 1 in stage_ids
        schedule_cls = SCHEDULES[p.pp_schedule]
        loss_fn = self.clock.timed(micro_loss)
        if p.pp_schedule in SINGLE_STAGE:
            self.schedule = schedule_cls(self.stages[0], self.n_micro, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = schedule_cls(self.stages, self.n_micro, loss_fn=loss_fn, scale_grads=False)
        self.bubble_theory = bubble_theory(p.pp, self.n_micro, p.pp_virtual_stages, p.pp_schedule)

    def _schedule_args(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor]):
        """The schedule's positional inputs (first stage) and target (last stage), flattened to
        grad_accum * micro_batch rows that torch splits back into grad_accum equal chunks."""
        for name, batch, needed in (("inputs", inputs, self.holds_first), ("targets", targets, self.holds_last)):
            if needed and (batch is None or batch.dim() != 3 or batch.shape[0] != self.n_micro):
                shape = None if batch is None else tuple(batch.shape)
                raise ValueError(f"pipeline expects ({self.n_micro}, micro_batch, seq) {name}, got {shape}")
        args = (inputs.flatten(0, 1),) if self.holds_first else ()
        target = targets.flatten(0, 1) if self.holds_last else None
        return args, target

    def _set_segments(self, segments: Optional[torch.Tensor]) -> None:
        """The step's segments (document masking) for every stage; micro-batch 0's also for
        the shape inference torch runs before the first forward."""
        if self.stages[0].segments is None:
            return
        if segments is None or segments.shape[0] != self.n_micro:
            raise ValueError(f"data.document_mask: the pipeline expects ({self.n_micro}, micro_batch, seq) segments")
        for stage in self.stages:
            stage.step_segments = segments
        self.stages[0].segments.set(segments[0])

    def forward_backward(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
                         segments: Optional[torch.Tensor] = None) -> None:
        """Run the step's micro-batches; gradients accumulate in the chunks' ``.grad``.

        ``inputs``/``targets`` are (grad_accum, micro_batch, seq), needed on the first and the
        last stage only (None elsewhere); the other stages only pass hidden states along,
        sequence-first (seq, batch, dim) as the model computes them (model/transformer.py):
        their shape is inferred from the first micro-batch, so the receive buffers take the
        model's layout, and a sequence-sharded hidden state under tensor/sequence
        parallelism, with no change here.
        """
        args, target = self._schedule_args(inputs, targets)
        self._set_segments(segments)
        recorded = len(self.micro_loss.losses)
        self.executed.clear()
        self.clock.start_step()
        self.schedule.step(*args, target=target, return_outputs=False)
        self.clock.end_step()
        computed = len(self.micro_loss.losses) - recorded
        if computed != (self.n_micro if self.holds_last else 0):
            raise RuntimeError(f"pp rank stage(s) {[s.stage_index for s in self.stages]} recorded {computed} "
                               f"losses for {self.n_micro} micro-batches")

    def forward(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
                segments: Optional[torch.Tensor] = None) -> None:
        """Forward only (validation): the micro-batches' losses are recorded, no gradient, no bubble.

        torch's ``eval`` runs the schedule with its backward turned off; switching between
        it and ``step`` re-infers the stages' shapes (and, back in training, calls the loss
        once more: dropped as in every first step).
        """
        args, target = self._schedule_args(inputs, targets)
        self._set_segments(segments)
        with torch.no_grad():
            self.schedule.eval(*args, target=target, return_outputs=False)

    def report_to(self, metrics) -> None:
        """Add the per-step ``bubble`` (mean over all ranks) and ``bubble_theory`` columns."""
        metrics.add_column("bubble", self.clock.pop_bubbles)
        metrics.set_constant("bubble_theory", self.bubble_theory)
