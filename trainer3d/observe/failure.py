"""What a failing rank says about itself: one line naming the real cause.

submitit records a rank's error only for an ``Exception``; anything else escaping the
rank — torch.distributed.checkpoint's ``CheckpointException`` is a BaseException, and it
wraps the real error of the rank that failed — left no result, so every rank read as
"killed, out of memory, or crashed outside Python". ``rank_failures`` turns whatever
escapes into ``RankFailed`` (an Exception) with a one-line headline, except SystemExit
(a rank leaving on purpose, trainer3d/rank/preemption.py).

A full disk anywhere — a checkpoint piece, metrics.jsonl, a log — reads "no space left on
device at <path>": the file the error names, else the first of the run's directories whose
file system is full.
"""

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


class RankFailed(Exception):
    """A rank's failure, its cause in one line (the original is chained as ``__cause__``)."""


def _root_cause(err: BaseException) -> BaseException:
    """DCP's CheckpointException carries each failed rank's own exception: the lowest rank's."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return _root_cause(inner)
    return err


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_full(path: str) -> bool:
    """The file system holding ``path`` is (nearly) full: after a failed write, the likely cause."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < max(16 << 20, stat.f_blocks * stat.f_frsize // 100)


def _full_dir(candidates: Sequence[str]) -> Optional[str]:
    return next((str(path) for path in candidates if is_full(path)), None)


@contextlib.contextmanager
def naming_a_full_disk(path: str):
    """A write under ``path`` that fails on a full file system raises ENOSPC naming ``path``.
    Needed where the errno is lost: torch's zip writer (torch.save, DCP's pieces) turns a short
    write into ``RuntimeError: ... unexpected pos`` (the OSError only in its unpicklable
    context), and DCP pickles each rank's error to the others. Checked at the failure, before
    anything is cleaned up and the space comes back."""
    try:
        yield
    except Exception as err:
        if isinstance(err, OSError) and err.errno in _FULL and err.filename:
            raise
        if _is_full(err) or is_full(path):  # as an OSError of its own: the errno survives DCP's pickling
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
        raise


def headline(err: BaseException, dirs: Sequence[str] = ()) -> str:
    """One line for ``err``: a full disk with its path, else ``Type: message`` of the real cause."""
    cause = _root_cause(err)
    for link in _chain(cause):
        if isinstance(link, OSError) and link.errno in _FULL:
            where = link.filename or _full_dir(dirs) or "(path unknown)"
            return f"{_FULL[link.errno]} at {where}"
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def rank_failures(dirs: Sequence[str] = ()):
    """Re-raise what escapes a rank as RankFailed(headline), so submitit records it; SystemExit passes."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as err:  # noqa: B902 - CheckpointException, KeyboardInterrupt, ... must be reported
        if isinstance(err, Exception) and not _is_full(err):
            raise  # submitit records it as it is; its own last line is already the cause
        raise RankFailed(headline(err, dirs)) from err


def _is_full(err: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _FULL for e in _chain(_root_cause(err)))
