"""Documents from the inputs of tools/prepare_data.py, streamed: text files, directories, JSON Lines.

Inputs are files or directories (walked recursively for the given suffixes, symlinked
sub-directories followed once each; a token file's own header, data, trained tokenizer or
Megatron index found there is left out, as are this run's outputs); a file may be
compressed with gzip or zstd (the suffix before ``.gz``/``.zst`` decides its kind). What a file
holds is decided by its first bytes, not its name: gzip and zstd streams are decompressed
whatever the suffix, a ``.gz``/``.zst`` file that is not one is refused, and so is any other
compressed or archive format (xz, bzip2, lz4, zip, 7z, tar) and any file with NUL bytes in its
first block — a binary file tokenised as text would train on garbage. A corrupt compressed
stream is refused naming the file. A text file is one document; each line of a JSON Lines
file (``.jsonl``) is one, its text under ``text_key``.

Memory: a JSON Lines record is read whole, so one is at most ``MAX_RECORD_BYTES`` (longer
ones are refused naming file and line). Byte-level preparation in one process holds about
four times its largest record at most (its text, the text's UTF-8 bytes, the 2-byte ids;
tests/tools/test_prepare_inputs.py measures it); with ``--workers N`` add the up to 2 N
batches in flight (trainer3d/data/prepare.py), each holding at least one record.

Nothing is read whole: a text file comes in pieces of at most ``PIECE_BYTES``, cut just
after a newline that precedes a non-space character (where byte-level pre-tokenizers such
as GPT-2's cut anyway, so the tokens do not change), or failing that at a UTF-8 character
boundary. Each piece says whether it ends its document (an end-of-document id follows).
"""

import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, List, Sequence, Tuple, Union

import zstandard

from trainer3d.data.megatron import MAGIC
from trainer3d.data.tokens import TokenFileError, read_header

PIECE_BYTES = 4 << 20
MAX_RECORD_BYTES = 64 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUPPORTED = {".gz": b"\x1f\x8b", ".zst": b"\x28\xb5\x2f\xfd"}
"""Compression read here: suffix -> the magic bytes its stream starts with."""
UNSUPPORTED = {"xz": b"\xfd7zXZ\x00", "bzip2": b"BZh", "lz4": b"\x04\x22\x4d\x18", "zip": b"PK\x03\x04",
               "7z": b"7z\xbc\xaf\x27\x1c", "lzma": b"\x5d\x00\x00"}
"""Formats recognised by their magic bytes and refused (decompress them first)."""
COMPRESSION_SUFFIXES = (*SUPPORTED, ".xz", ".bz2", ".lz4", ".zip", ".7z", ".lzma", ".tar", ".tgz")


class InputError(ValueError):
    """An input prepare_data cannot read; the message names the file (and line)."""


@dataclass
class Piece:
    text: Union[bytes, str]
    ends_document: bool


