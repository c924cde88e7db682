"""tools/import_megatron.py: a Megatron-LM indexed dataset (.bin + .idx) becomes a token file with
its documents kept apart; a malformed or foreign one is refused in one line and nothing is written.

The datasets here are written by the test itself from the format Megatron-LM documents
(megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``): magic, version 1, dtype code,
sequence and document-entry counts, int32 sizes, int64 byte pointers, int64 document indices."""

import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from trainer3d.data import TokenFile

CODES = {np.uint16: 8, np.int32: 4}
EOS = 9


def write_megatron(prefix, documents, dtype=np.uint16, code=None, pointers=None, magic=b"MMIDIDX\x00\x00"):
    """``documents``: a list of documents, each a list of sequences (lists of ids)."""
    sequences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    sizes = np.array([len(s) for s in sequences], dtype="<i4")
    item = np.dtype(dtype).itemsize
    if pointers is None:
        pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * item)]).astype("<i8")
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic + struct.pack("<QBQQ", 1, code or CODES[dtype], len(sizes), len(doc_index)))
        f.write(sizes.tobytes() + np.asarray(pointers, dtype="<i8").tobytes() + doc_index.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(s.astype(np.dtype(dtype).newbyteorder("<")).tobytes())


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
