"""Step metrics: kept on the device between logging intervals, reduced once per interval.

Every step's loss and gradient norm stay device tensors; every ``train.log_every`` steps
(and at the end) they are stacked and reduced to rank 0 in one collective — the only
host-device sync of the loop. Rank 0 then writes one JSON object per step to
``<run_dir>/metrics.jsonl`` and prints one progress line.

The loss exists on the last pipeline stage only, where every tp rank holds the same value
and every dp replica its own; ranks of other stages (and tp ranks > 0) contribute zero,
so the sum over the world divided by dp is the mean over dp replicas.
"""

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from trainer3d.topology import ParallelDims


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsLogger:
    def __init__(self, dims: ParallelDims, run_dir: str, max_steps: int, tokens_per_step: int,
                 start_step: int = 0):
        self.dims = dims
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.path = Path(run_dir) / "metrics.jsonl"
        self._steps: List[int] = []
        self._losses: List[torch.Tensor] = []
        self._norms: List[torch.Tensor] = []
        self._lrs: List[float] = []
        self._extras: List[Dict[str, torch.Tensor]] = []  # e.g. fp16's loss_scale, skipped (same on every rank)
        self._interval_start = time.perf_counter()
        self._owns_loss = dims.is_last_stage and dims.tp_rank == 0
        self._columns: Dict[str, Callable[[], List[float]]] = {}
        self.constants: Dict[str, float] = {}
        """Values written unchanged into every row (e.g. the pipeline's bubble_theory)."""
        self.last: Optional[dict] = None
        if dims.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._truncate_after(start_step)

    def _truncate_after(self, start_step: int) -> None:
        """On resume, drop rows of steps the restored run will redo (none lost, none doubled)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] < start_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def add_column(self, name: str, read: Callable[[], List[float]]) -> None:
        """A per-step metric averaged over all ranks: at each flush ``read()`` returns this
        rank's values for the steps recorded since the last flush (it may read the device)."""
        self._columns[name] = read

    def record(self, step: int, loss: Optional[torch.Tensor], grad_norm: torch.Tensor, lr: float,
               extra: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Keep this step's device tensors (``extra``: more per-step columns); no sync."""
        self._steps.append(step)
        zero = torch.zeros((), device=grad_norm.device)
        self._losses.append(loss.detach().float() if (loss is not None and self._owns_loss) else zero)
        self._norms.append(grad_norm.detach().float())
        self._lrs.append(lr)
        self._extras.append(extra or {})

    def flush(self) -> Optional[dict]:
        """Reduce the interval's metrics to rank 0 and write them; returns rank 0's last row."""
        if not self._steps:
            return self.last
        packed = torch.stack(self._losses)
        if self._columns:  # one reduce for all: (steps, 1 + columns)
            extra = [torch.tensor(read(), dtype=packed.dtype, device=packed.device) for read in self._columns.values()]
            packed = torch.stack([packed, *extra], dim=1)
        dist.reduce(packed, dst=0)
        now = time.perf_counter()
        elapsed, n = now - self._interval_start, len(self._steps)
        self._interval_start = now
        if self.dims.rank == 0:
            losses = ((packed[:, 0] if self._columns else packed) / self.dims.dp).tolist()
            norms = torch.stack(self._norms).tolist()
            columns = {name: (packed[:, i + 1] / dist.get_world_size()).tolist()
                       for i, name in enumerate(self._columns)}
            if self._extras[0]:
                columns.update({k: torch.stack([e[k] for e in self._extras]).tolist() for k in self._extras[0]})
            self._write(losses, norms, elapsed / n, columns)
        self._steps, self._losses, self._norms, self._lrs, self._extras = [], [], [], [], []
        return self.last

    def _write(self, losses: List[float], norms: List[float], step_time: float,
               columns: Dict[str, List[float]]) -> None:
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else float("nan")
        rows = [{"step": s, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens_per_s,
                 "step_time_s": step_time}
                for s, loss, norm, lr in zip(self._steps, losses, norms, self._lrs)]
        for i, row in enumerate(rows):
            row.update({name: values[i] for name, values in columns.items()}, **self.constants)
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self.last = rows[-1]
        self._print(rows[-1], skipped=sum(bool(r.get("skipped")) for r in rows))

    def _print(self, row: dict, skipped: int = 0) -> None:
        done = row["step"] + 1
        eta = format_duration((self.max_steps - done) * row["step_time_s"])
        loss = row["loss"]
        loss_text = f"{loss:.4f}" if math.isfinite(loss) else str(loss)
        print(f"step {done:>{len(str(self.max_steps))}}/{self.max_steps} | loss {loss_text} | "
              f"lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f} | "
              f"{row['tokens_per_s']:,.0f} tok/s | {row['step_time_s']:.3f} s/step | eta {eta}"
              + (f" | loss_scale {row['loss_scale']:.0f}, {skipped} step(s) skipped" if "loss_scale" in row else ""),
              file=sys.stdout, flush=True)
