"""Checksums of a checkpoint's files and of its marker.

Every data file is hashed as DCP writes it — a wrapper around the stream sees each byte on
its way to the file — and, once the file is synced, read back from the storage (past the
page cache, trainer3d/checkpoint/direct.py, so the read is not an echo of memory): a file whose
bytes on storage differ from those written fails the save. The digests go into the marker
(trainer3d.json), which carries its own digest over everything else in it, so a flipped
byte in a weight, an optimizer moment, the metadata or the marker (model config included)
is found before a resume or an export uses the checkpoint.

XXH3-128 (the xxhash package, bindings of Yann Collet's xxHash) for the files: the
checksums guard against disks and file systems, not against someone who can also rewrite
the marker (trainer3d/checkpoint/metadata.py guards against that), so a non-cryptographic
128-bit hash is the right tool; a random corruption passes it with probability 2^-128, where
a 32-bit CRC32C would let one in 4 billion through. XXH3-128 is also the fastest of the
candidates on one core (docs/checkpoints.md, "Integrity, cheaper": XXH3-128, CRC32C, BLAKE3 and SHA-256
as tools/bench/checkpoint.py measures them); each releases the GIL while it hashes. Markers written with SHA-256 file digests (``"sha256"`` entries)
are still read and checked with SHA-256. The marker's own seal stays SHA-256: it covers a
few kilobytes of JSON.
"""

import hashlib
import io
import json
from pathlib import Path
from typing import Dict, Iterable, Optional

import xxhash

from trainer3d.checkpoint.direct import read_blocks

SEAL = "marker_sha256"
FILE_HASH = "xxh3_128"
"""The digest recorded for every file a save writes."""
_HASHES = {FILE_HASH: xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Every file digest a marker may hold (``sha256``: markers of older saves), by its key."""
_BLOCK = 8 << 20


class HashingStream(io.RawIOBase):
    """A write-only view of ``stream`` that hashes the bytes written through it, in order.
    ``digest`` is None if the stream was ever moved (the bytes then do not follow in order)."""

    def __init__(self, stream):
        super().__init__()
        self._stream, self._hash, self._moved, self.bytes = stream, _HASHES[FILE_HASH](), False, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.bytes += len(view)
        return self._stream.write(view)

    def seek(self, offset, whence=io.SEEK_SET):
        self._moved = True
        return self._stream.seek(offset, whence)

    def tell(self) -> int:
        return self._stream.tell()

    def fileno(self) -> int:
        return self._stream.fileno()

    def flush(self) -> None:
        self._stream.flush()

    @property
    def digest(self) -> Optional[str]:
        return None if self._moved else self._hash.hexdigest()


def file_digest(path: Path, kind: str = FILE_HASH, from_storage: bool = False) -> Dict[str, object]:
    """{kind: hex, "bytes": size} of the file as it is on disk now.

    ``from_storage``: read past the page cache (trainer3d/checkpoint/direct.py; call it on a
    synced file), so the bytes come from the storage device or the file server rather than
    from memory the writer just filled."""
    digest = _HASHES[kind]()
    size = 0
    if from_storage:
        for block in read_blocks(path):
            digest.update(block)
            size += len(block)
        return {kind: digest.hexdigest(), "bytes": size}
    with open(path, "rb", buffering=0) as f:
        block = bytearray(_BLOCK)
        view = memoryview(block)
        while True:
            n = f.readinto(block)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return {kind: digest.hexdigest(), "bytes": size}


def recorded_kind(recorded: dict) -> Optional[str]:
    """The digest a marker's file entry holds (``xxh3_128``, or ``sha256`` of older saves)."""
    return next((kind for kind in _HASHES if isinstance(recorded.get(kind), str)), None)


def seal(info: dict) -> dict:
    """``info`` with its own digest added (over the canonical JSON of everything else)."""
    body = {k: v for k, v in info.items() if k != SEAL}
    return {**body, SEAL: hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def seal_problem(info: dict) -> Optional[str]:
    """Why ``info`` (a parsed marker) is not intact, or None."""
    if SEAL not in info:
        return "the marker has no checksum (written by an older trainer3d, or edited)"
    if seal(info)[SEAL] != info[SEAL]:
        return "the marker does not match its checksum (corrupted or edited)"
    return None


def file_problem(path: Path, name: str, want: dict) -> Optional[str]:
    """Why file ``name`` of checkpoint ``path`` does not match its recorded digest, or None."""
    file = Path(path) / name
    kind = recorded_kind(want)
    if kind is None:
        return f"{name} has no recorded checksum"
    if not file.is_file():
        return f"{name} is missing"
    if file.stat().st_size != want.get("bytes"):
        return f"{name} has {file.stat().st_size} bytes, {want.get('bytes')} were written"
    if file_digest(file, kind)[kind] != want[kind]:
        return f"{name} does not match its checksum (corrupted)"
    return None


def file_problems(path: Path, recorded: Dict[str, dict], needed: Iterable[str]) -> Optional[str]:
    """Why the files of checkpoint ``path`` do not match ``recorded`` digests, or None.
    ``needed``: the files the checkpoint's metadata points to (each must be recorded)."""
    missing = sorted(set(needed) - set(recorded))
    if missing:
        return f"{missing[0]} has no recorded checksum"
    for name, want in sorted(recorded.items()):
        problem = file_problem(path, name, want)
        if problem:
            return problem
    return None
