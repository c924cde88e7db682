"""The arithmetic of trainer3d-score (trainer3d/tools/score.py): documents, windows, summed log-losses.

A document's score is nll = -sum_i log p(x_i | x_<i of the same document) over its tokens
after its first (its end-of-document id included), in float64 from the model's fp32 log-probs.

- ``Scorer.packed``: documents of at most ``seq_len`` tokens are laid end to end in windows of
  ``seq_len`` (the rest of a window's tail is padding, one segment of its own), and the model
  attends document-masked with positions restarting at each document (trainer3d/model/
  documents.py), so each document is scored as if alone — in one forward for many short ones.
- ``Scorer.alone``: each document in its own forward with plain causal attention: the reference
  the packed scores are held to.
- A document longer than ``seq_len`` is scored alone by a sliding window in either mode (the
  strided evaluation of transformers' "Perplexity of fixed-length models" guide,
  docs/source/en/perplexity.md): windows of ``seq_len`` tokens start every ``seq_len // 2``
  tokens and each scores only the tokens the window before it did not, so every token after
  the first ``seq_len`` is predicted from at least ``seq_len // 2`` tokens of its document,
  not from all of them.
"""

from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from trainer3d.model.documents import Segments


def eos_starts(tokens, eos_id: Optional[int], block: int = 1 << 24) -> np.ndarray:
    """Document starts of ids with no index: 0 and the offset after each ``eos_id`` (read in blocks)."""
    n = len(tokens)
    found = [np.zeros(1, dtype=np.int64)]
    if eos_id is not None:
        for a in range(0, n, block):
            hits = np.flatnonzero(np.asarray(tokens[a:a + block]) == eos_id) + a + 1
            found.append(hits[hits < n].astype(np.int64))
    return np.concatenate(found)


def token_nll(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq-1) float64: -log p(ids[:, t+1] | the model's view of ids[:, :t+1])."""
    logits = model(ids)
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none")
    return nll.view(ids.shape[0], -1).double()


def sliding_windows(n: int, seq_len: int) -> Iterator[Tuple[int, int, int]]:
    """(begin, end, first target) of each window over a document of ``n`` tokens: the window holds
    tokens [begin, end) and scores targets [first, end) (a target t is predicted from t's left)."""
    stride, begin, done = max(seq_len // 2, 1), 0, 1
    while True:
        end = min(begin + seq_len, n)
        yield begin, end, done
        if end == n:
            return
        begin, done = begin + stride, end


class Scorer:
    """Scores the documents of ``tokens`` (starts: the first offset of each) under ``model``
    (eval mode, fp32, on the CPU); ``segments`` is the ``Segments`` its document-masked blocks
    read (trainer3d/model/documents.py ``apply_document_mask``), or None for plain causal attention."""

    def __init__(self, model: torch.nn.Module, tokens, starts: np.ndarray, seq_len: int,
                 segments: Optional[Segments] = None, progress: Callable[[int], None] = lambda done: None):
        self.model, self.tokens, self.seq_len, self.segments = model, tokens, seq_len, segments
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.append(self.starts[1:], len(tokens))
        self.nll = np.zeros(len(self.starts), dtype=np.float64)
        self.progress = progress

    def _ids(self, a: int, b: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.tokens[a:b], dtype=np.int64))

    def _forward(self, ids: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        if self.segments is not None:
            self.segments.set(segment_ids[None])
        return token_nll(self.model, ids[None])[0]

    def _alone(self, doc: int) -> None:
        a, n = int(self.starts[doc]), int(self.ends[doc] - self.starts[doc])
        for begin, end, first in sliding_windows(n, self.seq_len):
            if end - begin < 2:
                continue
            nll = self._forward(self._ids(a + begin, a + end), torch.zeros(end - begin, dtype=torch.int32))
            self.nll[doc] += float(nll[first - begin - 1:].sum())
        self.progress(doc + 1)

    def alone(self) -> np.ndarray:
        """Each document in its own forward(s); the per-document nll."""
        with torch.no_grad():
            for doc in range(len(self.starts)):
                self._alone(doc)
        return self.nll

    def packed(self) -> np.ndarray:
        """Documents of at most ``seq_len`` tokens packed into windows (in order; a longer one alone,
        sliding); the per-document nll. Needs ``segments``."""
        if self.segments is None:
            raise ValueError("packed scoring needs the model's document-masked attention (segments)")
        window: List[int] = []
        used = 0
        with torch.no_grad():
            for doc in range(len(self.starts)):
                n = int(self.ends[doc] - self.starts[doc])
                if n > self.seq_len:
                    self._alone(doc)
                    continue
                if used + n > self.seq_len:
                    self._window(window)
                    window, used = [], 0
                window.append(doc)
                used += n
            self._window(window)
        return self.nll

    def _window(self, docs: List[int]) -> None:
        """One forward over ``docs`` end to end, padded to ``seq_len`` with a segment of its own."""
        if not docs:
            return
        pieces = [self._ids(int(self.starts[d]), int(self.ends[d])) for d in docs]
        lengths = [len(p) for p in pieces]
        pad = self.seq_len - sum(lengths)
        ids = torch.cat(pieces + [torch.zeros(pad, dtype=torch.int64)])
        owner = torch.repeat_interleave(torch.arange(len(docs) + 1), torch.tensor(lengths + [pad]))
        nll = self._forward(ids, owner.to(torch.int32))
        same = owner[1:] == owner[:-1]  # a target of the same document (a first token is not scored)
        keep = same & (owner[1:] < len(docs))
        sums = torch.zeros(len(docs) + 1, dtype=torch.float64).index_add_(0, owner[1:][keep], nll[keep])
        self.nll[docs] += sums[:len(docs)].numpy()
        self.progress(docs[-1] + 1)
