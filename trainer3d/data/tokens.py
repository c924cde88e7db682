"""Token files: a flat array of token ids (``<name>.bin``) and a JSON header beside it (``<name>.json``).

The header (``TokenHeader``; ``read_header(path)`` reads and checks it) holds:

    dtype        "uint16" (vocabularies up to 65,536) or "uint32"
    vocab_size   the tokenizer's vocabulary, special tokens included; every id is below it
    n_tokens     ids in the .bin file (its size is n_tokens * itemsize)
    max_id       the largest id present (-1 for an empty file)
    eos_id       the end-of-document id written after every document (null: none)
    tokenizer    {"name", "sha256", "path"}: sha256 is the tokenizer's identity (of its
                 tokenizer.json; of a fixed description for the built-in byte level), path
                 the tokenizer.json it was made with (null for byte level) — files made with
                 different tokenizers do not blend
    sha256       of the .bin file's bytes

Every key is required: a header without one (an older format among them) is refused with
the missing keys named and the fix, rebuilding with tools/prepare_data.py.

Files are written by ``TokenWriter`` in a stream (bounded memory, any size), which refuses
ids at or above vocab_size as they arrive and publishes the .bin and then the .json by
atomic renames. New files get the process umask's permissions, as any file a user makes.
``TokenFile.open`` (trainer3d/data/tokenfile.py) memory-maps a file after the cheap checks
(header, size) and, through ``trainer3d.data.verify``, a full scan (checksum and max id) at
most once per file version.
"""

import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from trainer3d.config.jsonfile import read_json_object

PREPARE_HINT = "rebuild it with: python tools/prepare_data.py --out <file.bin> <texts...>"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
HEADER_KEYS = ("dtype", "vocab_size", "n_tokens", "max_id", "eos_id", "tokenizer", "sha256")
TOKENIZER_KEYS = ("name", "sha256", "path")


class TokenFileError(ValueError):
    """A token file the trainer refuses; the message names the file and the fix."""


@dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer made a token file."""

    name: str
    """A readable name (the tokenizer file or directory it came from, or "byte-level")."""
    sha256: str
    """The identity compared between files: sha256 of the tokenizer's JSON."""
    path: Optional[str] = None
    """The tokenizer.json used (absolute), to load it again or copy it on export; None for byte level."""


@dataclass(frozen=True)
class TokenHeader:
    """The JSON header of a token file (see the module docstring for every key)."""

    dtype: str
    vocab_size: int
    n_tokens: int
    max_id: int
    eos_id: Optional[int]
    tokenizer: TokenizerInfo
    sha256: str

    @property
    def itemsize(self) -> int:
        return np.dtype(DTYPES[self.dtype]).itemsize

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def bin_path(path) -> Path:
    return Path(path).expanduser().with_suffix(".bin")


def header_path(path) -> Path:
    return bin_path(path).with_suffix(".json")


def dtype_for(vocab_size: int) -> str:
    if vocab_size > 2 ** 32:
        raise TokenFileError(f"vocabulary {vocab_size} does not fit uint32 token ids")
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def read_header(path) -> TokenHeader:
    """The header of token file ``path`` (.bin or .json), checked for completeness and types."""
    hpath = header_path(path)
    if not bin_path(path).exists() or not hpath.exists():
        raise TokenFileError(f"token file {bin_path(path)} (or its header {hpath.name}) not found; "
                             "make one with: python tools/prepare_data.py --out <file.bin> <texts...>")
    try:
        raw = read_json_object(hpath)
    except ValueError as err:
        raise TokenFileError(f"{err}; {PREPARE_HINT}") from None
    missing = [k for k in HEADER_KEYS if k not in raw]
    tok = raw.get("tokenizer")
    if isinstance(tok, dict):
        missing += [f"tokenizer.{k}" for k in TOKENIZER_KEYS if k not in tok]
    if missing:
        raise TokenFileError(f"{hpath}: header lacks {', '.join(missing)} (made by an older trainer3d?); "
                             f"{PREPARE_HINT}")
    ints = {k: raw[k] for k in ("vocab_size", "n_tokens", "max_id")}
    bad = [k for k, v in ints.items() if type(v) is not int] + (
        ["eos_id"] if raw["eos_id"] is not None and type(raw["eos_id"]) is not int else [])
    if raw["dtype"] not in DTYPES or bad or not isinstance(tok, dict) or not isinstance(raw["sha256"], str):
        raise TokenFileError(f"{hpath}: malformed header (dtype must be uint16/uint32, "
                             f"{', '.join(bad) or 'tokenizer/sha256'} of the wrong type); {PREPARE_HINT}")
    header = TokenHeader(dtype=raw["dtype"], vocab_size=ints["vocab_size"], n_tokens=ints["n_tokens"],
                         max_id=ints["max_id"], eos_id=raw["eos_id"], sha256=raw["sha256"],
                         tokenizer=TokenizerInfo(**{k: tok[k] for k in TOKENIZER_KEYS}))
    _check_consistent(header, hpath)
    return header


