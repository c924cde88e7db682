"""The build directory of one C++ source (build.py): who may build in it at a time, and whether
what it holds may be loaded into this process.

The build lock. torch's builder marks a build in progress by creating ``lock`` in the build
directory and waits, with no deadline, for that file to go away
(torch/utils/file_baton.py, ``FileBaton.wait``); a builder killed mid-build never removes it,
and every later process waits for ever. Here every builder first takes an ``flock`` on
``trainer3d.flock`` beside it: the kernel drops an flock when its holder dies, however it
dies, so a process holding it knows that no live trainer3d build is running and that a torch
``lock`` it finds was left by a dead one. The wait for the flock is bounded (``WAIT_S``); past
it the caller's fall-back runs, and the line names the lock file and its holder's pid.

Who owns it. A built library is code that runs as this process once loaded: one another user
could have written (a shared ``TORCH_EXTENSIONS_DIR``, a directory or file writable by a group)
must not be loaded. ``unsafe`` says why the directory is not this user's alone; the builder then
builds into a private fresh directory instead (pip's and ssh's rule for what they read: owned by
the user or root, not writable by others, each directory on the way).
"""

import contextlib
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Iterator, Optional

WAIT_S = 900.0
"""How long a builder waits for another process's build of the same source: a build of these
sources takes seconds, with torch's headers a few minutes on a loaded host."""
POLL_S = 0.2
LOCK_NAME = "trainer3d.flock"


class BuildBusy(RuntimeError):
    """Another live process held the build lock past ``WAIT_S``."""


@contextlib.contextmanager
def held(build_dir: Path, shared: bool = False) -> Iterator[None]:
    """Hold ``build_dir``'s flock for the block (waiting ``WAIT_S`` at most), and clear the
    torch ``lock`` a dead builder left; ``shared``: a reader's lock (many at once, none while a
    builder holds it), which leaves torch's lock alone."""
    path, wait_s = build_dir / LOCK_NAME, WAIT_S
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    raise BuildBusy(f"{path} is held by a build still running (pid {holder}) after {wait_s:.0f} s; "
                                    f"wait for it, or end that process (its lock goes with it)") from None
                time.sleep(POLL_S)
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            # Every trainer3d builder holds the flock while torch's own lock exists, so one
            # found now was left by a builder that died (torch would wait on it for ever).
            (build_dir / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # drops the flock


def _loose(st: os.stat_result, uid: int, ancestor: bool) -> Optional[str]:
    if st.st_uid not in (uid, 0) or (not ancestor and st.st_uid != uid):
        return f"is owned by uid {st.st_uid}, not this user ({uid})"
    sticky = ancestor and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
        return f"is writable by {'its group' if st.st_mode & stat.S_IWGRP else 'others'} (mode {st.st_mode & 0o7777:o})"
    return None


def unsafe(build_dir: Path) -> Optional[str]:
    """Why what ``build_dir`` holds may have been written by someone other than this user, or
    None: the directory and every file in it must be this user's and writable by no one else;
    each directory above it this user's or root's, writable by no one else unless sticky (/tmp)."""
    uid = os.geteuid()
    build_dir = build_dir.resolve()
    paths = [(p, False) for p in [build_dir, *sorted(build_dir.rglob("*"))] if not p.is_symlink()]
    paths += [(p, True) for p in build_dir.parents]
    for path, ancestor in paths:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        why = _loose(st, uid, ancestor)
        if why:
            return f"{path} {why}"
    return None
