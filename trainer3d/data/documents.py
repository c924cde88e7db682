"""Documents from the inputs of tools/prepare_data.py, streamed: text files, directories, JSON Lines.

Inputs are files or directories (walked recursively for the given suffixes); a file may be
compressed (``.gz``, ``.zst``: the suffix before it decides its kind). A text file is one
document; each line of a JSON Lines file (``.jsonl``) is one, its text under ``text_key``.

Nothing is read whole: a text file comes in pieces of at most ``PIECE_BYTES``, cut just
after a newline that precedes a non-space character (where byte-level pre-tokenizers such
as GPT-2's cut anyway, so the tokens do not change), or failing that at a UTF-8 character
boundary. Each piece says whether it ends its document (an end-of-document id follows).
"""

import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, List, Sequence, Tuple, Union

PIECE_BYTES = 4 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class InputError(ValueError):
    """An input prepare_data cannot read; the message names the file (and line)."""


@dataclass
class Piece:
    text: Union[bytes, str]
    ends_document: bool


def kind_suffix(path: Path) -> str:
    """The suffix that says what a file holds, under any compression suffix (a.jsonl.gz -> .jsonl)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in (".gz", ".zst"):
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def collect(inputs: Sequence[str], suffixes: Sequence[str]) -> List[Path]:
    """The input files, sorted (reproducible output): given files, and files under given directories."""
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            files.extend(p for p in item.rglob("*") if p.is_file() and kind_suffix(p) in suffixes)
        elif item.is_file():
            files.append(item)
        else:
            raise InputError(f"{item} does not exist")
    return sorted(files)


class Progress:
    """Bytes read from the inputs as stored on disk (compressed bytes for compressed files)."""

    def __init__(self, files: Sequence[Path]):
        self.total = sum(f.stat().st_size for f in files)
        self.done_files = 0
        self._raw: BinaryIO = None

    @property
    def read(self) -> int:
        return self.done_files + (self._raw.tell() if self._raw is not None and not self._raw.closed else 0)


def _open(path: Path, progress: Progress) -> Tuple[BinaryIO, BinaryIO]:
    """(raw file, decompressed stream)."""
    raw = open(path, "rb")
    progress._raw = raw
    if path.suffix == ".gz":
        return raw, gzip.GzipFile(fileobj=raw)
    if path.suffix == ".zst":
        import zstandard
        return raw, zstandard.ZstdDecompressor().stream_reader(raw)
    return raw, raw


def _cut(buffer: bytes) -> int:
    """Where to cut a full buffer: after the last newline followed by a non-space byte, else
    before the last character's first byte (so no UTF-8 character is split)."""
    end = len(buffer) - 1
    while True:
        i = buffer.rfind(b"\n", 0, end)
        if i < 0:
            break
        if buffer[i + 1] not in b" \t\r\n\x0b\x0c":
            return i + 1
        end = i
    start = len(buffer) - 1
    while start > 0 and (buffer[start] & 0xC0) == 0x80:  # UTF-8 continuation bytes
        start -= 1
    return start or len(buffer)


def _text_pieces(stream: BinaryIO) -> Iterator[Piece]:
    pending = b""
    while True:
        block = stream.read(PIECE_BYTES - len(pending))
        if not block:
            yield Piece(pending, True)
            return
        pending += block
        if len(pending) >= PIECE_BYTES:
            cut = _cut(pending)
            yield Piece(pending[:cut], False)
            pending = pending[cut:]


def _jsonl_pieces(stream: BinaryIO, path: Path, text_key: str) -> Iterator[Piece]:
    for number, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8", errors="replace"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise InputError(f"{path}:{number}: not JSON ({err})") from None
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise InputError(f"{path}:{number}: no string under key {text_key!r} (choose the key with --text-key)")
        yield Piece(text, True)


def documents(files: Sequence[Path], text_key: str, progress: Progress) -> Iterator[Piece]:
    """Every input's documents, as pieces, in order."""
    for path in files:
        raw, stream = _open(path, progress)
        try:
            if kind_suffix(path) in JSONL_SUFFIXES:
                yield from _jsonl_pieces(stream, path, text_key)
            else:
                yield from _text_pieces(stream)
        except (OSError, EOFError) as err:
            raise InputError(f"{path}: cannot read ({err})") from None
        finally:
            stream.close()
            raw.close()
            progress.done_files += os.path.getsize(path)
            progress._raw = None


def batched(pieces: Iterator[Piece], batch_bytes: int) -> Iterator[List[Piece]]:
    """Pieces grouped into batches of about ``batch_bytes`` (the unit of work of an encoding worker)."""
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
