"""Checkpoint files written and read back around the page cache (O_DIRECT), where the file
system allows it.

A checkpoint is written once and not read again by this process, so copying it into the
page cache is work for nothing — and on the host that runs the training it is CPU time the
loop pays for (the kernel's buffered write against O_DIRECT, CPU and wall time:
docs/checkpoints.md, measured by tools/bench/checkpoint.py). DeepSpeed's FastPersist writes checkpoints the
same way (Wang et al. 2024, "FastPersist: Accelerating Model Checkpointing in Deep
Learning", arXiv:2406.13768: O_DIRECT from page-aligned buffers).

O_DIRECT asks for aligned transfers: ``DirectFile`` collects the stream's writes in a
page-aligned buffer (an anonymous mmap) and hands the file whole buffers at aligned offsets;
the tail that does not fill a block is written after O_DIRECT is turned off for the file
(fcntl F_SETFL) and synced with it. Where the file system refuses O_DIRECT (tmpfs, some
FUSE mounts: EINVAL at open or at the first write) the file goes through the page
cache instead; nothing else changes. ``read_blocks`` reads a synced file the same way, so
the read-back of a save comes from the storage device or the file server, not memory.
"""

import errno
import fcntl
import io
import mmap
import os
from pathlib import Path
from typing import Iterator

BUFFER = 8 << 20
"""Bytes per transfer: a multiple of every logical block size (512 B - 4 KiB) and of the page."""
_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectFile(io.RawIOBase):
    """A write-only file of ``path`` (created or truncated, mode from the umask) whose bytes
    reach the storage in aligned ``BUFFER``-sized transfers; ``close`` writes the tail and syncs."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _DIRECT, 0o666)
        self._direct = bool(_DIRECT)
        self._buf = mmap.mmap(-1, BUFFER)
        self._view = memoryview(self._buf)
        self._fill = 0
        self._written = 0

    @classmethod
    def open(cls, path: Path) -> io.RawIOBase:
        """A DirectFile, or a plain buffered file where the file system refuses O_DIRECT."""
        try:
            return cls(path)
        except OSError as err:
            if err.errno != errno.EINVAL or not _DIRECT:
                raise
            return open(path, "wb")

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(BUFFER - self._fill, len(view) - done)
            self._view[self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            if self._fill == BUFFER:
                self._drain(self._view)
                self._fill = 0
        return done

    def _drain(self, block: memoryview) -> None:
        offset = 0
        while offset < len(block):
            try:
                offset += os.write(self._fd, block[offset:])
            except OSError as err:  # accepted at open, refused at the write: go through the page cache
                if err.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()
        self._written += len(block)

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_DIRECT)
        self._direct = False

    def tell(self) -> int:
        return self._written + self._fill

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Nothing: a partial block can only be written once, by ``close``."""

    def close(self) -> None:
        """Write the tail, sync, close."""
        if self.closed:
            return
        try:
            if self._fill:
                if self._direct:
                    self._buffered()  # the tail is shorter than a block
                self._drain(self._view[:self._fill])
                self._fill = 0
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing the tail (after an error: the file is left partial)."""
        if not self.closed:
            os.close(self._fd)
            super().close()


def read_blocks(path: Path) -> Iterator[memoryview]:
    """The file's bytes, block by block, read past the page cache (O_DIRECT) where the file
    system allows it, else read after its clean pages were dropped from the cache
    (POSIX_FADV_DONTNEED, posix_fadvise(2): call it on a synced file). Each view is valid
    until the next one is taken."""
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECT)
        direct = bool(_DIRECT)
    except OSError as err:
        if err.errno != errno.EINVAL or not _DIRECT:
            raise
        fd, direct = os.open(path, os.O_RDONLY), False
    buf = mmap.mmap(-1, BUFFER)  # freed with its last view, whoever holds it
    view = memoryview(buf)
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while True:
            try:
                n = os.readv(fd, [buf])
            except OSError as err:  # accepted at open, refused at the read
                if err.errno != errno.EINVAL or not direct:
                    raise
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT)
                direct = False
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                continue
            if not n:
                return
            yield view[:n]
    finally:
        os.close(fd)
