"""Checkpoint directories: publication, integrity, retention (a real DCP save on one rank)."""

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
