"""tools/import_megatron.py: a Megatron-LM indexed dataset (.bin + .idx) becomes a token file with
its documents kept apart; a malformed or foreign one is refused in one line and nothing is written.

The datasets are written by tests/support/megatron_files.py from the format Megatron-LM
documents, not by the code under test."""

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.support.megatron_files import write_megatron
from tests.support.run_scripts import run_all
from trainer3d.data import TokenFile

EOS = 9
DOCS = [[[1, 2, 3], [4, 5]], [[6, 7, EOS]], [[8]], [[2, 2, 2, 2]]]  # one of two sequences, one ends with eos
DTYPES = {"uint16": np.uint16, "int32": np.int32}
BAD = {
    "magic": (dict(magic=b"NOTMEGATR"), "not a Megatron index"),
    "float dtype": (dict(code=7), "dtype code 7 holds no token ids"),
    "pointers": (dict(pointers=[0, 8, 10, 12, 14]), "pointers are not contiguous"),
}
CASES = [*BAD, "truncated bin", "id outside vocabulary", "missing idx"]


def _bad_dataset(tmp_path, case):
    """The dataset of ``case`` written under ``tmp_path``: the tool's arguments and the refusal expected."""
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
    return [prefix, "--out", tmp_path / "out.bin", "--vocab-size", vocab, "--eos-id", 3], expect


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tool on every dataset of this file, each in a directory of its own, one after another in
    one interpreter (tests/support/run_scripts.py: torch imported once, not once per dataset):
    {case: (its directory, its CompletedProcess, the refusal expected or None)}."""
    root = tmp_path_factory.mktemp("megatron")
    cases = {}
    for name, dtype in DTYPES.items():
        (root / name).mkdir()
        write_megatron(root / name / "corpus_text_document", DOCS, dtype)
        cases[name] = (root / name, [root / name / "corpus_text_document", "--out", root / name / "c.bin",
                                     "--vocab-size", 16, "--eos-id", EOS], None)
    for i, case in enumerate(CASES):
        (root / f"bad{i}").mkdir()
        cases[case] = (root / f"bad{i}", *_bad_dataset(root / f"bad{i}", case))
    done = run_all([(ROOT / "tools" / "import_megatron.py", args) for _, args, _ in cases.values()], cwd=root)
    return {case: (directory, proc, expect) for (case, (directory, _, expect)), proc in zip(cases.items(), done)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_documents_become_a_token_file_with_their_boundaries(runs, dtype):
    tmp_path, proc, _ = runs[dtype]
    assert proc.returncode == 0, proc.stderr
    tf = TokenFile.open(tmp_path / "c.bin")  # checked as any token file (size, checksum, ids)
    assert tf.header.eos_id == EOS and tf.vocab_size == 16
    assert np.asarray(tf.tokens).tolist() == [1, 2, 3, 4, 5, EOS, 6, 7, EOS, 8, EOS, 2, 2, 2, 2, EOS]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_dataset_is_refused_in_one_line(runs, case):
    tmp_path, proc, expect = runs[case]
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expect in proc.stderr, proc.stderr
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.json").exists()
