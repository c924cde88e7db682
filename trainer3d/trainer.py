"""The training loop of one rank, as small named steps.

``Trainer.__init__`` builds this rank's model chunks, optimizer and data loader from the
config and the layout; ``train_step`` is forward_backward (all grad_accum micro-batches,
through the pipeline schedule when pp > 1) -> finalize the gradients (the dp reduction, the
tp and tied-embedding sums: trainer3d/parallel/finalize.py) -> clip by the global norm ->
optimizer step; ``train`` repeats it, evaluates on the validation set every
train.eval_every steps (``forward_only``, trainer3d/observe/evaluate.py) and logs at the
interval.

Loss spikes (docs/failures.md): between the gradient norm and the update, the spike watch
(trainer3d/observe/spikes.py) judges the step on values every rank agrees on; by
``train.spike.policy`` a spike's update is not applied (skip), or the run restores the
newest checkpoint before the spike and trains on without the steps up to it (rollback).
Steps in the skip log (trainer3d/data/skips.py) are passed over whole: no batch read, no
update; the schedule advances over them. Stragglers: the straggler watch
(trainer3d/observe/stragglers.py) marks each step's compute and waits, read at the interval.
"""

import contextlib
import time
from typing import List, Optional, Tuple

import torch
from torch import nn

from trainer3d.checkpoint import history
from trainer3d.checkpoint.manager import Checkpointer, agree_on_resume
from trainer3d.checkpoint.rollback import agree_on_rollback
from trainer3d.data.skips import SkipLog
from trainer3d.config.schema import Config
from trainer3d.data.loader import Prefetcher, build_readers
from trainer3d.data.segments import build_segments
from trainer3d.data.sources import eval_windows, evaluates
from trainer3d.observe.evaluate import Evaluator
from trainer3d.observe.goodput import Prediction
from trainer3d.observe.loggers import build_sinks
from trainer3d.observe.metrics import MetricsLogger
from trainer3d.observe.moe import MoEStats
from trainer3d.model.documents import segments_of
from trainer3d.model.flops import flops_per_token
from trainer3d.observe.nonfinite import NonFiniteWatch
from trainer3d.observe.profile import StepProfiler
from trainer3d.observe.spikes import SpikeResponse, SpikeWatch, Verdict
from trainer3d.observe.stragglers import StragglerWatch
from trainer3d.optim.schedule import lr_at
from trainer3d.parallel.expert.balance import aux_free_bias, moe_buffers
from trainer3d.parallel.expert.tokens import apply_moe_layout
from trainer3d.parallel.finalize import GradFinalizer
from trainer3d.parallel.parallelize import build_eval_loss_fn, build_loss_fn, build_model_chunks, build_optimizer
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.parallel.pipeline.losses import MicroBatchLoss
from trainer3d.checkpoint.stop import ON_ERROR, TERMINAL, Stop, StopSignal
from trainer3d.observe.telemetry import model_state_bytes, resolve_peak_tflops
from trainer3d.parallel.timeouts import GroupTimeouts
from trainer3d.parallel.topology import ParallelDims


