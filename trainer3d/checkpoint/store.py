"""Checkpoint directories: atomic publication, discovery, integrity checks, retention.

A checkpoint of step N is written into ``step_0000000N.partial/`` by every rank
(torch.distributed.checkpoint files plus ``.metadata``, written last by the coordinator),
then rank 0 writes ``trainer3d.json`` and renames the directory to ``step_0000000N/`` —
one atomic rename, after a barrier proves every rank finished. A reader therefore never
sees a half-written checkpoint under a final name; a crash mid-save leaves only a
``.partial`` directory, which resume ignores and the next save removes.

``is_complete`` also checks what a rename cannot promise (a disk that lost data, a flipped
bit, a file truncated or edited by hand): the marker carries the digest of every file and
its own (trainer3d/checkpoint/digest.py), the metadata pickle is read by the restricted
reader of trainer3d/checkpoint/metadata.py, and every byte range it points to must exist.
"""

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from trainer3d.checkpoint import digest
from trainer3d.checkpoint import metadata as checked_metadata
from trainer3d.config.jsonfile import parse_json


MARKER = "trainer3d.json"
MAX_MARKER_BYTES = 16 * 2 ** 20
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HEX = re.compile(r"^[0-9a-f]{16,128}$")


def checkpoint_root(cfg) -> Path:
    """Where a run's checkpoints live: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}.partial"


def read_metadata(path: Path):
    """DCP's metadata, read as trainer3d/checkpoint/metadata.py reads untrusted pickles."""
    return checked_metadata.read(path)


def _marker(path: Path) -> Tuple[Optional[dict], str]:
    """(the marker, "") if it parses, matches its own checksum and holds well-formed fields,
    else (None, why). A marker is untrusted input like the rest of the checkpoint: its seal
    proves only that it was not changed since someone sealed it."""
    try:
        data = (path / MARKER).read_bytes()
        if len(data) > MAX_MARKER_BYTES:
            return None, f"{MARKER} is larger than {MAX_MARKER_BYTES} bytes"
        info = parse_json(data, MARKER)
    except (OSError, ValueError) as err:
        return None, f"unreadable {MARKER} ({err})"
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict):
        return None, f"{MARKER} records no checksums (written by an older trainer3d, or edited)"
    if not isinstance(info.get("step"), int) or not isinstance(info.get("config", {}), dict):
        return None, f"{MARKER} has a malformed step or config"
    problem = digest.seal_problem(info) or _marker_fields_problem(path, info)
    return (None, problem) if problem else (info, "")


def _marker_fields_problem(path: Path, info: dict) -> Optional[str]:
    """Why a sealed marker's fields are not what a save writes, or None."""
    match = _STEP_DIR.match(Path(path).name)
    step = info["step"]
    if type(step) is not int or (match is not None and step != int(match.group(1))):
        return f"{MARKER} records step {step!r}, outside this checkpoint ({Path(path).name})"
    for name, entry in info["files"].items():
        if not (name == ".metadata" or checked_metadata.DATA_FILE.match(name)):
            return f"{MARKER} lists a file that is not part of a checkpoint ({name!r})"
        kind = digest.recorded_kind(entry) if isinstance(entry, dict) else None
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if kind is None or type(size) is not int or size < 0 or not _HEX.match(entry[kind]):
            return f"{MARKER} has a malformed entry for {name} (needs its byte count and a hex digest)"
    for key in ("layout", "config"):
        if key in info and not isinstance(info[key], dict):
            return f"{MARKER} has a malformed {key}"
    model = info.get("config", {}).get("model")
    if model is not None and not isinstance(model, dict):
        return f"{MARKER} has a malformed model config"
    return None


def is_complete(path: Path, verify_data: bool = True) -> Tuple[bool, str]:
    """(True, "") for a published, intact checkpoint; else (False, why).

    Intact: the marker matches its own checksum, the metadata its recorded checksum and the
    checks of trainer3d/checkpoint/metadata.py, every byte range it points to lies in a
    recorded file; with ``verify_data`` (every load) every data file matches its checksum too.
    """
    path = Path(path)
    if not _STEP_DIR.match(path.name):
        return False, "not a published checkpoint name"
    if not (path / MARKER).is_file():
        return False, f"no {MARKER} (the save did not finish)"
    info, why = _marker(path)
    if info is None:
        return False, why
    files = info["files"]
    problem = digest.file_problems(path, {".metadata": files.get(".metadata", {})}, [".metadata"])
    if problem:
        return False, problem
    try:
        metadata = read_metadata(path)
    except (OSError, checked_metadata.MetadataError) as err:
        return False, f"refused metadata: {err}"
    for info_ in metadata.storage_data.values():
        size = files.get(info_.relative_path, {}).get("bytes", -1)
        if size < info_.offset + info_.length:
            return False, f"{info_.relative_path} is missing, unrecorded or truncated"
    if verify_data:
        data = {name: d for name, d in files.items() if name != ".metadata"}
        problem = digest.file_problems(path, data, {i.relative_path for i in metadata.storage_data.values()})
        if problem:
            return False, problem
    return True, ""


