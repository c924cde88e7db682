"""This rank's batches: only the tokens it needs, read ahead of the step that uses them.

``BatchReader.batch(step)`` returns (inputs, targets), each (grad_accum, micro_batch,
seq_len) int64, for this data-parallel rank's slice of the step's global batch (samples
``dp_rank * per_rank ...``, per_rank = micro_batch * grad_accum; trainer3d/data/sampler.py
says which windows). A rank reads only what it feeds: the first pipeline stage the inputs,
the last the targets, the stages between nothing (None); without a pipeline both. The
tensor-parallel ranks of a replica read the same tokens themselves (no broadcast needed).
With context parallelism (cp > 1) each cp rank of a replica reads the same samples but only
its two chunks of each (trainer3d/data/cp_sharding.py), so the tensors are
(grad_accum, micro_batch, seq_len / cp) and the sampler does not know about cp.

``Prefetcher`` reads step ``s + 1`` in a background thread while step ``s`` computes; on
CUDA into pinned host memory, so the copy to the device is asynchronous (``non_blocking``).
A request for another step than the one read ahead (a resume, the first step) reads it
in the foreground.

Evaluation reads whole global batches too: ``batch(b, counted=n)`` marks the targets of the
samples from ``n`` on as ``PAD_TARGET`` (every token of the window), so a last, partial
batch of the validation set keeps the step's shapes (the pipeline's micro-batches stay
equal) while its padding counts in no loss (trainer3d/parallel/tensor/loss_sum.py).

A drill (``train.inject.corrupt_steps``): those steps' windows are uniformly random ids in
``[0, vocab_size)``, each a function of the seed, the step and the global sample alone, so
every rank (tp peers, the first and the last stage, cp chunks) reads its part of the same
random batch.

A loss mask (``data.loss_mask``, trainer3d/data/loss_mask.py) is read at the targets' own
offsets, and a target it leaves out becomes ``IGNORE_INDEX``: the mask travels inside the
targets, through the pipeline's last stage, the cp chunks and the tp ranks alike. A drill's
random windows keep every target.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, List, Optional, Tuple

import numpy as np
import torch

from trainer3d.config.schema import Config
from trainer3d.data.sampler import Origin, SampleOrder, VALIDATION_KEY, step_samples
from trainer3d.data.sources import Part, plan, short_parts
from trainer3d.data.tokenfile import TokenFile
from trainer3d.data.tokens import TokenFileError
from trainer3d.data.cp_sharding import chunks_of
from trainer3d.data.loss_mask import IGNORE_INDEX, open_mask

Batch = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
PAD_TARGET = -1
"""The target of a token that counts in no loss: a padding window of evaluation's last batch."""


