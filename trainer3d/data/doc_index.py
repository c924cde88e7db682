"""A token file's document index: where each document starts, written beside the ids.

An end-of-document id marks a boundary only as long as no document holds that id itself
(a chat template's ``<|endoftext|>``, a tokenizer that matches special tokens inside text),
so tools/prepare_data.py records the boundaries it writes, as Megatron-LM's ``.idx`` does
(megatron/core/datasets/indexed_dataset.py, ``document_indices``). For token file
``NAME.bin`` (header ``NAME.json``):

    NAME.docs       int64 little-endian, one per document: the offset of its first token
                    in NAME.bin (the first is 0, each larger than the one before, all below
                    n_tokens; the end-of-document id after a document belongs to it)
    NAME.docs.json  {"format": 1, "n_documents", "n_tokens", "tokens_sha256", "sha256"}:
                    tokens_sha256 is the token header's sha256 (the index belongs to exactly
                    that version of the ids), sha256 is of NAME.docs' bytes

``read_doc_index`` checks all of it on every open (8 bytes a document, a small fraction of a
token file's scan) and refuses a mismatch naming the file and the fix. A Megatron-LM dataset
read in place has its boundaries from its own ``.idx`` (``DocumentStream.offsets``); a token
file without an index (made before the index existed) falls back to the end-of-document id:
``document_starts`` says which, and the windows' segments (trainer3d/data/segments.py) use it.
"""

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from trainer3d.config.jsonfile import read_json_object
from trainer3d.data.tokens import TokenFileError, TokenHeader, _new_temp, _publish, bin_path

FORMAT = 1
INDEX_KEYS = ("format", "n_documents", "n_tokens", "tokens_sha256", "sha256")


def index_path(path) -> Path:
    return bin_path(path).with_suffix(".docs")


def index_header_path(path) -> Path:
    return bin_path(path).with_suffix(".docs.json")


class DocIndexWriter:
    """Stream document starts (``add``), then ``close(header)`` publishes NAME.docs and its JSON,
    bound to the token file's header (written first: its sha256 is the binding)."""

    def __init__(self, path):
        self.path = index_path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)  # as TokenWriter makes it, whichever opens first
        self._tmp = _new_temp(self.path)
        self._file = open(self._tmp, "xb")
        self._hash = hashlib.sha256()
        self.n_documents, self._last = 0, -1

    def add(self, starts) -> None:
        starts = np.asarray(starts, dtype="<i8")
        if not starts.size:
            return
        if int(starts[0]) <= self._last or (starts.size > 1 and (np.diff(starts) <= 0).any()):
            raise ValueError(f"{self.path}: document starts must rise")
        data = starts.tobytes()
        self._file.write(data)
        self._hash.update(data)
        self.n_documents += starts.size
        self._last = int(starts[-1])

    def close(self, header: TokenHeader) -> None:
        self._file.close()
        meta = {"format": FORMAT, "n_documents": self.n_documents, "n_tokens": header.n_tokens,
                "tokens_sha256": header.sha256, "sha256": self._hash.hexdigest()}
        tmp_meta = _new_temp(index_header_path(self.path))
        try:
            with open(tmp_meta, "x") as f:
                f.write(json.dumps(meta, indent=1) + "\n")
            _publish(self._tmp, self.path)
            _publish(tmp_meta, index_header_path(self.path))
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            tmp_meta.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def write_doc_index(path, starts, header: TokenHeader) -> Path:
    """Write a whole array of document starts as ``path``'s index; return NAME.docs."""
    writer = DocIndexWriter(path)
    try:
        writer.add(starts)
        writer.close(header)
    except BaseException:
        writer.abort()
        raise
    return writer.path


def has_doc_index(path) -> bool:
    return index_header_path(path).exists() or index_path(path).exists()


def read_doc_index(path, header: TokenHeader) -> np.ndarray:
    """The checked document starts of token file ``path`` (whose header is ``header``)."""
    data, meta_path = index_path(path), index_header_path(path)
    fix = f"rebuild the token file and its index with tools/prepare_data.py, or delete {data.name} and " \
          f"{meta_path.name} to fall back to end-of-document ids"
    if not data.is_file() or not meta_path.is_file():
        raise TokenFileError(f"{bin_path(path)}: its document index is incomplete ({data.name} and {meta_path.name} "
                             f"go together); {fix}")
    try:
        meta = read_json_object(meta_path)
    except ValueError as err:
        raise TokenFileError(f"{err}; {fix}") from None
    missing = [k for k in INDEX_KEYS if k not in meta]
    if missing or meta["format"] != FORMAT or any(type(meta[k]) is not int for k in ("n_documents", "n_tokens")):
        raise TokenFileError(f"{meta_path}: not a document index of format {FORMAT} "
                             f"(missing or malformed: {', '.join(missing) or 'format/counts'}); {fix}")
    if meta["tokens_sha256"] != header.sha256 or meta["n_tokens"] != header.n_tokens:
        raise TokenFileError(f"{meta_path}: made for other ids than {bin_path(path).name}'s (its tokens_sha256 or "
                             f"n_tokens differ from the header's): the token file was rewritten without it; {fix}")
    raw = data.read_bytes()
    if len(raw) != 8 * meta["n_documents"] or hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise TokenFileError(f"{data}: {len(raw)} bytes whose sha256 does not match {meta_path.name} "
                             f"({meta['n_documents']} documents): truncated or changed; {fix}")
    starts = np.frombuffer(raw, dtype="<i8")
    if not starts.size or starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= header.n_tokens:
        raise TokenFileError(f"{data}: document starts must rise from 0 below n_tokens={header.n_tokens}; {fix}")
    return starts


def document_starts(token_file, eos_id: Optional[int] = None) -> Optional[np.ndarray]:
    """The document starts of an opened ``TokenFile``: its index, a Megatron dataset's own
    boundaries, or None where only end-of-document ids mark them (a legacy token file)."""
    offsets = getattr(token_file.tokens, "offsets", None)  # a Megatron DocumentStream
    if offsets is not None:
        return np.asarray(offsets[:-1], dtype=np.int64)
    if not has_doc_index(token_file.path):
        return None
    return read_doc_index(token_file.path, token_file.header)