def published(root: Path) -> List[Tuple[int, Path]]:
    """(step, path) of every directory with a published name, oldest first (not yet checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() for m in [_STEP_DIR.match(p.name)] if m and p.is_dir()]
    return sorted(found)


def latest_complete(root: Path, skipped: Optional[List[Tuple[Path, str]]] = None, verify_data: bool = True,
                    exclude: Iterable[Path] = ()) -> Optional[Tuple[int, Path]]:
    """The newest intact checkpoint (with ``verify_data``, its data hashed too); newer broken
    ones, and those in ``exclude`` (their data failed verification on the ranks), are skipped
    with a warning, and (path, why) of each is appended to ``skipped``."""
    excluded = {Path(p) for p in exclude}
    for step, path in reversed(published(root)):
        ok, why = (False, "its data failed verification when loading") if path in excluded else \
            is_complete(path, verify_data)
        if ok:
            return step, path
        warnings.warn(f"trainer3d: skipping checkpoint {path}: {why}", stacklevel=2)
        if skipped is not None:
            skipped.append((path, why))
    return None


def write_marker(path: Path, info: dict) -> None:
    tmp = Path(path) / (MARKER + ".tmp")
    tmp.write_text(json.dumps(digest.seal(info), indent=1, sort_keys=True))
    os.replace(tmp, Path(path) / MARKER)


def publish(partial: Path, final: Path, info: dict) -> None:
    """Rank 0, after every rank finished writing ``partial``: mark it and rename it into place.
    ``info["files"]`` holds the data files' digests; the metadata's is added here."""
    files = {**info.get("files", {}), ".metadata": digest.file_digest(Path(partial) / ".metadata")}
    write_marker(partial, {**info, "files": files})
    if final.exists():  # a re-save of the same step (e.g. after a requeue): replace it
        shutil.rmtree(final)
    os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def prune(root: Path, keep: int, known_bad: Iterable[Path] = ()) -> List[Path]:
    """Keep the newest ``keep`` good checkpoints; delete older ones and stale partial ones.

    Good: every checkpoint this engine publishes was read back intact when saved
    (trainer3d/checkpoint/writer.py); one that fails the marker/metadata/size checks now, or
    is in ``known_bad`` (its data failed verification on a load), does not count towards
    ``keep`` and is never the reason a good one is deleted; broken ones newer than the
    oldest kept good one are left in place, for inspection (resume skips them).
    """
    removed = []
    bad = {Path(p) for p in known_bad}
    good = [path for _, path in published(root) if path not in bad and is_complete(path, verify_data=False)[0]]
    oldest_kept = good[-keep] if 0 < keep <= len(good) else None
    for _, path in published(root):
        if oldest_kept is not None and path.name < oldest_kept.name:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in Path(root).glob("step_*.partial") if Path(root).is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def read_marker(path: Path) -> dict:
    """The marker's JSON (step, layout, config, file digests), if it matches its own checksum;
    else CheckpointError."""
    info, why = _marker(Path(path))
    if info is None:
        raise CheckpointError(f"checkpoint {path}: {why}")
    return info


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the knob that pointed at it."""


def require_complete(path: Path, knob: str, fix: str = "give a published step_<N> directory",
                     verify_data: bool = True) -> Path:
    """``path`` if it is a complete checkpoint whose data match their checksums (without
    ``verify_data``: whose marker, metadata and sizes do), else CheckpointError naming
    ``knob`` and the fix: the one refusal of an explicitly named checkpoint (resume, export,
    sampling)."""
    ok, why = is_complete(path, verify_data)
    if not ok:
        raise CheckpointError(f"{knob}={path} is not a usable checkpoint ({why}); {fix}")
    return Path(path)
