"""Checkpoint directories: publication, integrity, retention (a real DCP save on one rank)."""

import fcntl
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer3d.checkpoint.metadata import MetadataError
from trainer3d.checkpoint.writer import CheckpointWriter
from trainer3d.checkpoint.store import (is_complete, latest_complete, partial_dir, prune, publish, read_metadata,
                                        step_dir)


def _save(root, step, publish_it=True, info=None):
    """A checkpoint of one rank as the checkpointer writes one: the writer's digests in the marker."""
    partial = partial_dir(root, step)
    writer = CheckpointWriter(str(partial))
    dcp.save({"w": torch.arange(1000.0) + step, "step": torch.tensor(step)}, storage_writer=writer, no_dist=True)
    if publish_it:
        publish(partial, step_dir(root, step), {"step": step, "files": writer.digests, **(info or {})})
    return step_dir(root, step) if publish_it else partial


def test_newest_complete_is_picked_and_broken_ones_skipped(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    _save(tmp_path, 40, publish_it=False)            # crashed mid-save: only a .partial
    data = next(p for p in step_dir(tmp_path, 30).iterdir() if p.suffix == ".distcp")
    with open(data, "r+b") as f:                    # step 30's data truncated after the fact
        f.truncate(10)
    assert is_complete(step_dir(tmp_path, 20)) == (True, "")
    ok, why = is_complete(step_dir(tmp_path, 30))
    assert not ok and "bytes" in why and "were written" in why
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000030"):
        step, path = latest_complete(tmp_path)
    assert (step, path) == (20, step_dir(tmp_path, 20))
    loaded = {"w": torch.zeros(1000), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=str(path), no_dist=True)
    assert loaded["step"].item() == 20 and torch.equal(loaded["w"], torch.arange(1000.0) + 20)


def test_marker_missing_means_incomplete(tmp_path):
    path = _save(tmp_path, 5)
    os.remove(path / "trainer3d.json")
    assert not is_complete(path)[0]
    with pytest.warns(UserWarning, match="no trainer3d.json"):
        assert latest_complete(tmp_path) is None


def test_prune_keeps_newest_and_drops_partials(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    _save(tmp_path, 5, publish_it=False)
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_metadata_with_foreign_objects_is_refused(tmp_path):
    path = _save(tmp_path, 1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(MetadataError, match="posix.system, which checkpoint metadata never holds"):
        read_metadata(path)
    assert not is_complete(path)[0]


def test_markers_with_sha256_digests_are_still_checked(tmp_path):
    """A checkpoint whose marker records SHA-256 (saves before XXH3-128) loads, and a changed
    byte in it is still found: each file is checked with the digest its entry names."""
    import hashlib
    import json

    from trainer3d.checkpoint.digest import seal
    path = _save(tmp_path, 3)
    marker = json.loads((path / "trainer3d.json").read_text())
    for name, entry in marker["files"].items():
        entry.pop("xxh3_128")
        entry["sha256"] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "trainer3d.json").write_text(json.dumps(seal(marker)))
    assert is_complete(path) == (True, "")
    data = next(path.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 4
    data.write_bytes(bytes(blob))
    assert is_complete(path) == (False, f"{data.name} does not match its checksum (corrupted)")


def test_the_read_back_reads_the_storage_not_the_page_cache(tmp_path, monkeypatch):
    """The writer's read-back reads each synced file past the page cache: with O_DIRECT, or
    where the file system refuses it, after its cached pages were dropped (posix_fadvise
    DONTNEED), so the bytes hashed come from the storage."""
    reads, dropped = [], set()
    real_readv, real_fadvise = os.readv, os.posix_fadvise

    def readv(fd, buffers):
        reads.append((fd, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))))
        return real_readv(fd, buffers)

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.add(fd)
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "readv", readv)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    _save(tmp_path, 1)
    assert reads and all(direct or fd in dropped for fd, direct in reads), reads
