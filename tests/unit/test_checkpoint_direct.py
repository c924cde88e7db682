"""Checkpoint files past the page cache (trainer3d/checkpoint/direct.py): the bytes on disk are
the bytes written, whatever the chunking; the file really is opened with O_DIRECT where the
file system allows it; a file system that refuses it at the first write still gets the file."""

import errno
import fcntl
import os
import random

import pytest

from trainer3d.checkpoint import direct
from trainer3d.checkpoint.digest import FILE_HASH, HashingStream, file_digest

SIZES = [1, 4095, 4097, direct.BUFFER - 3, 7, direct.BUFFER, 2 * direct.BUFFER + 511, 12345]
"""Writes crossing block and buffer boundaries; the total is not a multiple of a block."""


def _payload() -> list:
    rng = random.Random(0)
    return [rng.randbytes(n) for n in SIZES]


def _write(path) -> bytes:
    chunks = _payload()
    f = direct.DirectFile.open(path)
    for chunk in chunks:
        assert f.write(chunk) == len(chunk)
    assert f.tell() == sum(SIZES)
    f.close()
    return b"".join(chunks)


def test_the_file_holds_every_byte_written_and_reads_back_the_same(tmp_path):
    path = tmp_path / "f.distcp"
    want = _write(path)
    assert path.read_bytes() == want
    assert b"".join(bytes(b) for b in direct.read_blocks(path)) == want
    assert file_digest(path, from_storage=True) == file_digest(path)


def test_the_file_is_written_with_o_direct_where_the_file_system_allows_it(tmp_path):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    f = direct.DirectFile.open(tmp_path / "f")
    if not isinstance(f, direct.DirectFile):
        pytest.skip("this file system refuses O_DIRECT")
    flags = int(next(line for line in open(f"/proc/self/fdinfo/{f.fileno()}") if line.startswith("flags:")).split()[1], 8)
    f.close()
    assert flags & os.O_DIRECT


def test_a_refusal_at_the_first_write_goes_through_the_page_cache(tmp_path, monkeypatch):
    real_write, refused = os.write, []

    def write(fd, data):  # a file system that takes O_DIRECT at open and refuses it at a write
        if direct._DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & direct._DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", write)
    path = tmp_path / "f"
    want = _write(path)
    assert path.read_bytes() == want
    if direct._DIRECT and isinstance(direct.DirectFile.open(tmp_path / "g"), direct.DirectFile):
        assert refused  # the O_DIRECT path was taken, refused, and left


def test_the_digest_on_the_way_equals_the_digest_of_the_file(tmp_path):
    path = tmp_path / "f"
    f = direct.DirectFile.open(path)
    hashing = HashingStream(f)
    for chunk in _payload():
        hashing.write(chunk)
    f.close()
    assert (hashing.digest, hashing.bytes) == (file_digest(path)[FILE_HASH], path.stat().st_size)


def test_an_error_leaves_the_tail_unwritten_and_the_descriptor_closed(tmp_path):
    path = tmp_path / "f"
    f = direct.DirectFile.open(path)
    if not isinstance(f, direct.DirectFile):
        pytest.skip("this file system refuses O_DIRECT")
    f.write(b"x" * 100)
    fd = f.fileno()
    f.abort()
    assert path.stat().st_size == 0
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_refusal_at_open_writes_through_the_page_cache(tmp_path, monkeypatch):
    if not direct._DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def refusing(path, flags, *args):  # a file system without O_DIRECT (EINVAL at open)
        if flags & direct._DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", refusing)
    path = tmp_path / "f"
    f = direct.DirectFile.open(path)
    assert not isinstance(f, direct.DirectFile)
    chunks = _payload()
    hashing = HashingStream(f)
    for chunk in chunks:
        hashing.write(chunk)
    hashing.flush()
    f.close()
    assert path.read_bytes() == b"".join(chunks)
    assert (hashing.digest, hashing.bytes) == (file_digest(path)[FILE_HASH], path.stat().st_size)
