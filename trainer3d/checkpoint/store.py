"""Checkpoint directories: atomic publication, discovery, integrity checks, retention.

A checkpoint of step N is written into ``step_0000000N.partial/`` by every rank
(torch.distributed.checkpoint files plus ``.metadata``, written last by the coordinator),
then rank 0 writes ``trainer3d.json`` and renames the directory to ``step_0000000N/`` —
one atomic rename, after a barrier proves every rank finished. A reader therefore never
sees a half-written checkpoint under a final name; a crash mid-save leaves only a
``.partial`` directory, which resume ignores and the next save removes.

``is_complete`` also checks what a rename cannot promise (a disk that lost data, a file
truncated by hand): the marker, the metadata, and that every byte range the metadata
points to exists.
"""

import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

MARKER = "trainer3d.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}.partial"


# Classes DCP's .metadata may hold; anything else in the pickle is refused (no arbitrary code).
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")
_SAFE_GLOBALS = {("torch", "Size"), ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
                 ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"),
                 ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "preserve_format"),
                 ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("torch", "device"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def read_metadata(path: Path):
    """DCP's metadata, unpickled with only DCP's own classes allowed."""
    with open(Path(path) / ".metadata", "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()


def is_complete(path: Path) -> Tuple[bool, str]:
    """(True, "") for a published, intact checkpoint; else (False, why)."""
    path = Path(path)
    if not _STEP_DIR.match(path.name):
        return False, "not a published checkpoint name"
    if not (path / MARKER).is_file():
        return False, f"no {MARKER} (the save did not finish)"
    try:
        json.loads((path / MARKER).read_text())
        metadata = read_metadata(path)
    except (OSError, ValueError, pickle.UnpicklingError, EOFError, AttributeError) as err:
        return False, f"unreadable metadata ({err})"
    sizes = {}
    for info in (metadata.storage_data or {}).values():
        file = path / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
        if sizes[info.relative_path] < info.offset + info.length:
            return False, f"{info.relative_path} is missing or truncated"
    return True, ""


def published(root: Path) -> List[Tuple[int, Path]]:
    """(step, path) of every directory with a published name, oldest first (not yet checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() for m in [_STEP_DIR.match(p.name)] if m and p.is_dir()]
    return sorted(found)


def latest_complete(root: Path) -> Optional[Tuple[int, Path]]:
    """The newest intact checkpoint; newer broken ones are skipped with a warning."""
    for step, path in reversed(published(root)):
        ok, why = is_complete(path)
        if ok:
            return step, path
        warnings.warn(f"trainer3d: skipping checkpoint {path}: {why}", stacklevel=2)
    return None


def write_marker(path: Path, info: dict) -> None:
    tmp = Path(path) / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=1, sort_keys=True))
    os.replace(tmp, Path(path) / MARKER)


def publish(partial: Path, final: Path, info: dict) -> None:
    """Rank 0, after every rank finished writing ``partial``: mark it and rename it into place."""
    write_marker(partial, info)
    if final.exists():  # a re-save of the same step (e.g. after a requeue): replace it
        shutil.rmtree(final)
    os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def prune(root: Path, keep: int) -> List[Path]:
    """Delete all but the newest ``keep`` published checkpoints and any stale partial ones."""
    removed = []
    for _, path in published(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in Path(root).glob("step_*.partial") if Path(root).is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def read_marker(path: Path) -> dict:
    """The marker's JSON: step, layout (world size included), config."""
    return json.loads((Path(path) / MARKER).read_text())


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the knob that pointed at it."""


def require_complete(path: Path, knob: str, fix: str = "give a published step_<N> directory") -> Path:
    """``path`` if it is a complete checkpoint, else CheckpointError naming ``knob`` and the fix:
    the one refusal of an explicitly named checkpoint (resume, export)."""
    ok, why = is_complete(path)
    if not ok:
        raise CheckpointError(f"{knob}={path} is not a complete checkpoint ({why}); {fix}")
    return Path(path)
