"""A checkpoint belongs to one run and was trained on one dataset: ``train.resume=auto`` refuses
another run's checkpoint in a shared ``checkpoint.dir``; every resume refuses data other than
what the checkpoint recorded (a token file re-made with another tokenizer of the same
vocabulary size) unless ``train.allow_data_change``; the data position is the samples consumed,
so a change of ``train.global_batch_size`` neither repeats nor skips a sample.

Checkpoints are written by the engine's own writer on one process (tests/integration/
test_checkpoint_safety.py's way), their markers holding what a save records."""

import copy
import dataclasses
import hashlib

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer, models

from tests.unit.test_validate import make
from trainer3d.checkpoint import store
from trainer3d.checkpoint.choose import choose
from trainer3d.checkpoint.export import export
from trainer3d.checkpoint.lineage import marker_fields, origin_of, tokenizer_problem
from trainer3d.checkpoint.store import CheckpointError
from trainer3d.checkpoint.writer import CheckpointWriter
from trainer3d.config.schema import ModelConfig
from trainer3d.data.identity import data_identity
from trainer3d.data.sampler import Origin, step_samples
from trainer3d.data.tokens import TokenizerInfo, write_token_file


def _cfg(tmp_path, run="run", **train):
    cfg = copy.deepcopy(make())
    cfg.run_dir = str(tmp_path / run)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _save(root, step, cfg, origin=None):
    partial = store.partial_dir(root, step)
    writer = CheckpointWriter(str(partial))
    dcp.save({"model.w": torch.arange(400.0) + step}, storage_writer=writer, no_dist=True)
    config = {"model": dataclasses.asdict(ModelConfig()), "data": dataclasses.asdict(cfg.data)}
    info = {"step": step, "files": writer.digests, "config": config,
            **marker_fields(cfg, step, origin or Origin(), None, data_identity(cfg))}
    store.publish(partial, store.step_dir(root, step), info)
    return store.step_dir(root, step)


def test_auto_refuses_another_runs_checkpoint_in_a_shared_dir(tmp_path):
    shared = tmp_path / "shared"
    first = _cfg(tmp_path, "sweep/0")
    first.checkpoint.dir = str(shared)
    path = _save(shared, 20, first)
    second = _cfg(tmp_path, "sweep/1")
    second.checkpoint.dir = str(shared)
    with pytest.raises(CheckpointError, match="belongs to another run") as err:
        choose(second, shared)
    assert str(tmp_path / "sweep/0") in str(err.value) and f"checkpoint.dir={shared}" in str(err.value)
    assert choose(first, shared).path == path  # its own run continues
    second.train.resume = str(path)  # another run's checkpoint, on purpose
    assert choose(second, shared).path == path


def _tokens(tmp_path, tokenizer: str):
    ids = (np.arange(4000) * 7) % 250
    return write_token_file(tmp_path / "data.bin", ids, 256, TokenizerInfo(tokenizer, tokenizer * 8), eos_id=0)


def test_a_resume_onto_data_made_by_another_tokenizer_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.data.name, cfg.data.path = "tokens", str(_tokens(tmp_path, "bpe-a"))
    root = tmp_path / "run" / "checkpoints"
    _save(root, 10, cfg)
    assert choose(cfg, root).step == 10
    _tokens(tmp_path, "bpe-b")  # the same ids, the same vocabulary size, another tokenizer
    with pytest.raises(CheckpointError) as err:
        choose(cfg, root)
    said = str(err.value)
    assert "other data" in said and "data.path" in said and "tokenizer bpe-a -> bpe-b" in said, said
    assert "train.allow_data_change=true" in said
    cfg.train.allow_data_change = True
    assert choose(cfg, root).step == 10


def test_samples_consumed_carry_over_a_change_of_global_batch(tmp_path):
    """Steps 0-1 at batch 8, a checkpoint, steps 2-4 at batch 4, another, steps 5-6 at 12: the
    sample ids the three runs read are 0 .. 8*2 + 4*3 + 12*2 - 1, each once."""
    root, read = tmp_path / "ckpt", []
    origin = Origin()
    for batch, first, last in ((8, 0, 2), (4, 2, 5), (12, 5, 7)):
        cfg = _cfg(tmp_path, global_batch_size=batch)
        for step in range(first, last):
            read += step_samples(step, batch, 0, batch, origin).tolist()
        path = _save(root, last, cfg, origin)
        origin = origin_of(store.read_marker(path), batch)
    assert read == list(range(8 * 2 + 4 * 3 + 12 * 2))
    assert origin == Origin(7, 52)


def test_a_tokenizer_replaced_since_training_is_refused_by_export(tmp_path):
    """The data's header names tokenizer.json; after training it is replaced by another: the
    export would bundle a tokenizer whose ids mean other text, so it is refused, naming both."""
    vocab = {chr(ord("a") + i): i for i in range(20)}
    made = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    made.save(str(tmp_path / "tokenizer.json"))
    text = (tmp_path / "tokenizer.json").read_text()
    info = TokenizerInfo("tokenizer.json", hashlib.sha256(text.encode()).hexdigest(), str(tmp_path / "tokenizer.json"))
    data = write_token_file(tmp_path / "data.bin", np.arange(4000) % 20, 20, info, eos_id=0)
    cfg = _cfg(tmp_path)
    cfg.data.name, cfg.data.path = "tokens", str(data)
    path = _save(tmp_path / "ckpt", 10, cfg)
    assert tokenizer_problem(store.read_marker(path), tmp_path / "tokenizer.json", path) is None
    Tokenizer(models.WordLevel({k: 19 - v for k, v in vocab.items()}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    said = tokenizer_problem(store.read_marker(path), tmp_path / "tokenizer.json", path)
    assert said and f"checkpoint {path} was trained with tokenizer tokenizer.json" in said and "--tokenizer" in said
    with pytest.raises(CheckpointError, match="was trained with tokenizer"):
        export(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
