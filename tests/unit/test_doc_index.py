"""The document index beside a token file: written from the documents prepare_data reads (not
from end-of-document ids), bound to its token file, refused naming the file when it does not
belong to it; Megatron datasets' own boundaries; a legacy file's fallback, said in one line."""

import numpy as np
import pytest

from tests.support.megatron_files import write_megatron
from trainer3d.data import BYTE_VOCAB, TokenFile, TokenFileError, TokenizerInfo, write_token_file
from trainer3d.data import prepare
from trainer3d.data.doc_index import document_starts, index_header_path, index_path, read_doc_index
from trainer3d.data.documents import Piece
from trainer3d.data.megatron import import_megatron
from trainer3d.data.segments import build_segments

EOS = BYTE_VOCAB - 1
# A document whose text holds the end-of-document id's neighbours, one in two pieces, an empty one.
PIECES = [Piece(b"abc", True), Piece(b"de", False), Piece(b"fgh", True), Piece(b"", True), Piece(b"ij", True)]
# By hand: lengths 3+1, 5+1, 0+1, 2+1 -> starts 0, 4, 10, 11.
STARTS = [0, 4, 10, 11]


@pytest.mark.parametrize("batch_bytes", [1 << 20, 1, 3])
def test_prepare_writes_the_starts_of_the_documents_it_read(tmp_path, monkeypatch, batch_bytes):
    monkeypatch.setattr(prepare, "BATCH_BYTES", batch_bytes)  # documents across batches too
    header = prepare.prepare(iter(PIECES), tmp_path / "t.bin", prepare.BYTE_ENCODER)
    assert header.n_tokens == 14
    assert read_doc_index(tmp_path / "t.bin", header).tolist() == STARTS


def test_the_index_keeps_boundaries_an_end_of_document_id_inside_a_text_would_move(tmp_path):
    """Ids equal to the end-of-document id inside a document (a chat template's) do not cut it."""
    encoder = prepare.Encoder(None, ord("x"), BYTE_VOCAB, prepare.BYTE_LEVEL)  # 'x' stands for the eos id
    header = prepare.prepare(iter([Piece(b"axb", True), Piece(b"cd", True)]), tmp_path / "t.bin", encoder)
    opened = TokenFile.open(tmp_path / "t.bin", verify=False)
    assert document_starts(opened).tolist() == [0, 4]
    assert header.n_tokens == 7


def _prepared(tmp_path):
    header = prepare.prepare(iter(PIECES), tmp_path / "t.bin", prepare.BYTE_ENCODER)
    return tmp_path / "t.bin", header


def test_an_index_of_other_ids_is_refused_naming_it(tmp_path):
    path, _ = _prepared(tmp_path)
    ids = np.arange(14) % 200  # the token file rewritten, its index left from before
    write_token_file(path, ids, BYTE_VOCAB, TokenizerInfo("byte-level", "x"), EOS)
    with pytest.raises(TokenFileError, match=r"t\.docs\.json: made for other ids.*prepare_data"):
        document_starts(TokenFile.open(path, verify=False))


def test_a_damaged_index_is_refused_naming_it(tmp_path):
    path, header = _prepared(tmp_path)
    raw = bytearray(index_path(path).read_bytes())
    raw[8] ^= 1
    index_path(path).write_bytes(bytes(raw))
    with pytest.raises(TokenFileError, match=r"t\.docs: .*sha256 does not match"):
        read_doc_index(path, header)
    index_header_path(path).unlink()
    with pytest.raises(TokenFileError, match="document index is incomplete"):
        read_doc_index(path, header)


def test_a_token_file_without_an_index_falls_back_to_end_of_document_ids(tmp_path):
    stream = np.array([1, 2, EOS, 3, EOS, 4, 5, 6, EOS, 7], dtype=np.int64)
    write_token_file(tmp_path / "old.bin", stream, BYTE_VOCAB, TokenizerInfo("byte-level", "x"), EOS)

    class Reader:  # what build_segments reads of a BatchReader
        files = [TokenFile.open(tmp_path / "old.bin", verify=False)]

    segments, notes = build_segments(Reader)
    assert segments.starts == [None]
    assert len(notes) == 1 and "old.bin: no document index" in notes[0] and f"end-of-document id {EOS}" in notes[0]


def test_megatron_boundaries_come_from_its_index_in_place_and_imported(tmp_path):
    docs = [[[1, 2], [3]], [[4]], [[5, 6, EOS]], [[7, 8]]]  # the third already ends with the eos id
    write_megatron(tmp_path / "m_text_document", docs, np.uint16)
    in_place = TokenFile.open(tmp_path / "m_text_document", eos_id=EOS, vocab_size=BYTE_VOCAB, verify=False)
    # By hand: 3+1, 1+1, 3, 2+1 ids -> starts 0, 4, 6, 9.
    assert document_starts(in_place).tolist() == [0, 4, 6, 9]
    import_megatron(tmp_path / "m_text_document", tmp_path / "imported.bin", BYTE_VOCAB, EOS)
    assert document_starts(TokenFile.open(tmp_path / "imported.bin")).tolist() == [0, 4, 6, 9]


def test_the_input_walk_knows_every_side_file_of_a_token_file():
    """prepare_data skips a token file's side files as inputs (documents.SIDE_SUFFIXES): the
    document index's and the loss mask's names are among them."""
    from pathlib import Path

    from trainer3d.data.doc_index import index_header_path, index_path
    from trainer3d.data.documents import SIDE_SUFFIXES
    from trainer3d.data.loss_mask import mask_header_path, mask_path

    for side in (index_path, index_header_path, mask_path, mask_header_path):
        assert side(Path("d/x.bin")).name in {"x" + s for s in SIDE_SUFFIXES}, side
