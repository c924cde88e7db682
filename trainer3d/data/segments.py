"""Which document each input token of a window belongs to, for ``data.document_mask``.

A window's segments are small ints, one per input token: 0 for the document the window
starts in, +1 at each document that starts inside it (``(grad_accum, micro_batch, seq)``
int32 per step, like the inputs). The model makes of them its attention mask and its
positions (trainer3d/model/documents.py): a token attends to the earlier tokens of its own
segment only, and positions restart at 0 at each segment, so also at the window's start, as
Megatron-LM's ``reset_position_ids`` / ``reset_attention_mask`` do
(megatron/core/datasets/gpt_dataset.py, ``_get_ltor_masks_and_position_ids``).

Boundaries come from the token file's document index (trainer3d/data/doc_index.py), a
Megatron dataset's own ``.idx``, or, for a token file without an index, the
end-of-document id (a document starts after each one). They are read from the index and,
for the fallback, from the window's ids, so every rank (a pipeline's middle stages, which
read no tokens, among them) has its step's segments without a broadcast.
"""

from typing import List, Optional, Tuple

import numpy as np
import torch

from trainer3d.data.doc_index import document_starts


def window_segments(starts: Optional[np.ndarray], tokens, start: int, seq: int,
                    eos_id: Optional[int]) -> np.ndarray:
    """Segments of the ``seq`` input tokens from offset ``start``: from ``starts`` (the
    document starts of the file) or, without them, after each ``eos_id`` among the tokens."""
    if starts is not None:
        docs = np.searchsorted(starts, np.arange(start, start + seq), side="right")
        return (docs - docs[0]).astype(np.int32)
    out = np.zeros(seq, dtype=np.int32)
    if eos_id is not None:
        out[1:] = np.cumsum(np.asarray(tokens[start:start + seq - 1]) == eos_id)
    return out


class WindowSegments:
    """``segments(step)``: the (grad_accum, micro_batch, seq) int32 segments of a reader's
    samples of ``step`` (trainer3d/data/loader.py ``BatchReader``; whole windows, under cp too:
    each cp rank takes its chunks' share in the model)."""

    def __init__(self, reader, starts: List[Optional[np.ndarray]], eos_ids: List[Optional[int]]):
        self.reader, self.starts, self.eos_ids = reader, starts, eos_ids

    def __call__(self, step: int) -> torch.Tensor:
        r, seq = self.reader, self.reader.seq_len
        sources, windows = r.windows(step)
        out = np.zeros((len(windows), seq), dtype=np.int32)
        if step not in r.corrupt:  # a drill's random ids hold no documents: one segment each
            for i, (k, w) in enumerate(zip(sources.tolist(), windows.tolist())):
                start = r.spans[k].start + w * seq
                out[i] = window_segments(self.starts[k], r.tokens[k], start, seq, self.eos_ids[k])
        return torch.from_numpy(out).view(r.accum, r.micro, seq)


def build_segments(reader) -> Tuple[WindowSegments, List[str]]:
    """The segments of ``reader``'s windows, and one line for each file whose boundaries are
    end-of-document ids (a token file without a document index)."""
    starts, eos_ids, notes = [], [], []
    for f in reader.files:
        found = document_starts(f)
        starts.append(found)
        eos_ids.append(f.header.eos_id)
        if found is None:
            notes.append(f"{f.path}: no document index beside it (made before trainer3d-prepare-data wrote one); "
                         f"document boundaries taken from its end-of-document id {f.header.eos_id} "
                         "(rebuild it with trainer3d-prepare-data for exact ones)")
    return WindowSegments(reader, starts, eos_ids), notes
