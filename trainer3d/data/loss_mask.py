"""A token file's loss mask: which tokens a run with ``data.loss_mask=true`` trains on.

``trainer3d-prepare-data --chat`` writes it beside the token file ``<name>.bin``:

    <name>.mask        one uint8 per token of the .bin, 1 where the token is trained on (an
                       assistant's token), 0 elsewhere (system, user, the template's own text)
    <name>.mask.json   its header: n_tokens, kept (the count of ones), train_on ("assistant" or
                       "all"), sha256 (of the .mask bytes) and tokens_sha256, the sha256 of the
                       token file it belongs to (its header's)

Mask ``m[i]`` is about token ``i`` as a target: the loss of the position that predicts token
``i`` counts where ``m[i] = 1`` (trainer3d/data/loader.py reads it at the targets' offsets).
Opening it checks what is cheap every time (the header, the size, the token file it belongs to)
and scans the data once per version of the file (checksum, values 0/1, the count of ones),
remembered as trainer3d/data/verify.py remembers a token file's scan. Targets the mask leaves
out become ``IGNORE_INDEX`` in the batch, which the loss skips (parallel/tensor/loss.py).
"""

import hashlib
import json
import os
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from trainer3d.config.jsonfile import read_json_object
from trainer3d.data.tokens import TokenFileError, TokenHeader, bin_path
from trainer3d.data.verify import CHUNK_BYTES, locked_record, record_path

IGNORE_INDEX = -100
"""A target the loss skips (torch's ``F.cross_entropy`` default ``ignore_index``)."""
MASK_HINT = "make the token file and its mask with: trainer3d-prepare-data --chat --tokenizer <dir> --out <file.bin> " \
            "<conversations.jsonl>"
KEYS = ("n_tokens", "kept", "train_on", "sha256", "tokens_sha256")


def mask_path(token_path) -> Path:
    return bin_path(token_path).with_suffix(".mask")


def mask_header_path(token_path) -> Path:
    return bin_path(token_path).with_suffix(".mask.json")


@dataclass(frozen=True)
class MaskHeader:
    n_tokens: int
    kept: int
    train_on: str
    sha256: str
    tokens_sha256: str


class MaskWriter:
    """Stream a loss mask (0/1 per token) to a temp file; ``publish(tokens_sha256)`` writes the
    header and renames both into place (after the token file is published: its checksum is named)."""

    def __init__(self, token_path, train_on: str):
        self.path, self.train_on = mask_path(token_path), train_on
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "xb")
        self._hash = hashlib.sha256()
        self.n_tokens = self.kept = 0

    def write(self, mask: np.ndarray) -> None:
        data = np.ascontiguousarray(mask, dtype=np.uint8)
        self._file.write(data.data)
        self._hash.update(data.data)
        self.n_tokens += data.size
        self.kept += int(data.sum())

    def publish(self, tokens_sha256: str) -> MaskHeader:
        self._file.close()
        header = MaskHeader(self.n_tokens, self.kept, self.train_on, self._hash.hexdigest(), tokens_sha256)
        tmp_header = self._tmp.with_suffix(".json.tmp")
        try:
            tmp_header.write_text(json.dumps(asdict(header), indent=1) + "\n")
            os.replace(self._tmp, self.path)
            os.replace(tmp_header, mask_header_path(self.path))
        except BaseException:
            self.abort()
            tmp_header.unlink(missing_ok=True)
            raise
        return header

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def read_mask_header(token_path, tokens: TokenHeader) -> MaskHeader:
    """The mask header beside ``token_path``, checked against the token file's header."""
    hpath, mpath = mask_header_path(token_path), mask_path(token_path)
    if not hpath.is_file() or not mpath.is_file():
        raise TokenFileError(f"data.loss_mask=true but {bin_path(token_path)} has no loss mask ({mpath.name} and "
                             f"{hpath.name} beside it); {MASK_HINT}, or set data.loss_mask=false")
    try:
        raw = read_json_object(hpath)
        header = MaskHeader(**{k: raw[k] for k in KEYS})
    except (KeyError, TypeError, ValueError) as err:
        raise TokenFileError(f"{hpath}: not a loss mask header ({err}); {MASK_HINT}") from None
    if header.tokens_sha256 != tokens.sha256 or header.n_tokens != tokens.n_tokens:
        raise TokenFileError(f"{mpath} belongs to another version of {bin_path(token_path)} (its header names "
                             f"{header.n_tokens} tokens of sha256 {str(header.tokens_sha256)[:12]}..., the token "
                             f"file holds {tokens.n_tokens} of {tokens.sha256[:12]}...); {MASK_HINT}")
    if mpath.stat().st_size != header.n_tokens:
        raise TokenFileError(f"{mpath} is {mpath.stat().st_size} bytes, its header says {header.n_tokens} "
                             f"(one per token): truncated or changed; {MASK_HINT}")
    return header


def _scan(path: Path, header: MaskHeader) -> None:
    digest, kept, bad = hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            values = np.frombuffer(chunk, dtype=np.uint8)
            kept += int(values.sum(dtype=np.int64))
            bad += int((values > 1).sum())
    if digest.hexdigest() != header.sha256 or bad or kept != header.kept:
        raise TokenFileError(f"{path}: its data does not match its header (sha256, values 0/1, {header.kept} ones): "
                             f"corrupted or changed after it was written; {MASK_HINT}")


def verify_mask(path: Path, header: MaskHeader, cache_dir: Optional[str]) -> None:
    """The full scan of a mask, at most once per version (path, size, mtime) under ``cache_dir``."""
    path = Path(path).resolve()
    if cache_dir is None:
        return _scan(path, header)
    record = record_path(Path(cache_dir).expanduser(), path)
    with ExitStack() as stack:
        try:
            stack.enter_context(locked_record(record))
        except OSError:  # a cache this process cannot write: scan every time rather than never
            return _scan(path, header)
        st = path.stat()
        want = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": header.sha256}
        try:
            if json.loads(record.read_text()) == want:
                return None
        except (OSError, ValueError):
            pass
        _scan(path, header)
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(want))
            os.replace(tmp, record)
        except OSError:
            tmp.unlink(missing_ok=True)
    return None


def open_mask(token_path, tokens: TokenHeader, cache_dir: Optional[str], verify: bool = True) -> np.ndarray:
    """The loss mask of the token file ``token_path``, checked and memory-mapped (read-only)."""
    header = read_mask_header(token_path, tokens)
    if verify:
        verify_mask(mask_path(token_path), header, cache_dir)
    return np.memmap(mask_path(token_path), dtype=np.uint8, mode="r", shape=(header.n_tokens,))
