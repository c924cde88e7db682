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
Each document (its sequences, concatenated) is followed by the end-of-document id unless it
already ends with it, so the tokens keep Megatron's document boundaries as a token file of
tools/prepare_data.py keeps its own; an empty document adds nothing. Two ways in:

- ``import_megatron`` (tools/import_megatron.py) writes that stream as a token file, and its
  document starts as the token file's document index;
- ``open_in_place`` reads it from the dataset itself (``data.path=PREFIX`` with
  ``data.eos_id``): ``DocumentStream`` slices the memory-mapped .bin and puts the
  end-of-document ids in, so training reads exactly the tokens the import would write. It
  holds 17 bytes per document (where each starts in the .bin and in the stream, and whether
  an id follows it); for a corpus of hundreds of millions of documents, import it instead.
  The ids are checked against the vocabulary by one scan of the .bin, done once per version
  of the files (its result kept in ``data.cache_dir`` as trainer3d/data/verify.py keeps its).
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Tuple

import numpy as np

from trainer3d.data.doc_index import DocIndexWriter
from trainer3d.data.tokens import TokenFileError, TokenHeader, TokenizerInfo, TokenWriter, dtype_for
from trainer3d.data.verify import CHUNK_BYTES, locked_record, record_path

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
            if hi > lo:  # an empty document adds nothing
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
    starts = DocIndexWriter(out)  # Megatron's boundaries, kept (trainer3d/data/doc_index.py)
    try:
        with TokenWriter(out, vocab_size, info, eos_id) as writer:
            for doc in documents(index):
                starts.add([writer.n_tokens])
                writer.write(doc)
                if int(doc[-1]) != eos_id:
                    writer.write(eos)
        starts.close(writer.header)
    except BaseException:
        starts.abort()
        raise
    return writer.header


def is_megatron(path) -> bool:
    """Whether ``path`` (a prefix, or its .bin or .idx) names a Megatron dataset: PREFIX.idx is
    there and no token-file header (PREFIX.json) is."""
    bin_file, idx = paths(path)
    return idx.is_file() and not bin_file.with_suffix(".json").exists()


class DocumentStream:
    """A Megatron dataset's documents as one stream of ids, each document followed by ``eos_id``
    unless it ends with it; ``stream[a:b]`` reads only the documents it covers from the .bin."""

    def __init__(self, index: MegatronIndex, eos_id: int):
        self.eos_id = eos_id
        self.raw = np.memmap(index.bin, dtype=index.dtype, mode="r") if index.bin.stat().st_size else np.zeros(0)
        offsets = index.pointers // index.dtype.itemsize
        first, end = index.doc_index[:-1], index.doc_index[1:]
        first, end = first[end > first], end[end > first]  # documents with sequences
        starts, ends = offsets[first], offsets[end - 1] + index.sizes[end - 1]
        keep = ends > starts
        self.starts = starts[keep].astype(np.int64)  # where each non-empty document starts in the .bin
        lengths = ends[keep] - self.starts
        last = self.raw[self.starts + lengths - 1] if len(lengths) else np.zeros(0, dtype=np.int64)
        self.eos_after = last != eos_id  # an end-of-document id goes after it
        self.offsets = np.concatenate([[0], np.cumsum(lengths + self.eos_after)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_documents(self) -> int:
        return len(self.starts)

    def __getitem__(self, window: slice) -> np.ndarray:
        lo, hi, step = window.indices(len(self))
        if step != 1:
            raise ValueError("DocumentStream reads contiguous slices only")
        out = np.empty(max(0, hi - lo), dtype=np.int64)
        doc = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        at = lo
        while at < hi:
            begin, length = int(self.offsets[doc]), int(self.offsets[doc + 1] - self.offsets[doc] - self.eos_after[doc])
            inside = at - begin
            if inside < length:  # ids of the document
                take = min(length - inside, hi - at)
                out[at - lo:at - lo + take] = self.raw[self.starts[doc] + inside:self.starts[doc] + inside + take]
                at += take
            else:  # the end-of-document id after it
                out[at - lo] = self.eos_id
                at += 1
            if at >= self.offsets[doc + 1]:
                doc += 1
        return out


def id_range(index: MegatronIndex, cache_dir: Optional[str]) -> Tuple[int, int]:
    """(smallest, largest) id in the .bin ((0, -1) if empty): one scan, kept per version of both files."""
    if cache_dir is None:
        return _scan(index)
    stats = _stats(index)
    record = record_path(Path(cache_dir).expanduser(), index.bin.resolve())
    try:
        with locked_record(record):
            try:
                known = json.loads(record.read_text())
                if known.get("megatron") == stats:
                    return int(known["min_id"]), int(known["max_id"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
            lo, hi = _scan(index)
            if _stats(index) == stats:  # not rewritten while it was read: the result may be kept
                record.write_text(json.dumps({"megatron": stats, "min_id": lo, "max_id": hi}))
            return lo, hi
    except OSError:  # a cache this process cannot write: scan every time rather than never
        return _scan(index)


def _scan(index: MegatronIndex) -> Tuple[int, int]:
    if not index.bin.stat().st_size:
        return 0, -1
    raw = np.memmap(index.bin, dtype=index.dtype, mode="r")
    step = max(1, CHUNK_BYTES // index.dtype.itemsize)
    lo, hi = None, None
    for i in range(0, len(raw), step):  # one pass, a chunk in memory at a time
        chunk = np.asarray(raw[i:i + step])
        lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
        hi = int(chunk.max()) if hi is None else max(hi, int(chunk.max()))
    return lo, hi


def _stats(index: MegatronIndex) -> list:
    """(path, size, mtime) of the .bin and the .idx: a version of the dataset."""
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in (index.bin, paths(index.bin)[1])]


def open_in_place(path, eos_id: Optional[int], vocab_size: int,
                  cache_dir: Optional[str]) -> Tuple[TokenHeader, DocumentStream]:
    """(a token-file header, the token stream) of the Megatron dataset ``path``, checked: the
    index against both files, every id below ``vocab_size`` (the model's), ``eos_id`` given."""
    bin_file, idx = paths(path)
    if eos_id is None:
        raise TokenFileError(f"{idx}: a Megatron-LM dataset, whose files do not record the end-of-document id; "
                             "set data.eos_id=<the id of its tokenizer's end-of-document token> (GPT-2's is 50256)")
    if not 0 <= eos_id < vocab_size:
        raise TokenFileError(f"{idx}: data.eos_id={eos_id} is outside model.vocab_size={vocab_size}")
    index = read_index(path)
    low, top = id_range(index, cache_dir)
    if top >= vocab_size or low < 0:
        raise TokenFileError(f"{bin_file}: token ids from {low} to {top}, but model.vocab_size={vocab_size} (ids must "
                             "be 0 .. vocab_size-1): set model.vocab_size to the vocabulary of the tokenizer that made it")
    stream = DocumentStream(index, eos_id)
    if not len(stream):
        raise TokenFileError(f"{bin_file} holds no tokens (an empty Megatron dataset)")
    vocab_note = f"megatron-unknown-tokenizer-vocab{vocab_size}-eos{eos_id}"  # as tools/import_megatron.py names it
    header = TokenHeader(dtype=dtype_for(vocab_size), vocab_size=vocab_size, n_tokens=len(stream),
                         max_id=max(top, eos_id), eos_id=eos_id, sha256="",
                         tokenizer=TokenizerInfo(name=f"megatron:{bin_file.with_suffix('').name}", sha256=vocab_note))
    return header, stream