class BatchReader:
    """One data-parallel rank's micro-batches from token files, in a ``SampleOrder``."""

    def __init__(self, files: List[TokenFile], parts: List[Part], order: SampleOrder, micro_batch_size: int,
                 grad_accum_steps: int, dp: int, dp_rank: int, inputs: bool = True, targets: bool = True,
                 cp: int = 1, cp_rank: int = 0, corrupt: Iterable[int] = (), vocab_size: int = 0,
                 masks: Optional[List[np.ndarray]] = None):
        self.files = files
        self.tokens = [f.tokens for f in files]
        self.paths = [f.path for f in files]
        self.eos_ids = [f.header.eos_id for f in files]
        """Each source's end-of-document id (None: the file marks no document ends)."""
        self.masks = masks
        """Each file's loss mask (0/1 per token), or None: every target counts."""
        self.spans = [p.span for p in parts]
        self.order = order
        self.seq_len = parts[0].span.seq_len
        self.micro, self.accum = micro_batch_size, grad_accum_steps
        self.global_batch_size = micro_batch_size * grad_accum_steps * dp
        self.dp_rank = dp_rank
        self.origin = Origin()
        """Where ``step``'s samples are counted from: a resumed run continues after the samples
        its checkpoint consumed, whatever the global batch was then."""
        self.want_inputs, self.want_targets = inputs, targets
        # The (offset, length) pieces of each window this rank reads: the whole window, or
        # its cp rank's two chunks.
        chunk = self.seq_len // (2 * cp)
        self.pieces = [(0, self.seq_len)] if cp == 1 else [(c * chunk, chunk) for c in chunks_of(cp, cp_rank)]
        self.corrupt, self.vocab_size = frozenset(corrupt), vocab_size

    def random_window(self, step: int, sample: int) -> np.ndarray:
        """A drill's window (seq_len + 1 ids) of global sample ``sample`` of ``step``."""
        rng = np.random.default_rng([self.order.seed, step, sample])
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)

    @property
    def n_windows(self) -> int:
        """Windows over all sources (one epoch, when each is read once)."""
        return sum(span.n_windows for span in self.spans)

    def samples(self, step: int) -> np.ndarray:
        """The global sample ids of this rank's part of ``step``'s batch."""
        per_rank = self.micro * self.accum
        return step_samples(step, self.global_batch_size, self.dp_rank * per_rank, per_rank, self.origin)

    def windows(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """(source, window) of this rank's samples of ``step``."""
        return self.order(self.samples(step))

    def batch(self, step: int, counted: Optional[int] = None) -> Batch:
        """``counted``: samples from this id on are padding (their targets ``PAD_TARGET``)."""
        if not (self.want_inputs or self.want_targets):
            return None, None
        seq = self.seq_len
        first = 0 if self.want_inputs else 1  # the targets alone start one token later
        extra = 1 if self.want_inputs and self.want_targets else 0
        n = self.pieces[0][1]  # every piece has the same length
        sources, windows = self.windows(step)
        rows = np.empty((len(windows), len(self.pieces), n + extra), dtype=np.int64)
        kept = np.ones(rows.shape, dtype=bool) if self.masks is not None and self.want_targets else None
        first_sample = step * self.global_batch_size + self.dp_rank * self.micro * self.accum
        for i, (k, w) in enumerate(zip(sources.tolist(), windows.tolist())):
            tokens, start = self.tokens[k], self.spans[k].start + w * seq + first
            mask = self.masks[k] if kept is not None else None
            if step in self.corrupt:
                tokens, start, mask = self.random_window(step, first_sample + i), first, None
            for j, (offset, _) in enumerate(self.pieces):
                rows[i, j] = tokens[start + offset:start + offset + n + extra]
                if mask is not None:
                    kept[i, j] = mask[start + offset:start + offset + n + extra]
        rows = torch.from_numpy(rows).view(self.accum, self.micro, len(self.pieces), n + extra)
        local = len(self.pieces) * n
        inputs = rows[..., :n].reshape(self.accum, self.micro, local) if self.want_inputs else None
        targets = rows[..., extra:].reshape(self.accum, self.micro, local) if self.want_targets else None
        if kept is not None:
            kept = torch.from_numpy(kept[..., extra:]).reshape(self.accum, self.micro, local)
            targets = targets.masked_fill(~kept, IGNORE_INDEX)
        if targets is not None and counted is not None:
            padding = torch.from_numpy(self.samples(step) >= counted).view(self.accum, self.micro, 1)
            targets = targets.masked_fill(padding, PAD_TARGET)  # out of place: targets may be a view of the inputs
        return inputs, targets


class Prefetcher:
    """``get(step)``: a reader's batch on ``device``, the next step's read started in the background."""

    def __init__(self, reader: BatchReader, device: torch.device, last_step: int):
        self.reader, self.device, self.last_step = reader, device, last_step
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer3d-prefetch")
        self._ahead: Optional[Tuple[int, Future]] = None

    def _read(self, step: int) -> Batch:
        batch = self.reader.batch(step)
        return tuple(t.pin_memory() if (t is not None and self.pin) else t for t in batch)

    def get(self, step: int) -> Batch:
        if self._ahead is not None and self._ahead[0] == step:
            batch = self._ahead[1].result()
        else:
            if self._ahead is not None:
                self._ahead[1].cancel()
            batch = self._read(step)
        self._ahead = (step + 1, self._pool.submit(self._read, step + 1)) if step + 1 < self.last_step else None
        return tuple(t.to(self.device, non_blocking=True) if t is not None else None for t in batch)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def build_readers(cfg: Config, dp: int, dp_rank: int, inputs: bool = True, targets: bool = True,
                  cp: int = 1, cp_rank: int = 0) -> Tuple[BatchReader, Optional[BatchReader]]:
    """(training reader, validation reader or None) of data-parallel rank ``dp_rank`` (and
    context-parallel rank ``cp_rank``: its chunks of each sequence)."""
    t = cfg.train
    files = {}

    masks = {}

    def n_tokens(path):  # each file opened once; re-verified only if changed since the launch checks
        if path not in files:
            files[path] = TokenFile.open(path, cache_dir=cfg.data.cache_dir, eos_id=cfg.data.eos_id,
                                           vocab_size=cfg.model.vocab_size)
            if cfg.data.loss_mask:
                masks[path] = open_mask(path, files[path].header, cfg.data.cache_dir)
        return files[path].header.n_tokens

    train, val = plan(cfg, n_tokens)
    short = short_parts(cfg, train, val)  # checked before launch too, from the same plan
    if short:
        raise TokenFileError("; ".join(short))
    for path, opened in files.items():  # checked before launch too; this guards any other way in
        if opened.header.vocab_size > cfg.model.vocab_size:
            raise TokenFileError(f"{path}: tokenizer vocabulary {opened.header.vocab_size} > "
                                 f"model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size")

    def reader(parts: List[Part], seed: int, corrupt: Iterable[int] = ()) -> BatchReader:
        order = SampleOrder([p.span.n_windows for p in parts], [p.weight for p in parts], seed)
        return BatchReader([files[p.path] for p in parts], parts, order, t.micro_batch_size,
                           t.grad_accum_steps, dp, dp_rank, inputs, targets, cp, cp_rank,
                           corrupt=corrupt, vocab_size=cfg.model.vocab_size,
                           masks=[masks[p.path] for p in parts] if cfg.data.loss_mask else None)

    return reader(train, t.seed, t.inject.corrupt_steps), (reader(val, VALIDATION_KEY) if val else None)