def kind_suffix(path: Path) -> str:
    """The suffix that says what a file holds, under any compression suffix (a.jsonl.gz -> .jsonl)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


TRAINED_TOKENIZER_SUFFIX = ".tokenizer.json"
"""What --train-tokenizer saves beside a token file: ``<out>.tokenizer.json``."""


SIDE_SUFFIXES = (TRAINED_TOKENIZER_SUFFIX, ".docs.json", ".docs", ".mask.json", ".mask")
"""What a token file NAME.bin has beside it: a tokenizer trained for it, its document index
(trainer3d/data/doc_index.py ``index_path``), its loss mask (trainer3d/data/loss_mask.py ``mask_path``)."""


def token_file_output(path: Path) -> bool:
    """``path`` is a token file's own (its header or its data, as ``read_header`` accepts them,
    a side file of one, or a Megatron-LM index by its magic), not text to tokenise: a
    directory holding an earlier output would otherwise feed it back in as documents."""
    name = path.name
    side = next((s for s in SIDE_SUFFIXES if name.endswith(s)), None)
    stem = path.with_name(name[:-len(side)]) if side else path
    if stem.suffix in (".json", ".bin") or stem is not path:
        try:
            read_header(stem)
            return True
        except (TokenFileError, OSError, ValueError):
            pass
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _walk(root: Path) -> Iterator[Path]:
    """Files under ``root``, following symlinked directories; a directory reached twice (a link
    cycle, or two links to one place) is walked once."""
    seen = set()
    for here, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(here)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()
        yield from (Path(here) / n for n in names)


def collect(inputs: Sequence[str], suffixes: Sequence[str], outputs: Sequence[Path] = ()) -> List[Path]:
    """The input files, sorted (reproducible output): given files, and files under given
    directories (symlinked sub-directories followed), each file once. Left out of a
    directory: ``outputs`` (what this run writes) and any token file's own files
    (``token_file_output``); a given file that is one of ``outputs`` is refused."""
    own = {Path(p).resolve() for p in outputs}
    files = {}
    for item in map(Path, inputs):
        if item.is_dir():
            for p in _walk(item):
                if (p.is_file() and kind_suffix(p) in suffixes and p.resolve() not in own
                        and not token_file_output(p)):
                    files.setdefault(p.resolve(), p)
        elif item.is_file():
            if item.resolve() in own:
                raise InputError(f"{item} is an output of this run (--out); give another --out or leave it out")
            files.setdefault(item.resolve(), item)
        else:
            raise InputError(f"{item} does not exist")
    return sorted(files.values())


class Progress:
    """Bytes read from the inputs as stored on disk (compressed bytes for compressed files)."""

    def __init__(self, files: Sequence[Path]):
        self.total = sum(f.stat().st_size for f in files)
        self.done_files = 0
        self._raw: BinaryIO = None

    @property
    def read(self) -> int:
        return self.done_files + (self._raw.tell() if self._raw is not None and not self._raw.closed else 0)


def _format(path: Path, head: bytes) -> str:
    """The compression of ``path`` from its first bytes ("" for none); InputError if unsupported."""
    found = next((suffix for suffix, magic in SUPPORTED.items() if head.startswith(magic)), None)
    if found:
        return found
    refused = next((name for name, magic in UNSUPPORTED.items() if head.startswith(magic)), None)
    if refused is None and len(head) > 262 and head[257:262] == b"ustar":
        refused = "tar"
    if refused is None and path.suffix in COMPRESSION_SUFFIXES:
        refused = f"{path.suffix[1:]} (by its name; its bytes are not a gzip or zstd stream)"
    if refused is None and b"\0" in head:
        refused = "binary (NUL bytes in its first block)"
    if refused:
        raise InputError(f"{path}: {refused} data, which prepare_data does not read as text; give plain text, "
                         "JSON Lines, or gzip/zstd-compressed ones")
    return ""


def _open(path: Path, progress: Progress) -> Tuple[BinaryIO, BinaryIO]:
    """(raw file, decompressed stream)."""
    raw = open(path, "rb")
    try:
        kind = _format(path, raw.peek(4096)[:4096] if hasattr(raw, "peek") else b"")
    except InputError:
        raw.close()
        raise
    progress._raw = raw
    if kind == ".gz":
        return raw, gzip.GzipFile(fileobj=raw)
    if kind == ".zst":
        return raw, io.BufferedReader(_Zstd(raw))
    return raw, raw


open_input = _open
"""(raw file, decompressed stream) of an input, its compression checked (trainer3d/data/chat.py reads
conversations through it)."""


class _Zstd(io.RawIOBase):
    """The decompressed bytes of zstd frames (one or more, concatenated) read from ``raw``. A
    stream cut short raises EOFError (zstandard's own stream reader returns what it decoded
    and no error). Input is fed in small blocks, so one call's output stays small."""

    BLOCK = 16 << 10

    def __init__(self, raw: BinaryIO):
        super().__init__()
        self._raw, self._obj, self._out, self._started = raw, zstandard.ZstdDecompressor().decompressobj(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            block = self._raw.read(self.BLOCK)
            if not block:
                if self._started and not self._obj.eof:
                    raise EOFError("the zstd stream ends inside a frame (truncated)")
                return 0
            if self._obj.eof:  # the previous frame ended with the previous block
                self._obj = zstandard.ZstdDecompressor().decompressobj()
            self._started, out = True, self._obj.decompress(block)
            while self._obj.eof and self._obj.unused_data:  # the next frame starts in this block
                rest, self._obj = self._obj.unused_data, zstandard.ZstdDecompressor().decompressobj()
                out += self._obj.decompress(rest)
            self._out = out
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]
        return n


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
    number = 0
    while True:
        line = stream.readline(MAX_RECORD_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_RECORD_BYTES:
            raise InputError(f"{path}:{number}: a record longer than {MAX_RECORD_BYTES} bytes; split the document "
                             "into records of at most that size")
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError as err:
            raise InputError(f"{path}:{number}: not JSON ({err})") from None
        except RecursionError:
            raise InputError(f"{path}:{number}: nested too deeply to be a record") from None
        line = None  # not held while the record's text is encoded
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise InputError(f"{path}:{number}: no string under key {text_key!r} (choose the key with --text-key)")
        record = None
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
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as err:
            raise InputError(f"{path}: cannot read, corrupt or truncated ({err})") from None
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
