"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, as Megatron-LM's
preprocess_data.py, NeMo and GPT-NeoX write them) as untrusted input, made into a token file.

The ``.idx`` layout (Megatron-LM megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``),
little-endian:

    magic        9 bytes  b"MMIDIDX\\x00\\x00"
    version      uint64   1
    dtype code   uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    n_sequences  uint64
    n_documents  uint64   entries of document_indices (documents + 1)
    sizes        int32[n_sequences]     tokens of each sequence
    pointers     int64[n_sequences]     byte offset of each sequence in the .bin
    doc indices  int64[n_documents]     the sequence each document starts at, then n_sequences
    (a multimodal index adds int8 sequence modes: refused, there is no text in them)

The ``.bin`` holds the sequences' token ids back to back in that dtype. Nothing is trusted
before it is checked against the files: the magic, version and dtype (integer types only),
the counts against the .idx size exactly, sizes non-negative, pointers contiguous from 0 and
ending at the .bin's size, document indices rising from 0 to n_sequences; the ids are
checked against the vocabulary as they are copied (trainer3d/data/tokens.py TokenWriter).
Each document (its sequences, concatenated) is written followed by the end-of-document id
unless it already ends with it, so the token file keeps Megatron's document boundaries.
"""

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from trainer3d.data.tokens import TokenFileError, TokenHeader, TokenizerInfo, TokenWriter

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
"""Megatron's codes for integer dtypes; 6 (float64) and 7 (float32) hold no token ids."""
_HEAD = struct.Struct("<9sQBQQ")


@dataclass(frozen=True)
class MegatronIndex:
    bin: Path
    dtype: np.dtype
    sizes: np.ndarray
    pointers: np.ndarray
    doc_index: np.ndarray

    @property
    def n_documents(self) -> int:
        return len(self.doc_index) - 1


def paths(prefix) -> tuple:
    """(PREFIX.bin, PREFIX.idx) for a prefix or either file's path."""
    p = Path(prefix).expanduser()
    base = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    return base.with_name(base.name + ".bin"), base.with_name(base.name + ".idx")


def read_index(prefix) -> MegatronIndex:
    """The checked index of a Megatron dataset, or TokenFileError naming the file and the fault."""
    bin_file, idx = paths(prefix)
    for f in (bin_file, idx):
        if not f.is_file():
            raise TokenFileError(f"{f} is missing: a Megatron dataset is PREFIX.bin with PREFIX.idx")
    raw = idx.read_bytes()
    if len(raw) < _HEAD.size or raw[:9] != MAGIC:
        raise TokenFileError(f"{idx}: not a Megatron index (the file starts without the magic MMIDIDX)")
    _, version, code, n_seq, n_doc = _HEAD.unpack_from(raw)
    if version != VERSION:
        raise TokenFileError(f"{idx}: index version {version}; this reader knows version {VERSION}")
    if code not in DTYPE_CODES:
        raise TokenFileError(f"{idx}: dtype code {code} holds no token ids (integer codes: "
                             f"{', '.join(map(str, sorted(DTYPE_CODES)))})")
    expected = _HEAD.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) != expected:
        extra = " (a multimodal index with sequence modes?)" if len(raw) == expected + n_seq else ""
        raise TokenFileError(f"{idx}: {len(raw)} bytes, but {n_seq} sequences and {n_doc} document entries "
                             f"make {expected}{extra}: truncated or not this format")
    at = _HEAD.size
    sizes = np.frombuffer(raw, "<i4", n_seq, at)
    pointers = np.frombuffer(raw, "<i8", n_seq, at + 4 * n_seq)
    doc_index = np.frombuffer(raw, "<i8", n_doc, at + 12 * n_seq)
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    _check(idx, bin_file, dtype, sizes, pointers, doc_index)
    return MegatronIndex(bin_file, dtype, sizes, pointers, doc_index)


def _check(idx: Path, bin_file: Path, dtype, sizes, pointers, doc_index) -> None:
    if (sizes < 0).any():
        raise TokenFileError(f"{idx}: negative sequence sizes")
    ends = np.cumsum(sizes.astype(np.int64)) * dtype.itemsize
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    if not np.array_equal(pointers, starts):
        raise TokenFileError(f"{idx}: sequence pointers are not contiguous from 0 (a doctored or foreign index)")
    data = int(ends[-1]) if len(ends) else 0
    if data != bin_file.stat().st_size:
        raise TokenFileError(f"{bin_file}: {bin_file.stat().st_size} bytes, but its index describes {data} "
                             "(truncated, or another dataset's .bin)")
    if len(doc_index) < 1 or doc_index[0] != 0 or doc_index[-1] != len(sizes) or (np.diff(doc_index) < 0).any():
        raise TokenFileError(f"{idx}: document indices must rise from 0 to the {len(sizes)} sequences")


def documents(index: MegatronIndex) -> Iterator[np.ndarray]:
    """Each document's token ids (its sequences concatenated), read through a memory map."""
    if not len(index.sizes):
        return
    tokens = np.memmap(index.bin, dtype=index.dtype, mode="r")
    offsets = index.pointers // index.dtype.itemsize
    for first, end in zip(index.doc_index[:-1], index.doc_index[1:]):
        if end > first:
            lo = int(offsets[first])
            hi = int(offsets[end - 1] + index.sizes[end - 1])
            yield np.asarray(tokens[lo:hi])


def import_megatron(prefix, out, vocab_size: int, eos_id: int,
                    tokenizer: Optional[TokenizerInfo] = None) -> TokenHeader:
    """Write the Megatron dataset ``prefix`` as the token file ``out``: every document followed by
    ``eos_id`` (unless it ends with it). ``tokenizer``: the one that made it, when known (files
    made by different tokenizers do not blend); else an identity naming the vocabulary."""
    index = read_index(prefix)
    info = tokenizer or TokenizerInfo(name=f"megatron:{Path(prefix).name}",
                                      sha256=f"megatron-unknown-tokenizer-vocab{vocab_size}-eos{eos_id}")
    eos = np.array([eos_id], dtype=np.int64)
    with TokenWriter(out, vocab_size, info, eos_id) as writer:
        for doc in documents(index):
            writer.write(doc)
            if not len(doc) or int(doc[-1]) != eos_id:
                writer.write(eos)
    return writer.header
