"""Held-out evaluation: the validation loss every ``train.eval_every`` steps.

Each evaluation reads the same ``n_windows`` validation windows (trainer3d/data/sampler.py:
the validation order's first samples; all the split holds, or train.eval_steps global
batches of them) forward only, through the same model chunks and, with pp > 1, the same
pipeline (torch's schedule ``eval``): no gradient is made, no optimizer state is read or
written, so training continues exactly as without it.

The windows are read as whole global batches, ``ceil(n_windows / global_batch)`` of them;
in the last, the samples past ``n_windows`` are padding (trainer3d/data/loader.py marks their
targets), so shapes never change mid-run and no micro-batch of the pipeline is ragged. Each
rank that computes losses sums the token losses of its counted tokens
(trainer3d/parallel/tensor/loss_sum.py) and divides by the token count of the whole set,
``n_windows x seq_len``: its share of the mean. The shares of all dp and cp ranks add up (in
the metrics' one reduction, trainer3d/observe/metrics.py) to the mean token loss over exactly
those windows, whatever the layout and however the padding falls on the ranks; a rank whose
windows are all padding adds zero. With a loss mask (``data.loss_mask``) the count is the kept
tokens of the whole set instead (one all-reduce over dp x cp per evaluation), as training
divides by the global batch's kept tokens.
"""

import time
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from trainer3d.data.loader import BatchReader


class Evaluator:
    def __init__(self, reader: BatchReader, n_windows: int, every: int, device: torch.device,
                 segments: Optional[Callable] = None, masked: bool = False, group=None):
        """``segments``: the reader's per-window document segments (data.document_mask,
        trainer3d/data/segments.py), handed to ``forward_only`` with each batch; None: none.
        ``masked``: a loss mask marks targets out (data.loss_mask), so the mean's denominator is
        the kept targets, counted over ``group`` (the dp x cp group; None: this rank alone)."""
        if n_windows < 1:
            raise ValueError(f"evaluation needs a validation window, got {n_windows}")
        self.reader, self.n_windows, self.every, self.device = reader, n_windows, every, device
        self.segments, self.masked, self.group = segments, masked, group
        self.n_batches = -(-n_windows // reader.global_batch_size)
        self.n_tokens = n_windows * reader.seq_len
        """Tokens of the whole set, over every dp and cp rank: the mean's denominator."""

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def run(self, forward_only: Callable) -> Tuple[Optional[torch.Tensor], float]:
        """(this rank's share of the mean validation loss on the ranks that compute losses, None
        elsewhere; seconds taken).

        ``forward_only(inputs, targets)`` runs one global batch's micro-batches without a
        gradient and returns the sum of its counted token losses (or None). On CUDA the time
        includes the device's work (one synchronisation per evaluation, off the training steps)."""
        started = time.perf_counter()
        total, kept = None, None
        for b in range(self.n_batches):
            batch = self.reader.batch(b, counted=self.n_windows)
            inputs, targets = (t.to(self.device) if t is not None else None for t in batch)
            extra = {} if self.segments is None else {"segments": self.segments(b).to(self.device)}
            summed = forward_only(inputs, targets, **extra)
            if summed is not None:
                total = summed if total is None else total + summed
                if self.masked:
                    counted = (targets >= 0).sum()
                    kept = counted if kept is None else kept + counted
        if total is not None and self.masked:
            if self.group is not None:
                dist.all_reduce(kept, group=self.group)  # the ranks that compute losses, one stage
            total = total / kept.clamp_min(1)
        elif total is not None:
            total = total / self.n_tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return total, time.perf_counter() - started
