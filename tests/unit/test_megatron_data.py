"""Megatron-LM indexed datasets read in place as token files (trainer3d/data/megatron.py): the
stream keeps documents apart as the pipeline's own token files do (an end-of-document id after
each, unless it ends with one), any slice reads what the whole stream holds there, and a
malformed or foreign dataset is refused before launch in one line naming the file and the fix.

The datasets are written by tests/support/megatron_files.py from Megatron-LM's documented
format; the expected streams are written out by hand."""

import os

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
from tests.support.megatron_files import write_megatron
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.validate import validate
from trainer3d.data import TokenFile
from trainer3d.preflight.data_checks import check_data

EOS = 9
# two sequences in one document, one ending with eos, a document without sequences, one of an
# empty sequence (both add nothing), a single token
DOCS = [[[1, 2, 3], [4, 5]], [[6, 7, EOS]], [], [[]], [[8]], [[2, 2, 2, 2]]]
STREAM = [1, 2, 3, 4, 5, EOS, 6, 7, EOS, 8, EOS, 2, 2, 2, 2, EOS]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_the_stream_is_the_documents_each_followed_by_eos(tmp_path, dtype):
    write_megatron(tmp_path / "c_text_document", DOCS, dtype)
    tf = TokenFile.open(tmp_path / "c_text_document", cache_dir=str(tmp_path / "cache"), eos_id=EOS, vocab_size=16)
    assert tf.header.n_tokens == len(STREAM) and tf.header.eos_id == EOS and tf.vocab_size == 16
    assert tf.tokens[0:len(STREAM)].tolist() == STREAM
    for lo in range(len(STREAM)):
        for hi in range(lo, len(STREAM) + 1):
            assert tf.tokens[lo:hi].tolist() == STREAM[lo:hi], (lo, hi)


def test_the_prefix_its_bin_and_its_idx_name_the_same_dataset(tmp_path):
    write_megatron(tmp_path / "web.v2_text_document", DOCS)  # a dot inside the prefix
    for given in ("web.v2_text_document", "web.v2_text_document.bin", "web.v2_text_document.idx"):
        tf = TokenFile.open(tmp_path / given, eos_id=EOS, vocab_size=16)
        assert tf.path == tmp_path / "web.v2_text_document.bin" and tf.tokens[0:16].tolist() == STREAM


def _problems(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose("config", ["data=tokens", f"data.path={tmp_path / 'd'}", "parallel=single",
                                  "train.seq_len=4", "train.micro_batch_size=1", "train.global_batch_size=2",
                                  "train.grad_accum_steps=null", f"data.cache_dir={tmp_path / 'cache'}",
                                  "model.vocab_size=16", *overrides, "run_dir=/tmp/x", "launcher.folder=/tmp/x"])
    return check_data(validate(OmegaConf.to_object(dcfg)))


def test_a_good_dataset_passes_the_checks_before_launch(tmp_path):
    write_megatron(tmp_path / "d", DOCS)
    assert _problems(tmp_path, f"data.eos_id={EOS}") == []
    assert _problems(tmp_path, f"data.eos_id={EOS}", "data.val_fraction=0.5", "train.eval_every=1",
                               "train.seq_len=2", "train.eval_steps=1") == []


BAD = {
    "magic": (dict(magic=b"NOTMEGATR"), "d.idx: not a Megatron index"),
    "version": (dict(version=2), "d.idx: index version 2"),
    "float dtype": (dict(code=7), "d.idx: dtype code 7 holds no token ids"),
    "pointers": (dict(pointers=[0, 8, 10, 12, 14, 16]), "d.idx: sequence pointers are not contiguous"),
}


@pytest.mark.parametrize("case", [*BAD, "truncated bin", "longer bin", "truncated idx", "id over the vocabulary",
                                  "negative id", "no eos_id", "eos_id over the vocabulary", "missing bin"])
def test_a_bad_dataset_is_refused_in_one_line_naming_the_file_and_the_fix(tmp_path, case):
    kwargs, expect = BAD.get(case, ({}, None))
    docs, overrides = DOCS, [f"data.eos_id={EOS}"]
    if case == "negative id":
        docs, kwargs = [[[1, -3, 2]], [[4]]], dict(dtype=np.int16)
    write_megatron(tmp_path / "d", docs, **kwargs)
    bin_file, idx = tmp_path / "d.bin", tmp_path / "d.idx"
    if case == "truncated bin":
        bin_file.write_bytes(bin_file.read_bytes()[:-2])
        expect = "d.bin: 24 bytes, but its index describes 26 (truncated, or another dataset's .bin)"
    elif case == "longer bin":
        bin_file.write_bytes(bin_file.read_bytes() + b"\0\0")
        expect = "d.bin: 28 bytes, but its index describes 26"
    elif case == "truncated idx":
        idx.write_bytes(idx.read_bytes()[:-8])
        expect = "d.idx: 154 bytes, but 6 sequences and 7 document entries make 162"
    elif case == "id over the vocabulary":
        overrides = ["data.eos_id=3", "model.vocab_size=8"]
        expect = "d.bin: token ids from 1 to 9, but model.vocab_size=8"
    elif case == "negative id":
        expect = "d.bin: token ids from -3 to 4"
    elif case == "no eos_id":
        overrides = []
        expect = "d.idx: a Megatron-LM dataset, whose files do not record the end-of-document id; set data.eos_id="
    elif case == "eos_id over the vocabulary":
        overrides = ["data.eos_id=16"]
        expect = "d.idx: data.eos_id=16 is outside model.vocab_size=16"
    elif case == "missing bin":
        bin_file.unlink()
        expect = "d.bin is missing: a Megatron dataset is PREFIX.bin with PREFIX.idx"
    problems = _problems(tmp_path, *overrides)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert expect in problems[0] and str(tmp_path) in problems[0], problems


def test_the_id_scan_is_kept_per_version_of_the_files(tmp_path):
    write_megatron(tmp_path / "d", DOCS)
    assert _problems(tmp_path, f"data.eos_id={EOS}") == []
    records = list((tmp_path / "cache" / "verified").glob("*.json"))
    assert len(records) == 1
    # Same size, an id the model cannot embed, a new mtime: scanned again and refused.
    data = bytearray((tmp_path / "d.bin").read_bytes())
    data[0:2] = np.array([15000], dtype="<u2").tobytes()
    (tmp_path / "d.bin").write_bytes(bytes(data))
    st = (tmp_path / "d.bin").stat()
    os.utime(tmp_path / "d.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    assert "token ids from 2 to 15000" in _problems(tmp_path, f"data.eos_id={EOS}")[0]
