"""The full check of a token file's data, done at most once per version of the file.

A header can lie (hand-edited, or a file changed after it was written): the scan reads
the .bin once, in chunks, and compares its sha256 and its largest id with the header's.
The result is kept under ``<cache_dir>/verified/`` keyed by the file's absolute path,
size and modification time, so the next run — and every rank of this one — re-checks
only those (a ``stat``); a file rewritten since then is scanned again. A lock on the
record serialises the scan, so ranks that open an unchecked file at the same time (e.g.
every task of a user's own ``srun``) scan it once between them.

The scan's cost, once per file, is in docs/data.md.
"""

import fcntl
import hashlib
import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from trainer3d.data.tokens import DTYPES, PREPARE_HINT, TokenFileError, TokenHeader

CHUNK_BYTES = 64 << 20


def scan(path: Path, dtype: str) -> Tuple[str, int, int]:
    """(sha256, max id or -1, ids) of a token file's data, reading it once in chunks."""
    digest, max_id, n = hashlib.sha256(), -1, 0
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                break
            digest.update(chunk)
            ids = np.frombuffer(chunk[: len(chunk) - len(chunk) % itemsize], dtype=DTYPES[dtype])
            if ids.size:
                max_id = max(max_id, int(ids.max()))
            n += ids.size
    return digest.hexdigest(), max_id, n


def record_path(cache_dir: Path, path: Path) -> Path:
    return cache_dir / "verified" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


@contextmanager
def locked_record(record: Path):
    """Hold an exclusive lock on ``record``; raises OSError where the cache cannot be written."""
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fingerprint(path: Path, header: TokenHeader) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": header.sha256,
            "max_id": header.max_id}


def _check(path: Path, header: TokenHeader) -> None:
    digest, max_id, _ = scan(path, header.dtype)
    if max_id != header.max_id:
        raise TokenFileError(f"{path} holds ids up to {max_id}, its header says max_id {header.max_id}: "
                             f"the file or its header was changed after it was written; {PREPARE_HINT}")
    if digest != header.sha256:
        raise TokenFileError(f"{path}: sha256 of the data does not match its header: the file is corrupted or "
                             f"was changed after it was written; {PREPARE_HINT}")


def verify_token_file(path: Path, header: TokenHeader, cache_dir: Optional[str]) -> None:
    """Raise TokenFileError unless ``path``'s data matches ``header`` (a full scan unless this
    version of the file — path, size, mtime — was verified before)."""
    path = Path(path).resolve()
    if cache_dir is None:
        _check(path, header)
        return
    record = record_path(Path(cache_dir).expanduser(), path)
    with ExitStack() as stack:
        try:
            stack.enter_context(locked_record(record))
        except OSError:  # a cache this process cannot write: verify every time rather than never
            _check(path, header)
            return
        _verify_once(path, header, record)


def _verify_once(path: Path, header: TokenHeader, record: Path) -> None:
    """Under the record's lock: done if the record vouches for this version, else scan and record."""
    want = _fingerprint(path, header)
    try:
        if json.loads(record.read_text()) == want:
            return
    except (OSError, ValueError):
        pass
    _check(path, header)
    if _fingerprint(path, header) != want:  # changed while it was read: do not vouch for it
        raise TokenFileError(f"{path} changed while it was being verified; try again once it is written")
    tmp = record.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(want))
        os.replace(tmp, record)
    except OSError:  # verified, but it cannot be remembered (a full disk): the next open scans again
        tmp.unlink(missing_ok=True)
