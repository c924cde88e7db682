"""tools/import_megatron.py: a Megatron-LM indexed dataset (.bin + .idx) becomes a token file with
its documents kept apart; a malformed or foreign one is refused in one line and nothing is written.

The datasets are written by tests/support/megatron_files.py from the format Megatron-LM
documents, not by the code under test."""

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.support.megatron_files import write_megatron
from trainer3d.data import TokenFile

EOS = 9


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "import_megatron.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


DOCS = [[[1, 2, 3], [4, 5]], [[6, 7, EOS]], [[8]], [[2, 2, 2, 2]]]  # one of two sequences, one ends with eos


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_documents_become_a_token_file_with_their_boundaries(tmp_path, dtype):
    write_megatron(tmp_path / "corpus_text_document", DOCS, dtype)
    proc = run(tmp_path / "corpus_text_document", "--out", tmp_path / "c.bin", "--vocab-size", 16, "--eos-id", EOS)
    assert proc.returncode == 0, proc.stderr
    tf = TokenFile.open(tmp_path / "c.bin")  # checked as any token file (size, checksum, ids)
    assert tf.header.eos_id == EOS and tf.vocab_size == 16
    assert np.asarray(tf.tokens).tolist() == [1, 2, 3, 4, 5, EOS, 6, 7, EOS, 8, EOS, 2, 2, 2, 2, EOS]


BAD = {
    "magic": (dict(magic=b"NOTMEGATR"), "not a Megatron index"),
    "float dtype": (dict(code=7), "dtype code 7 holds no token ids"),
    "pointers": (dict(pointers=[0, 8, 10, 12, 14]), "pointers are not contiguous"),
}


@pytest.mark.parametrize("case", list(BAD) + ["truncated bin", "id outside vocabulary", "missing idx"])
def test_a_bad_dataset_is_refused_in_one_line(tmp_path, case):
    prefix = tmp_path / "d"
    kwargs, expect = BAD.get(case, ({}, None))
    write_megatron(prefix, DOCS, **kwargs)
    vocab = 16
    if case == "truncated bin":
        data = (tmp_path / "d.bin").read_bytes()
        (tmp_path / "d.bin").write_bytes(data[:-2])
        expect = "truncated, or another dataset's .bin"
    elif case == "id outside vocabulary":
        vocab, expect = 8, "is outside the vocabulary of 8"
    elif case == "missing idx":
        (tmp_path / "d.idx").unlink()
        expect = "d.idx is missing"
    proc = run(prefix, "--out", tmp_path / "out.bin", "--vocab-size", vocab, "--eos-id", 3)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expect in proc.stderr, proc.stderr
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.json").exists()