def _pipeline(chunks: List[nn.Module], micro_loss: MicroBatchLoss, cfg: Config, dims: ParallelDims, segments):
    """The schedule of a pp > 1 layout (trainer3d/parallel/pipeline/schedule.py). Imported here:
    torch.distributed.pipelining imports torch._dynamo, 1-2 s of CPU at the start of every rank
    (and of the submitting process), which a layout without pipelining never uses."""
    from trainer3d.parallel.pipeline.schedule import Pipeline

    return Pipeline(chunks, micro_loss, cfg, dims, segments)


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, prediction: Optional[Prediction] = None):
        """``prediction``: the planner's step for this layout, which the progress line and the
        summary split goodput by (trainer3d/plan/predict.py; the rank's body computes it, so the
        loop imports no planner); None: no split."""
        self.cfg = cfg
        self.dims = dims
        self.prediction = prediction
        # First, so a SIGUSR2/SIGTERM during set-up is held for the first step boundary.
        self.stop_signal = StopSignal()
        self.stopped: Optional[Stop] = None
        self.heartbeat = None
        """Set by the rank's body (trainer3d/rank/body.py, trainer3d/rank/heartbeat.py): told the steps completed at each step boundary."""
        self.warm_step: Optional[int] = None
        """The step after the first evaluation (None before it): it waits up to the start-up timeout."""
        t = cfg.train
        # The stop signal's own group too: its check is waited for at every step boundary, and
        # torch gives a group made without a timeout 30 minutes.
        stop_group = [self.stop_signal.group] if self.stop_signal.group is not None else []
        self.timeouts = GroupTimeouts([*dims.groups(), *stop_group], cfg.parallel.init_timeout_s,
                                      cfg.parallel.timeout_s)
        resume_from = agree_on_resume(cfg, dims, self.timeouts)
        self.chunks: List[nn.Module] = build_model_chunks(cfg, dims, initialise=resume_from is None)
        self.optimizer: ZeroOptimizer = build_optimizer(self.chunks, cfg, dims)
        self.grads = GradFinalizer(self.chunks, self.optimizer, dims, cfg.parallel.sequence_parallel)
        self.checkpointer = Checkpointer(cfg, dims, self.optimizer, self.timeouts)
        self.micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, self.chunks), t.grad_accum_steps, self.optimizer,
                                         build_eval_loss_fn(cfg, dims, self.chunks), dims, cfg.data.loss_mask)
        # MoE losses' gradients scaled as MicroBatchLoss scales the loss, fp16's loss scale included
        apply_moe_layout(self.chunks, cfg, dims, self.optimizer.scaler.scale if self.optimizer.scaler else None)
        self.aux_free = aux_free_bias(self.chunks, cfg, dims)
        """model.moe.balance=aux_free's bias update (parallel/expert/balance.py), else None."""
        self.checkpointer.buffers = moe_buffers(self.chunks)
        self.segments = segments_of(self.chunks)
        """The blocks' document segments (data.document_mask; model/documents.py), else None."""
        self.pipeline = _pipeline(self.chunks, self.micro_loss, cfg, dims, self.segments) if dims.pp > 1 else None
        self.data, self.evaluator = self._build_data()
        self.start_step = self.checkpointer.load(resume_from)
        self.data.reader.origin = self.checkpointer.origin  # samples consumed, whatever the batch was
        if dims.rank == 0:  # checkpoint.mtbf_hours=auto counts the interruptions it shows
            history.append(cfg.run_dir, {"event": "start", "step": self.start_step})
        self.metrics = self._build_metrics()
        self.nonfinite = NonFiniteWatch(dims.device, norm_counts=t.dtype != "fp16", action=t.on_nonfinite)
        self.profiler = StepProfiler(list(t.profile), cfg.run_dir, dims.rank, dims.device)
        self.spikes = SpikeWatch(t.spike, loss_owner=dims.is_last_stage and dims.tp_rank == 0, dp_cp=dims.dp_cp,
                                 rank=dims.rank)
        self.spikes.restore(self.checkpointer.loaded_info.get("spike"))
        self.checkpointer.marker_extras["spike"] = self.spikes.state
        self.skips = SkipLog(cfg.run_dir, t.skip_steps, writer=dims.rank == 0)
        self.on_spike = SpikeResponse(t.spike, self.skips, self._say, self._rollback_choice, self._roll_back)
        self.verdict: Optional[Verdict] = None
        """The spike watch's verdict on the last step trained (None with train.spike.policy=off)."""
        self.step_s = 0.0
        """A running mean of this rank's step time (checkpoint.every=auto's unit of interval)."""

    def _build_data(self):
        """This rank's training batches (read ahead) and evaluator (None without a validation set);
        the first stage reads inputs, the last targets, the stages between nothing."""
        dims, t = self.dims, self.cfg.train
        train, val = build_readers(self.cfg, dims.dp, dims.dp_rank, dims.is_first_stage, dims.is_last_stage,
                                   dims.cp, dims.cp_rank)
        self.train_segments = self._window_segments(train)
        evaluator = None
        if val is not None and evaluates(self.cfg):
            evaluator = Evaluator(val, eval_windows(self.cfg, val.n_windows), t.eval_every, dims.device,
                                  self._window_segments(val), masked=self.cfg.data.loss_mask,
                                  group=dims.dp_cp_group if dims.dp_cp > 1 else None)
        return Prefetcher(train, dims.device, last_step=t.max_steps), evaluator

    def _window_segments(self, reader):
        """A reader's per-window document segments with data.document_mask (None without): its
        fallback to end-of-document ids, for a token file without an index, said once."""
        if self.segments is None:
            return None
        segments, notes = build_segments(reader)
        for note in notes:
            self._say(note)
        return segments

    def _build_metrics(self) -> MetricsLogger:
        """metrics.jsonl + progress line on rank 0, wandb there too when logger=wandb."""
        cfg, dims, t = self.cfg, self.dims, self.cfg.train
        rank0 = dims.rank == 0
        metrics = MetricsLogger(dims, cfg.run_dir, t.max_steps, tokens_per_step=t.global_batch_size * t.seq_len,
                                start_step=self.start_step, flops_per_token=flops_per_token(cfg.model, t.seq_len),
                                peak_tflops=resolve_peak_tflops(t.peak_tflops, dims.device, t.dtype) if rank0 else None,
                                sinks=build_sinks(cfg) if rank0 else (), prediction=self.prediction,
                                state_bytes=lambda: model_state_bytes(self.chunks, self.optimizer))
        if self.pipeline is not None:
            self.pipeline.report_to(metrics)
        self.stragglers = StragglerWatch(t, dims, (lambda: self.pipeline.clock.last_busy) if self.pipeline else None)
        metrics.add_gathered(self.stragglers)
        self.moe_stats = MoEStats(self.chunks, cfg, dims) if cfg.model.moe.num_experts else None
        if self.moe_stats is not None:
            metrics.add_reduced(self.moe_stats.read)
        return metrics

    # ------------------------------------------------------------------ one step

    def forward_backward(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
                         segments: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Run the step's micro-batches forward and backward, accumulating gradients.

        ``inputs``/``targets`` are (grad_accum, micro_batch, seq) where this rank feeds them
        (the first stage inputs, the last targets), None elsewhere; ``segments`` the same shape,
        on every rank, with data.document_mask. Returns the mean loss over micro-batches on
        ranks that compute it (the last stage), None elsewhere.
        """
        self.micro_loss.normalise(targets)
        if self.pipeline is not None:
            self.pipeline.forward_backward(inputs, targets, segments)  # checks the count of losses it records
            return self.micro_loss.losses.take_mean()
        model = self.chunks[0]
        for m in range(inputs.shape[0]):
            if self.segments is not None:
                self.segments.set(segments[m])
            self.micro_loss(model(inputs[m]), targets[m]).backward()
        return self.micro_loss.losses.take_mean(expected=inputs.shape[0])

    def forward_only(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
                     segments: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The micro-batches forward, without a gradient (evaluation): the sum of the token losses
        whose target counts (padding's ``PAD_TARGET`` does not) on ranks that compute losses,
        None elsewhere."""
        with torch.no_grad(), self.micro_loss.summing():
            if self.pipeline is not None:
                self.pipeline.forward(inputs, targets, segments)
            else:
                for m in range(inputs.shape[0]):
                    if self.segments is not None:
                        self.segments.set(segments[m])
                    self.micro_loss(self.chunks[0](inputs[m]), targets[m])
        return self.micro_loss.losses.take_sum()

    def train_step(self, step: int) -> Tuple[Optional[torch.Tensor], torch.Tensor, float]:
        inputs, targets = self.data.get(step)  # on the device, read ahead during the previous step
        segments = None if self.train_segments is None else self.train_segments(step).to(self.dims.device)
        self.optimizer.zero_grad()
        self.stragglers.start()
        loss = self.forward_backward(inputs, targets, segments)
        self.stragglers.backward_done()
        with self.metrics.comm():  # communication the backward did not overlap, and the norm's all-reduce
            self.grads.finalize()
            grad_norm = self.optimizer.clip_grad_norm(self.cfg.optim.grad_clip)
        self.stragglers.end()
        lr = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        self.verdict = self.spikes.judge(step, loss, grad_norm)
        spiked = self.verdict is not None and self.verdict.reason is not None
        if not spiked or self.cfg.train.spike.policy == "warn":
            self.optimizer.step(lr)  # a skipped update leaves weights and moments (and step_count) as they were
            if self.aux_free is not None:  # the routing bias too: it moves with the applied steps
                self.aux_free.update()
        return loss, grad_norm, lr

    # ------------------------------------------------------------------ the loop

    def train(self) -> Optional[dict]:
        """Train to train.max_steps; return rank 0's summary (None on other ranks)."""
        try:
            return self._train()
        except BaseException:
            # A save in the background finishes (or, with a peer gone, is given up) before the error ends the rank.
            with contextlib.suppress(BaseException):
                self.checkpointer.wait("stopping on an error", timeout_s=self.cfg.parallel.timeout_s)
            self.stop_signal.restore(*ON_ERROR)
            raise

    def _train(self) -> Optional[dict]:
        t = self.cfg.train
        started = time.perf_counter()
        step = self.start_step
        while step < t.max_steps:
            if step not in self.skips:
                back_to = self._step(step)
                if back_to is not None:  # rolled back: the steps from there run again (the skipped ones passed over)
                    step = back_to
                    continue
            if self._boundary(step):
                break
            step += 1
        self.profiler.close()  # a run stopped inside the window writes what it traced
        last = self.metrics.flush()
        self.optimizer.wait_params()  # the model a caller reads after training holds the last step
        self.data.close()
        self.stop_signal.restore(*TERMINAL)
        self.nonfinite.check()
        if self.stopped is not None:  # waits for a save in flight first; nothing left to overlap with
            self.save_checkpoint(self.stopped.step, background=False)
        elif self.cfg.checkpoint.save_final and self.start_step < t.max_steps:
            self.save_checkpoint(t.max_steps, background=False)
        self.checkpointer.wait("the end of training")
        if self.dims.rank == 0:
            history.append(self.cfg.run_dir, {"event": "end", "step": self.stopped.step if self.stopped else t.max_steps,
                                              "how": "stopped" if self.stopped else "finished"})
        self.metrics.summarize()
        self.metrics.close()
        self.stop_signal.close()  # only now: a SIGUSR2 in the last save is left, no requeue of a finished job
        if self.dims.rank != 0:
            return None
        done = self.stopped.step if self.stopped else t.max_steps
        return {"final_loss": last["loss"] if last else None, "steps": done - self.start_step,
                "wall_s": time.perf_counter() - started, "metrics": str(self.metrics.path),
                "stopped_at": self.stopped.step if self.stopped else None}

    def _step(self, step: int) -> Optional[int]:
        """Train ``step`` and record it; the step to go on from where it rolled back, else None."""
        self.profiler.before(step)
        started = time.perf_counter()
        with self.timeouts.warming_up(step == self.warm_step):  # the step after the first evaluation
            loss, grad_norm, lr = self.train_step(step)
        self.timeouts.to_step()  # start-up (the first step: compilation, warm-up) is over
        took = time.perf_counter() - started
        if step > self.start_step:  # the first step is start-up (compilation, warm-up), not a step's time
            self.step_s = took if self.step_s == 0.0 else 0.9 * self.step_s + 0.1 * took
        self.metrics.record(step, loss, grad_norm, lr, self.optimizer.step_metrics())
        if self.moe_stats is not None:
            self.moe_stats.record_step()
        self.nonfinite.record(step, loss, grad_norm)
        self.profiler.after(step)
        if self.verdict is not None and self.verdict.reason is not None:
            return self.on_spike.act(self.verdict)
        return None

    def _boundary(self, step: int) -> bool:
        """After ``step`` (trained or skipped), on every rank alike: evaluation, logging, the
        checkpoint, the agreed stop; True where the run stops here."""
        t = self.cfg.train
        if self.heartbeat is not None:
            self.heartbeat.step = step + 1
        if self.evaluator is not None and self.evaluator.due(step + 1):
            self.evaluate(step)
        if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
            self.metrics.flush(also=(self.nonfinite,))  # the non-finite check rides in the metrics' all-gather
        if self.checkpointer.due(step + 1):
            self.nonfinite.check()  # never a checkpoint of weights trained on a non-finite loss (checked: no collective)
            self.save_checkpoint(step + 1)
        else:
            self.checkpointer.poll()  # a save in the background that finished: noticed on every rank alike
        news = self.checkpointer.take_news()
        for report in news:
            self.metrics.record_checkpoint(report.stall_s, report.write_s)
        retuned = self.checkpointer.retune(news, self.step_s, step + 1)
        if retuned is not None:
            self._say(retuned)
        # The same on every rank (trainer3d/checkpoint/stop.py); after the last step there is nothing to stop.
        flag = self.stop_signal.agreed() if step + 1 < t.max_steps else 0
        if flag:
            self.stopped = Stop(step=step + 1, flag=flag)
        return bool(flag)

    def _rollback_choice(self, first: int):
        """train.spike.policy=rollback: the agreed checkpoint at or before step ``first``."""
        self.checkpointer.wait("a rollback")  # a save in flight is published (or fails) before any is chosen
        return agree_on_rollback(self.cfg, self.dims.rank, first)

    def _roll_back(self, choice) -> int:
        self.metrics.rewind(choice.step)
        back_to = self.checkpointer.load(choice)
        self.spikes.restore(self.checkpointer.loaded_info.get("spike"))  # the window as it was at that step
        self.nonfinite.first_bad()  # the kept steps are rerun: forgotten
        return back_to

    def _say(self, text: str) -> None:
        if self.dims.rank == 0:
            print(f"trainer3d: {text}", flush=True)

    def evaluate(self, step: int) -> None:
        """The validation loss after ``step``. The first evaluation, and the training step after
        it, run under the start-up timeout (trainer3d/parallel/timeouts.py: compilation without
        a gradient, the pipeline's shapes inferred again)."""
        first = self.warm_step is None
        with self.timeouts.warming_up(first):
            self.metrics.record_eval(step, *self.evaluator.run(self.forward_only))
        if first:
            self.warm_step = step + 1

    def save_checkpoint(self, step: int, background: Optional[bool] = None) -> None:
        """Save everything a resumed run needs to start at ``step`` (steps done); every rank calls
        it: every checkpoint.every steps (in the background with checkpoint.async_save), at the
        end, and after a preemption stop."""
        self.checkpointer.save(step, background)
