"""Held-out evaluation: the validation loss every ``train.eval_every`` steps.

Each evaluation runs the same ``eval_batches`` global batches of validation windows
(trainer3d/data/sampler.py) forward only, through the same model chunks and, with pp > 1,
the same pipeline (torch's schedule ``eval``): no gradient is made, no optimizer state is
read or written, so training continues exactly as without it. Every data-parallel rank
evaluates its slice of each batch; the loss lives where the training loss does (the last
stage) and reaches rank 0 the same way (trainer3d/observe/metrics.py: ``val_loss``, ``val_ppl``).
The mean over equal micro-batches is the mean over the whole set, so the value is the
same in every layout.
"""

import time
from typing import Callable, Optional, Tuple

import torch

from trainer3d.data.loader import BatchReader


class Evaluator:
    def __init__(self, reader: BatchReader, n_batches: int, every: int, device: torch.device,
                 segments: Optional[Callable] = None):
        """``segments``: the reader's per-window document segments (data.document_mask,
        trainer3d/data/segments.py), handed to ``forward_only`` with each batch; None: none."""
        self.reader, self.n_batches, self.every, self.device = reader, n_batches, every, device
        self.segments = segments

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def run(self, forward_only: Callable) -> Tuple[Optional[torch.Tensor], float]:
        """(mean validation loss on the ranks that compute losses, None elsewhere; seconds taken).

        ``forward_only(inputs, targets)`` runs one global batch's micro-batches without a
        gradient and returns their mean loss (or None). On CUDA the time includes the
        device's work (one synchronisation per evaluation, off the training steps)."""
        started = time.perf_counter()
        losses = []
        for b in range(self.n_batches):
            inputs, targets = (t.to(self.device) if t is not None else None for t in self.reader.batch(b))
            extra = {} if self.segments is None else {"segments": self.segments(b).to(self.device)}
            loss = forward_only(inputs, targets, **extra)
            if loss is not None:
                losses.append(loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (torch.stack(losses).mean() if losses else None), time.perf_counter() - started
