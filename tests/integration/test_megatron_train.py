"""Training reads a Megatron-LM indexed dataset in place (``data.path=PREFIX data.eos_id=…``):
it trains step for step as the same layout does on a token file holding the same documents,
each followed by the end-of-document id — that file written here by hand from the documents,
not by the code under test. Both runs do the entry point's work on an in-process rank
(tests/support/runs.py: ``train_in_ranks`` composes, validates and checks the data as
``python -m trainer3d.train`` does); the launcher's own tests are its processes'."""

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.support.megatron_files import write_megatron
from tests.support.runs import PARITY, assert_parity, losses_in_ranks
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


@pytest.mark.slow  # two 20-step runs
def test_a_megatron_dataset_trains_in_place_as_its_token_file(tmp_path):
    docs = _documents()
    write_megatron(tmp_path / "src_text_document", docs, np.uint16)
    stream = np.concatenate([np.concatenate([np.asarray(s, dtype=np.int64) for s in doc] + [[EOS]]) for doc in docs])
    write_token_file(tmp_path / "ref.bin", stream, BYTE_VOCAB, TokenizerInfo("byte-level", "by-hand"), EOS)
    common = [*PARITY, "data=tokens", f"data.cache_dir={tmp_path / 'cache'}"]
    in_place = losses_in_ranks(tmp_path / "in_place", [*common, f"data.path={tmp_path / 'src_text_document'}",
                                                       f"data.eos_id={EOS}", "parallel=single"])
    reference = losses_in_ranks(tmp_path / "ref", [*common, f"data.path={tmp_path / 'ref.bin'}", "parallel=single"])
    assert_parity(in_place, reference)  # 20 steps