def _check_consistent(h: TokenHeader, hpath: Path) -> None:
    if h.vocab_size < 1 or h.n_tokens < 0 or h.max_id < -1 or (h.n_tokens > 0) != (h.max_id >= 0):
        raise TokenFileError(f"{hpath}: impossible header (vocab_size {h.vocab_size}, n_tokens {h.n_tokens}, "
                             f"max_id {h.max_id}); {PREPARE_HINT}")
    if h.max_id >= h.vocab_size or (h.eos_id is not None and not 0 <= h.eos_id < h.vocab_size):
        raise TokenFileError(f"{hpath}: ids up to {h.max_id} (eos {h.eos_id}) but vocab_size {h.vocab_size}: "
                             f"ids must be below the vocabulary; {PREPARE_HINT}")
    if h.dtype == "uint16" and h.vocab_size > 2 ** 16:
        raise TokenFileError(f"{hpath}: vocab_size {h.vocab_size} does not fit dtype uint16; {PREPARE_HINT}")


def _publish(tmp: Path, target: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)


def _new_temp(target: Path) -> Path:
    """A fresh temp path beside ``target``. It is created with open() by the writer, so it gets the
    umask's permissions (tempfile.mkstemp would make it 0600, readable by its owner only)."""
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


class TokenWriter:
    """Stream token ids into a token file; ``close()`` writes the header and publishes both.

        with TokenWriter("data/corpus.bin", vocab_size, tokenizer, eos_id) as out:
            out.write(ids)   # any number of times
        header = out.header

    Ids at or above ``vocab_size`` (or negative) are refused as they arrive, naming the
    file, the id and the vocabulary; nothing is published then (the temp file is removed).
    """

    def __init__(self, path, vocab_size: int, tokenizer: TokenizerInfo, eos_id: Optional[int]):
        self.path = bin_path(path)
        for target in (self.path, header_path(self.path)):
            if target.is_dir() or (target.exists() and not target.is_file()):
                raise TokenFileError(f"{target} is a directory (or another non-file) where the token file "
                                     f"{'header ' if target != self.path else ''}goes; give --out a file path")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TokenFileError(f"{self.path.parent}: cannot make the output directory ({err.strerror})") from None
        self.vocab_size, self.tokenizer, self.eos_id = int(vocab_size), tokenizer, eos_id
        self.dtype = dtype_for(self.vocab_size)
        if eos_id is not None and not 0 <= eos_id < self.vocab_size:
            raise TokenFileError(f"{self.path}: end-of-document id {eos_id} is outside the vocabulary "
                                 f"of {self.vocab_size}")
        self._tmp = _new_temp(self.path)
        self._file = open(self._tmp, "xb")
        self._hash = hashlib.sha256()
        self.n_tokens, self.max_id = 0, -1
        self.header: Optional[TokenHeader] = None

    def write(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = hi if hi >= self.vocab_size else lo
            self.abort()
            raise TokenFileError(f"{self.path}: token id {bad} is outside the vocabulary of {self.vocab_size} "
                                 "(ids must be 0 .. vocab_size-1); use the tokenizer the vocabulary belongs to, "
                                 "or a larger --vocab-size")
        data = np.ascontiguousarray(ids.astype(DTYPES[self.dtype], copy=False)).data  # a view: no bytes copy
        self._file.write(data)
        self._hash.update(data)
        self.n_tokens += ids.size
        self.max_id = max(self.max_id, hi)

    def close(self) -> TokenHeader:
        self._file.close()
        self.header = TokenHeader(dtype=self.dtype, vocab_size=self.vocab_size, n_tokens=self.n_tokens,
                                  max_id=self.max_id, eos_id=self.eos_id, tokenizer=self.tokenizer,
                                  sha256=self._hash.hexdigest())
        tmp_header = _new_temp(header_path(self.path))
        try:
            with open(tmp_header, "x") as f:
                f.write(self.header.to_json() + "\n")
            _publish(self._tmp, self.path)
            _publish(tmp_header, header_path(self.path))
        except BaseException:  # a full disk, an interrupt: no temp file stays behind
            self._tmp.unlink(missing_ok=True)
            tmp_header.unlink(missing_ok=True)
            raise
        return self.header

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_file(path, tokens, vocab_size: int, tokenizer: TokenizerInfo,
                     eos_id: Optional[int] = None) -> Path:
    """Write a whole array of ids as a token file; return the .bin path."""
    with TokenWriter(path, vocab_size, tokenizer, eos_id) as out:
        out.write(tokens)
    return out.path
