"""Step metrics: kept on the device between logging intervals, reduced once per interval.

Every step's loss and gradient norm stay device tensors; every ``train.log_every`` steps
(and at the end) they are stacked and gathered — the only host-device sync of the loop, and
one collective: a single all-gather of one float64 vector per rank holding the per-step values
that are summed over ranks (loss, and the columns averaged over ranks: pipeline bubble,
communication time), the per-rank figures whose maximum is written (memory), and the parts of
its riders (``add_gathered``: the straggler watch's per-rank step times; the non-finite check
passed to ``flush``). The straggler watch needs every rank's values on rank 0 anyway, so the
sums and maxima are taken from the gathered rows instead of in reductions of their own, and
the interval's bookkeeping costs one collective launch, not four.
Rank 0 then writes one JSON object per step to ``<run_dir>/metrics.jsonl``, hands the same
rows to the sinks (wandb), and prints one progress line.

Each row: step, loss, lr, grad_norm, tokens_per_s (global), tokens_per_s_per_rank,
tflops_per_rank and mfu (model FLOPs, trainer3d/model/flops.py, against ``peak_tflops``),
step_time_s, comm_s (host time in the step's communication calls, mean over ranks;
trainer3d/observe/telemetry.py says what it counts), bubble and bubble_theory (0 without a
pipeline), skipped (fp16 steps skipped on inf/nan; 0 otherwise), loss_scale (fp16 only),
and memory, the max over ranks: mem_state_bytes (parameters + gradients + optimizer state,
tensor bytes), and mem_rss_bytes on CPU or mem_allocated_bytes / mem_reserved_bytes on GPU;
rows of steps after which the model was evaluated add val_loss (the mean token loss over the
validation windows: each rank's share, summed in the loss's reduction), val_ppl =
exp(val_loss) and eval_s (rank 0's evaluation time, left out of step_time_s); the first row after a checkpoint save started adds
ckpt_stall_s (seconds the loop stood still for it: staging its state, or the whole save;
inside that row's step_time_s), the first row after its writing ended adds ckpt_write_s
(seconds the writing, hashing, read-back and publication took, in the background or not).
Goodput (trainer3d/observe/goodput.py): bubble_s, compute_s and the planner's prediction for
the run's layout (predicted_*) in every row; at the end goodput.json and a console summary.

The loss exists on the last pipeline stage only, where every tp rank holds the same value
and every dp replica its own; ranks of other stages (and tp ranks > 0) contribute zero,
so the sum over the world divided by dp is the mean over dp replicas.
"""

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, TextIO

import torch

from trainer3d.config.rows import metric_row
from trainer3d.observe.gathered import Gathered, all_gather_rows
from trainer3d.observe.goodput import Prediction, lost_before, split_step, summarize, summary_lines, write_summary
from trainer3d.observe.telemetry import CommTimer, process_memory
from trainer3d.parallel.topology import ParallelDims


CKPT_COLUMNS = ("ckpt_stall_s", "ckpt_write_s")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def mfu_text(mfu: Optional[float], peak_tflops: Optional[float]) -> str:
    """The progress line's MFU. Above 100% the peak it divides by is below the rate reached: on
    CPU ranks the peak is a matmul measured once at start-up (trainer3d/observe/telemetry.py), and
    a core shared with other processes then makes it low; or ``train.peak_tflops`` is set low."""
    if mfu is None:
        return "n/a"
    if mfu <= 1.0:
        return f"{100 * mfu:.1f}%"
    return (f">100% ({100 * mfu:.0f}% of a peak of {peak_tflops:.3g} TFLOP/s, which is low: measured at "
            "start-up under contention, or train.peak_tflops set low)")


