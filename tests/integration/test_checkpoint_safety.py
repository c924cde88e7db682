"""Untrusted and damaged checkpoints: nothing in one runs code, a changed byte is found
before anything uses it, a checkpoint of another model is refused before launch.

Checkpoints here are written by the engine's own writer (digests in the marker) on one
rank, with the default model's config in the marker; the refusals go through the paths a
user takes — ``trainer3d.train.run`` (explicit path and ``auto``, in the submitting
process), tools/export_model.py — and every one must be one line, with no side effect.
"""

import copy
import copyreg
import dataclasses
import io
import os
import pickle
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.test_validate import make
from trainer3d.tools import export_model
from trainer3d import train
from trainer3d.checkpoint import metadata as checked
from trainer3d.checkpoint import store
from trainer3d.checkpoint.choose import model_changes
from trainer3d.checkpoint.reader import CheckpointReader, TensorOnlyLoadPlanner
from trainer3d.checkpoint.writer import CheckpointWriter
from trainer3d.config.schema import ModelConfig

_CFG = make()


def _save(root, step, model=None, optim=None):
    partial = store.partial_dir(root, step)
    writer = CheckpointWriter(str(partial))
    dcp.save({"model.w": torch.arange(4000.0) + step, "optim.step": torch.tensor(step)}, storage_writer=writer,
             no_dist=True)
    config = {"model": dataclasses.asdict(model or ModelConfig())}
    if optim is not None:
        config["optim"] = {"name": optim}
    store.publish(partial, store.step_dir(root, step), {"step": step, "files": writer.digests, "config": config})
    return store.step_dir(root, step)


