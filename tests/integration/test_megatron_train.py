"""Training reads a Megatron-LM indexed dataset in place (``data.path=PREFIX data.eos_id=…``):
its reader gives, batch for batch, what the same layout reads from a token file holding the same
documents, each followed by the end-of-document id — that file written here by hand from the
documents, not by the code under test — for the 20 steps PARITY trains, and a rank trains on it
step for step as on that file. The readers are the ranks' own (trainer3d/data/loader.py
``build_readers``, as trainer3d/trainer.py builds them) on the configs the entry point would
launch; the runs do the entry point's work on an in-process rank (tests/support/runs.py:
``train_in_ranks`` composes, validates and checks the data as ``python -m trainer3d.train``
does); the launcher's own tests are its processes'. What the data is, every batch shows; the
training runs show the ranks read it as the reader does, which a few steps do."""

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.support.megatron_files import write_megatron
from tests.support.runs import PARITY, REL_TOL, configure, losses_in_ranks
from trainer3d.data.loader import build_readers
from trainer3d.data import BYTE_VOCAB, TokenizerInfo, write_token_file

EOS = BYTE_VOCAB - 1  # the byte-level end of document: model=tiny embeds 257 ids


def _documents():
    """This package's sources as documents of byte ids, each split in sequences of <= 300 ids as
    Megatron's preprocessing splits documents in sentences."""
    docs = []
    for path in sorted((ROOT / "trainer3d" / "data").glob("*.py")):
        ids = list(path.read_bytes())
        docs.append([ids[i:i + 300] for i in range(0, len(ids), 300)])
    return docs


@pytest.mark.slow
def test_a_megatron_dataset_trains_in_place_as_its_token_file(tmp_path):
    docs = _documents()
    write_megatron(tmp_path / "src_text_document", docs, np.uint16)
    stream = np.concatenate([np.concatenate([np.asarray(s, dtype=np.int64) for s in doc] + [[EOS]]) for doc in docs])
    write_token_file(tmp_path / "ref.bin", stream, BYTE_VOCAB, TokenizerInfo("byte-level", "by-hand"), EOS)
    common = [*PARITY, "data=tokens", f"data.cache_dir={tmp_path / 'cache'}", "parallel=single"]
    in_place = [*common, f"data.path={tmp_path / 'src_text_document'}", f"data.eos_id={EOS}"]
    by_hand = [*common, f"data.path={tmp_path / 'ref.bin'}"]
    readers = {name: build_readers(configure(tmp_path / name, args), dp=1, dp_rank=0)[0]
               for name, args in (("in_place", in_place), ("ref", by_hand))}
    for step in range(20):  # PARITY's steps: every sequence, input and target, the same ids
        for got, want in zip(readers["in_place"].batch(step), readers["ref"].batch(step)):
            assert np.array_equal(np.asarray(got), np.asarray(want)), f"step {step}"
    short = ("train.max_steps=3",)
    got = losses_in_ranks(tmp_path / "in_place", [*in_place, *short])
    want = losses_in_ranks(tmp_path / "ref", [*by_hand, *short])
    assert len(got) == len(want) == 3
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= REL_TOL, (got, want)