class MetricsLogger:
    def __init__(self, dims: ParallelDims, run_dir: str, max_steps: int, tokens_per_step: int,
                 start_step: int = 0, flops_per_token: float = 0.0, peak_tflops: Optional[float] = None,
                 sinks: Sequence = (), stream: TextIO = None, state_bytes: Optional[Callable[[], int]] = None,
                 prediction: Optional[Prediction] = None):
        self.dims = dims
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.sinks = list(sinks)
        self.stream = stream or sys.stdout
        self._live = bool(getattr(self.stream, "isatty", lambda: False)())  # a terminal: rewrite one line
        self.path = Path(run_dir) / "metrics.jsonl"
        self.world_size = dims.topo.world_size
        self._steps: List[int] = []
        self._losses: List[torch.Tensor] = []
        self._norms: List[torch.Tensor] = []
        self._lrs: List[float] = []
        self._extras: List[Dict[str, torch.Tensor]] = []  # e.g. fp16's loss_scale, skipped (same on every rank)
        self._val: Dict[int, torch.Tensor] = {}  # validation loss by step (trainer3d/observe/evaluate.py)
        self._eval_s: Dict[int, float] = {}
        self._ckpt_next: Dict[str, float] = {}  # checkpoint costs for the next recorded step's row
        self._ckpt: Dict[int, Dict[str, float]] = {}
        self._interval_start = time.perf_counter()
        self._owns_loss = dims.is_last_stage and dims.tp_rank == 0
        self._zero: Optional[torch.Tensor] = None
        self.comm = CommTimer()
        """``with metrics.comm(): <a communication call>`` inside a step (trainer3d/observe/telemetry.py)."""
        self._columns: Dict[str, Callable[[], List[float]]] = {"comm_s": self.comm.pop}
        self._reduced: List[Callable[[], Dict[str, List[float]]]] = []
        self._gathered: List[Gathered] = []
        self.constants: Dict[str, float] = {"bubble": 0.0, "bubble_theory": 0.0,
                                            **(prediction.columns() if prediction else {})}
        """Values written unchanged into every row (``set_constant``: e.g. the pipeline's bubble_theory)."""
        self.prediction = prediction
        self.lost_s = 0.0
        """Work lost to restarts (trainer3d/observe/goodput.py), known on rank 0."""
        self.state_bytes: Callable[[], int] = state_bytes or (lambda: 0)
        """This rank's model-state tensor bytes (read at flush)."""
        self.last: Optional[dict] = None
        if dims.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._truncate_after(start_step)

    def _truncate_after(self, start_step: int) -> None:
        """On resume, drop rows of steps the restored run will redo (none lost, none doubled;
        their measured time is work lost to the restart: goodput.py). A line that is not a row
        (torn by a crash or a full disk mid-write) is dropped, named."""
        if not self.path.exists():
            self.lost_s = lost_before(self.path.parent, [])
            return
        kept, dropped, torn = [], [], 0
        for line in self.path.read_text(errors="replace").splitlines():
            row = metric_row(line)
            if row is None:
                torn += bool(line.strip())
            elif row["step"] < start_step:
                kept.append(line)
            else:
                dropped.append(row)
        self.lost_s = lost_before(self.path.parent, dropped)
        if torn:
            print(f"trainer3d: {self.path}: dropped {torn} line(s) that are not complete rows (a write cut "
                  "short by a crash or a full disk)", file=sys.stderr, flush=True)
        if dropped and start_step == 0:  # an earlier run's rows, and no checkpoint to continue it from
            print(f"trainer3d: {self.path}: replacing {len(dropped)} row(s) of an earlier run that left no "
                  "checkpoint (this run starts at step 0)", file=sys.stderr, flush=True)
        self.path.write_text("".join(line + "\n" for line in kept))

    def rewind(self, step: int) -> None:
        """Every rank, at a rollback to ``step``: the interval's steps written, then rank 0 drops
        the rows of ``step`` on (the steps are trained again and write their rows again)."""
        self.flush()
        if self.dims.rank == 0:
            self._truncate_after(step)

    def add_column(self, name: str, read: Callable[[], List[float]]) -> None:
        """A per-step metric averaged over all ranks: at each flush ``read()`` returns this
        rank's values for the steps recorded since the last flush (it may read the device)."""
        self._columns[name] = read
        self.constants.pop(name, None)

    def add_reduced(self, read: Callable[[], Dict[str, List[float]]]) -> None:
        """Per-step metrics their owner reduces: at each flush every rank calls ``read()`` (it may
        communicate; trainer3d/observe/moe.py), and rank 0's columns are written as they are."""
        self._reduced.append(read)

    def add_gathered(self, rider: Gathered) -> None:
        """Per-rank values that ride in the flush's all-gather (trainer3d/observe/stragglers.py):
        at each flush every rank calls ``rider.mine()``, then ``rider.take(rows)`` with every
        rank's, before rank 0 writes the rows with the columns it returns."""
        self._gathered.append(rider)

    def set_constant(self, name: str, value: float) -> None:
        """A value written unchanged into every row."""
        self.constants[name] = value

    def record(self, step: int, loss: Optional[torch.Tensor], grad_norm: torch.Tensor, lr: float,
               extra: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Keep this step's device tensors (``extra``: more per-step columns); no sync."""
        self._steps.append(step)
        if self._zero is None or self._zero.device != grad_norm.device:
            self._zero = torch.zeros((), device=grad_norm.device)  # read, never written: one for every step
        self._losses.append(loss.detach().float() if (loss is not None and self._owns_loss) else self._zero)
        self._norms.append(grad_norm.detach().float())
        self._lrs.append(lr)
        self._extras.append(extra or {})
        self.comm.end_step()
        if self._ckpt_next:
            self._ckpt[step], self._ckpt_next = self._ckpt_next, {}

    def record_checkpoint(self, stall_s: float = 0.0, write_s: Optional[float] = None) -> None:
        """A checkpoint save's cost (trainer3d/checkpoint/saver.py), written into the row of the
        next step recorded: ``ckpt_stall_s`` when it started, ``ckpt_write_s`` once its writing is
        done (the same call for a save written in the loop). Rank 0's own times; no sync."""
        for key, value in (("ckpt_stall_s", stall_s if stall_s else None), ("ckpt_write_s", write_s)):
            if value is not None:
                self._ckpt_next[key] = self._ckpt_next.get(key, 0.0) + value

    def record_eval(self, step: int, loss: Optional[torch.Tensor], seconds: float) -> None:
        """Keep step ``step``'s validation loss, this rank's share of the mean (every rank calls it at
        the same steps); no sync. Summed over the ranks in the reduction of the training loss and
        written as ``val_loss``, ``val_ppl`` and ``eval_s`` in that step's row; the ``seconds``
        it took do not count as training time."""
        kept = loss is not None and self._owns_loss
        self._val[step] = loss.detach().float() if kept else torch.zeros((), device=self._norms[-1].device)
        self._eval_s[step] = seconds
        self._interval_start += seconds

    def _per_rank(self) -> Dict[str, float]:
        return {"mem_state_bytes": float(self.state_bytes()), **process_memory(self.dims.device)}

    def flush(self, also: Sequence[Gathered] = ()) -> Optional[dict]:
        """Gather the interval's metrics and write them on rank 0; returns rank 0's last row.
        ``also``: riders of this flush's all-gather alone, taken after the rows are written (the
        non-finite check of a logging step, trainer3d/observe/nonfinite.py: it may raise)."""
        if not self._steps:
            for rider in also:  # nothing of the metrics to gather: the riders still meet
                rider.take(all_gather_rows(rider.mine()))
            return self.last
        losses = torch.stack(self._losses)
        device, n = losses.device, len(self._steps)
        val = torch.stack([self._val.get(s, torch.zeros((), device=device)) for s in self._steps])
        # Summed over ranks: (steps, 2 + columns).
        extra = [torch.tensor(read(), dtype=losses.dtype, device=device) for read in self._columns.values()]
        summed = torch.stack([losses, val, *extra], dim=1).double()
        per_rank = self._per_rank()
        peaks = torch.tensor(list(per_rank.values()), dtype=torch.float64, device=device)
        riders = [*self._gathered, *also]
        parts = [summed.flatten(), peaks, *(rider.mine().to(device=device, dtype=torch.float64) for rider in riders)]
        rows = all_gather_rows(torch.cat(parts))
        rows = list(rows.split([p.numel() for p in parts], dim=1))
        reduced = {name: values for rider, part in zip(self._gathered, rows[2:]) for name, values in rider.take(part).items()}
        reduced.update({name: values for read in self._reduced for name, values in read().items()})
        now = time.perf_counter()
        elapsed = now - self._interval_start
        self._interval_start = now
        if self.dims.rank == 0:
            packed = rows[0].sum(0).reshape(n, -1)
            losses = (packed[:, 0] / self.dims.dp_cp).tolist()  # every dp and cp rank's mean, as many tokens each
            norms = torch.stack(self._norms).tolist()
            columns = {name: (packed[:, i + 2] / self.world_size).tolist() for i, name in enumerate(self._columns)}
            # each loss-owning rank's share of the mean (trainer3d/observe/evaluate.py): they add up to it
            val = {s: v for s, v in zip(self._steps, packed[:, 1].tolist()) if s in self._val}
            columns.update(reduced)
            if self._extras[0]:
                columns.update({k: torch.stack([e[k] for e in self._extras]).tolist() for k in self._extras[0]})
            memory = dict(zip(per_rank, [int(v) for v in rows[1].amax(0).tolist()]))
            self._write(losses, norms, elapsed / n, columns, memory, val)
        self._steps, self._losses, self._norms, self._lrs, self._extras, self._val = [], [], [], [], [], {}
        for rider, part in zip(also, rows[2 + len(self._gathered):]):
            rider.take(part)
        return self.last

    def _throughput(self, step_time: float) -> Dict[str, float]:
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else float("nan")
        per_rank = tokens_per_s / self.world_size
        tflops = per_rank * self.flops_per_token / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_rank": per_rank,
                "tflops_per_rank": tflops, "mfu": mfu}

    def _write(self, losses: List[float], norms: List[float], step_time: float,
               columns: Dict[str, List[float]], memory: Dict[str, int], val: Dict[int, float]) -> None:
        throughput = self._throughput(step_time)
        rows, written = [], time.time()  # wall-clock time, unix seconds: when the interval's rows were read out
        for i, (s, loss, norm, lr) in enumerate(zip(self._steps, losses, norms, self._lrs)):
            row = {"step": s, "time": written, "loss": loss, "lr": lr, "grad_norm": norm, **throughput, "step_time_s": step_time,
                   "skipped": 0, **self.constants}
            row.update({name: values[i] for name, values in columns.items() if values[i] is not None}, **memory)
            if s in val:
                row.update(val_loss=val[s], val_ppl=math.exp(min(val[s], 700.0)), eval_s=self._eval_s.pop(s, 0.0))
            row.update(self._ckpt.pop(s, {}))
            rows.append(row)
        # step_time_s is the interval's mean: so are the parts goodput.py splits it into
        means = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in ("bubble", "comm_s", "ckpt_stall_s")}
        parts = split_step({"step_time_s": step_time, **means})
        for row in rows:
            row.update(parts)
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink.log(rows)
        self.last = rows[-1]
        evaluated = [{"val_loss": r["val_loss"], "val_ppl": r["val_ppl"]} for r in rows if "val_loss" in r]
        saves = {k: r[k] for r in rows for k in CKPT_COLUMNS if k in r}  # the interval's latest
        self._print({**rows[-1], **(evaluated[-1] if evaluated else {}), **saves},
                    skipped=sum(bool(r.get("skipped")) for r in rows))

    def progress_line(self, row: dict, skipped: int = 0) -> str:
        done = row["step"] + 1
        eta = format_duration((self.max_steps - done) * row["step_time_s"])
        loss = row["loss"]
        loss_text = f"{loss:.4f}" if math.isfinite(loss) else str(loss)
        mfu = mfu_text(row.get("mfu"), self.peak_tflops)
        return (f"step {done:>{len(str(self.max_steps))}}/{self.max_steps} | loss {loss_text} | "
                f"lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f} | "
                f"{row['tokens_per_s']:,.0f} tok/s | MFU {mfu} | {row['step_time_s']:.3f} s/step | eta {eta}"
                + (f" | val_loss {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f})" if "val_loss" in row else "")
                + (f" | loss_scale {row['loss_scale']:.0f}, {skipped} step(s) skipped" if "loss_scale" in row else "")
                + (f" | moe aux {row['moe_aux_loss']:.3f} max/mean load {row['moe_max_load']:.2f}"
                   if "moe_aux_loss" in row else "")
                + (f" | ckpt stall {row['ckpt_stall_s']:.2f} s" if "ckpt_stall_s" in row else "")
                + (f" | ckpt write {row['ckpt_write_s']:.2f} s" if "ckpt_write_s" in row else ""))

    def _print(self, row: dict, skipped: int = 0) -> None:
        line = self.progress_line(row, skipped)
        if self._live:  # a terminal: rewrite the line in place, keep the last one
            end = "\n" if row["step"] + 1 >= self.max_steps else ""
            self.stream.write("\r\x1b[2K" + line + end)
        else:  # a file (a Slurm log, submitit's stdout): plain lines, no carriage returns
            self.stream.write(line + "\n")
        self.stream.flush()

    def summarize(self) -> Optional[dict]:
        """Rank 0 at the end of training: the run's goodput against the prediction (every row of
        metrics.jsonl, restarts' lost work included), printed, written to goodput.json and handed
        to the sinks."""
        if self.dims.rank != 0:
            return None
        lines = self.path.read_text(errors="replace").splitlines() if self.path.exists() else []
        rows = [row for row in map(metric_row, lines) if row is not None and "step_time_s" in row]
        summary = summarize(rows, self.lost_s, self.prediction)
        write_summary(self.path.parent, summary)
        for line in summary_lines(summary):
            self.stream.write(line + "\n")
        self.stream.flush()
        for sink in self.sinks:
            sink.summary(summary)
        return summary

    def close(self) -> None:
        """End of training: close the sinks (wandb) on rank 0."""
        if self._live and self.last is not None and self.last["step"] + 1 < self.max_steps:
            self.stream.write("\n")
        for sink in self.sinks:
            sink.close()
        self.sinks = []