def _cfg(**train):
    cfg = copy.deepcopy(_CFG)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _s(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _call(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: STACK_GLOBAL module.name, then call it with (arg,) (REDUCE)."""
    return b"\x80\x04" + _s(module) + _s(name) + b"\x93" + _s(arg) + b"\x85R."


def _payloads(sentinel):
    cmd = f"touch {sentinel}"
    fs = "torch.distributed.checkpoint.filesystem"
    props = b"\x80\x04" + _s("torch.distributed.checkpoint.metadata") + _s("TensorProperties") + b"\x93)\x81"
    return {
        "a callable reached through a DCP module": _call(fs, "os.system", cmd),
        "another DCP module": _call("torch.distributed.checkpoint.metadata", "torch.serialization.os.system", cmd),
        "GLOBAL opcode": b"\x80\x04c" + f"{fs}\nos.system\n".encode() + _s(cmd) + b"\x85R.",
        "builtins": _call("builtins", "exec", f"open('{sentinel}', 'w')"),
        "copyreg extension": b"\x80\x04\x82\xf1" + _s(cmd) + b"\x85R.",
        "persistent id": b"\x80\x04" + _s(cmd) + b"Q.",
        "protocol-0 INST": f"(S'{cmd}'\nios\nsystem\n.".encode(),
        "allowed class, hostile state": props + _s("junk") + b"\x85b.",
        "not a Metadata": _call("torch", "Size", "abc"),
    }


@pytest.fixture
def sentinel(tmp_path):
    path = tmp_path / "pwned"
    # EXT1 0xF1 -> a callable through a DCP module, by way of copyreg's extension registry
    copyreg.add_extension("torch.distributed.checkpoint.filesystem", "os.system", 0xF1)
    yield path
    copyreg.remove_extension("torch.distributed.checkpoint.filesystem", "os.system", 0xF1)
    assert not path.exists(), "a checkpoint ran code"


def test_hostile_metadata_is_refused_on_every_path(tmp_path, sentinel, capsys):
    for i, (kind, payload) in enumerate(_payloads(sentinel).items()):
        path = _save(tmp_path / str(i), 10)
        (path / ".metadata").write_bytes(payload)
        with pytest.raises(checked.MetadataError):
            checked.unpickle(payload)
        # The marker records the real metadata's digest; re-seal it as an attacker would.
        info = store.read_marker(path)
        info["files"][".metadata"] = store.digest.file_digest(path / ".metadata")
        store.write_marker(path, info)
        ok, why = store.is_complete(path)
        assert not ok and why.startswith("refused metadata:"), (kind, why)
        assert train.run(_cfg(resume=str(path))) == 2, kind
        assert export_model.main([str(path), str(tmp_path / f"out{i}")]) == 2, kind
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and all(str(path) in line for line in err), (kind, err)
        assert "Traceback" not in "".join(err)


def test_a_pickled_entry_is_never_unpickled(tmp_path, sentinel):
    """An entry DCP stores as a pickle (BytesStorageMetadata) would be read back with
    torch.load(weights_only=False); the metadata check and the planner both refuse it."""
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {sentinel}",)
    partial = tmp_path / "ck"
    dcp.save({"optim.step": Evil()}, checkpoint_id=str(partial), no_dist=True)
    with pytest.raises(checked.MetadataError, match="BytesStorageMetadata"):
        checked.read(partial)
    with pytest.raises(BaseException, match="never holds"):  # DCP's CheckpointException is a BaseException
        dcp.load({"optim.step": torch.tensor(0)}, storage_reader=CheckpointReader(str(partial)),
                 planner=TensorOnlyLoadPlanner(), no_dist=True)
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optim.step"))
    with pytest.raises(checked.MetadataError, match="refusing to unpickle"):
        TensorOnlyLoadPlanner().load_bytes(item, io.BytesIO(pickle.dumps(Evil())))


def test_data_files_outside_the_checkpoint_are_refused(tmp_path):
    path = _save(tmp_path, 10)
    metadata = checked.read(path)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    with pytest.raises(checked.MetadataError, match="other than a DCP data file"):
        checked.unpickle(pickle.dumps(metadata))


def test_every_kind_of_file_damage_is_found(tmp_path):
    path = _save(tmp_path, 10)
    assert store.is_complete(path) == (True, "")
    for name in sorted(os.listdir(path)):
        original = (path / name).read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0x10
        (path / name).write_bytes(bytes(damaged))
        ok, why = store.is_complete(path)
        assert not ok and ("checksum" in why or "unreadable" in why), (name, why)
        (path / name).write_bytes(original)
    assert store.is_complete(path) == (True, "")


def test_auto_falls_back_to_the_newest_good_checkpoint_and_says_so(tmp_path, capsys):
    good, bad = _save(tmp_path, 10), _save(tmp_path, 20)
    data = next(bad.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[-100] ^= 1
    data.write_bytes(bytes(blob))
    cfg = _cfg(resume="auto")
    cfg.checkpoint.dir = str(tmp_path)
    assert train.check_resume(cfg)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {bad}: {data.name} does not match its checksum" in err
    assert f"resuming from the newest good checkpoint, {good}" in err
    assert train.run(_cfg(resume=str(bad))) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    # Only damaged ones left: auto refuses rather than start over from step 0 and lose the run.
    (good / store.MARKER).write_text((good / store.MARKER).read_text().replace('"step": 10', '"step": 11'))
    assert train.run(cfg) == 2
    err = capsys.readouterr().err
    assert "no checkpoint under" in err and str(good) in err and str(bad) in err and "hydra.run.dir" in err


def test_retention_keeps_the_last_good_checkpoint(tmp_path):
    ten, twenty, thirty = _save(tmp_path, 10), _save(tmp_path, 20), _save(tmp_path, 30)
    (twenty / store.MARKER).write_text((twenty / store.MARKER).read_text().replace('"step": 20', '"step": 21'))
    store.prune(tmp_path, keep=1, known_bad=[thirty])  # thirty's data failed verification on a load
    assert all(p.exists() for p in (ten, twenty, thirty)), "only ten is good: nothing may go"
    forty = _save(tmp_path, 40)
    store.prune(tmp_path, keep=1, known_bad=[thirty])
    assert [p.name for _, p in store.published(tmp_path)] == [forty.name]  # a newer good one: the rest may go


def test_a_file_changed_on_its_way_to_disk_fails_the_save(tmp_path, monkeypatch):
    from trainer3d.checkpoint import writer as writer_module
    real = writer_module.file_digest
    monkeypatch.setattr(writer_module, "file_digest",  # the bytes read back are not those hashed on the way
                        lambda p, **kw: {k: v if k == "bytes" else "0" * 32 for k, v in real(p, **kw).items()})
    with pytest.raises(BaseException, match="read back differs from what was written"):
        dcp.save({"w": torch.ones(10)}, storage_writer=CheckpointWriter(str(tmp_path / "x")), no_dist=True)


def test_model_changes_name_each_key():
    saved = dataclasses.asdict(ModelConfig())
    now = ModelConfig(n_layers=2, n_heads=8, rope_theta=5e5, tie_embeddings=True, name="other", max_seq_len=512)
    assert model_changes(saved, now) == ["model.n_layers 4 -> 2", "model.n_heads 4 -> 8", "model.head_dim 32 -> 16",
                                         "model.rope_theta 10000.0 -> 500000.0", "model.tie_embeddings False -> True"]
    assert model_changes(saved, ModelConfig(head_dim=32)) == []  # the default, spelled out
    older = {k: v for k, v in saved.items() if k != "rope_scaling"}  # a marker from before the field
    assert model_changes(older, ModelConfig()) == []


def test_resuming_into_another_model_is_refused_before_launch(tmp_path, capsys):
    path = _save(tmp_path, 10)
    cfg = _cfg(resume=str(path))
    cfg.model.n_layers, cfg.model.vocab_size = 2, 300
    assert train.run(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.n_layers 4 -> 2" in err[0] and "model.vocab_size 257 -> 300" in err[0], err
    cfg.train.resume, cfg.checkpoint.dir = "auto", str(tmp_path)
    assert train.run(cfg) == 2
    assert f"train.resume=auto (checkpoint {path}) holds a different model" in capsys.readouterr().err


@pytest.mark.parametrize("saved,now", [("adamw", "muon"), ("muon", "adamw"), (None, "muon")])
def test_resuming_into_another_optimizer_is_refused_before_launch(tmp_path, capsys, saved, now):
    """AdamW's moments and Muon's momentum do not convert (a marker without optim is AdamW's)."""
    path = _save(tmp_path, 10, optim=saved)
    cfg = _cfg(resume=str(path))
    cfg.optim.name = now
    assert train.run(cfg) == 2
    err = capsys.readouterr().err
    assert f"was trained with optim.name={saved or 'adamw'}, this run sets optim.name={now}" in err, err
    assert f"set optim={saved or 'adamw'} to resume" in err
