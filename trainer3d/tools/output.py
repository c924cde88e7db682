"""Where a tool's output goes: one check and one way to publish it, shared by every tool.

- ``check`` before anything is read or written: an output is never one of the tool's inputs,
  never inside one, and never holds one; a file where a directory goes (or the reverse), a
  link to nothing, or a parent that is a file is refused in one line naming the path and the
  fix (``OutputError``; the tool prints it and exits 2, no traceback).
- ``new_file`` and ``new_dir``: the output is written into a fresh temporary beside the
  target (same file system, so the publishing rename is atomic) and published only once whole;
  a failure removes the temporary. A reader sees the earlier output or the new one, never a
  torn file or a mix of two.
- A directory that already holds something is refused unless the tool's ``--force`` is given;
  then the new directory takes its place in one ``renameat2(RENAME_EXCHANGE)`` (rename(2);
  where the kernel lacks it, two renames, with a moment in which the path is absent but never
  mixed) and the earlier one is deleted. Merging into it is never done: the project's own
  readers follow an index file, and an earlier export's index would point at stale shards.
"""

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


class OutputError(ValueError):
    """One line: the path, what is wrong with it, and what to do."""


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check(out, inputs: Iterable = (), directory: bool = False, force: bool = False) -> Path:
    """``out`` (expanded) if a tool may write it; else raise ``OutputError``. ``inputs``: every
    path the tool reads (files or directories); ``directory``: the output is a directory (one
    that holds something is refused unless ``force``)."""
    out = Path(out).expanduser()
    if out.is_symlink() and not out.exists():
        raise OutputError(f"{out} is a link to {os.readlink(out)}, which does not exist; remove the link "
                          f"or give another path")
    if out.exists() and directory and not out.is_dir():
        raise OutputError(f"{out} is a file where the output directory goes; give a directory path")
    if out.exists() and not directory and not out.is_file():
        raise OutputError(f"{out} is a directory where the output file goes; give a file path")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{parent} is a file, so {out} cannot be made under it; give another path")
            break
    real = out.resolve()
    for given in inputs:
        inp = Path(given).expanduser()
        if not inp.exists():
            continue
        inp = inp.resolve()
        same = out.exists() and os.path.samefile(out, inp)
        if same or real == inp:
            raise OutputError(f"{out} is also an input of this command; write the output elsewhere")
        if _within(real, inp):
            raise OutputError(f"{out} lies inside the input {inp}; write the output outside it")
        if directory and _within(inp, real):
            raise OutputError(f"{out} holds the input {inp}, which writing it would replace; "
                              f"write the output elsewhere")
    if directory and out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError(f"{out} already holds files (an earlier output?); give --force to replace it whole, "
                          f"or another directory")
    return out


def _mode() -> int:
    """The mode a plain ``mkdir`` would give (mkdtemp's is 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


@contextlib.contextmanager
def new_file(out: Path) -> Iterator[Path]:
    """A fresh temporary path beside ``out``, published as ``out`` when the block ends cleanly."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, _mode() & 0o666)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    return fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def publish_dir(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an earlier ``out`` is replaced whole and deleted."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(tmp, out)  # over an empty directory too (rename(2))
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp)  # now the earlier output
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.replace(out, old / out.name)
    os.replace(tmp, out)
    shutil.rmtree(old)


@contextlib.contextmanager
def new_dir(out: Path) -> Iterator[Path]:
    """A fresh empty directory beside ``out``, published as ``out`` (replacing an earlier one
    whole: ``check`` has refused that unless forced) when the block ends cleanly."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    os.chmod(tmp, _mode())
    try:
        yield tmp
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
