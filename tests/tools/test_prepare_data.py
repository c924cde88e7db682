"""tools/prepare_data.py: inputs, tokenizers, workers, streaming, refusals, permissions."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np

from trainer3d.data import EOF_TOKEN, TokenFile, read_header
from trainer3d.data import documents as docs
from trainer3d.data import prepare
from tests.conftest import ROOT

DOCS = ["def f(x):\n    return x + 1\n", "Ünïcödé text, twice: ünïcödé.\n", "one more document\n\nwith a gap",
        "short"]
IN_ORDER = DOCS[2:] + DOCS[:2]  # c.jsonl.zst sorts before texts/


def run_tool(*args, umask=None):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def write_inputs(root):
    """DOCS[0] and DOCS[1] as text files (one gzipped), DOCS[2:] as JSON Lines (zstd-compressed);
    files are read in sorted order, so the documents come as IN_ORDER."""
    import zstandard

    (root / "texts").mkdir()
    (root / "texts" / "a.py").write_text(DOCS[0])
    with gzip.open(root / "texts" / "b.txt.gz", "wt") as f:
        f.write(DOCS[1])
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[2:]))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return [root / "texts", root / "c.jsonl.zst"]


def split_documents(ids, eos):
    ends = np.flatnonzero(ids == eos)
    return [ids[a + 1 if i else 0:b].tolist() for i, (a, b) in enumerate(zip(np.r_[-1, ends[:-1]], ends))]


def test_byte_level_from_directories_jsonl_and_compressed_files(tmp_path):
    proc = run_tool("--out", tmp_path / "c.bin", *write_inputs(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout
    tf = TokenFile.open(tmp_path / "c.bin")
    assert tf.header.eos_id == EOF_TOKEN and tf.vocab_size == 257
    assert split_documents(np.asarray(tf.tokens), EOF_TOKEN) == [list(d.encode()) for d in IN_ORDER]


def test_prepared_files_get_the_umask_permissions(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    proc = run_tool("--out", tmp_path / "out" / "c.bin", tmp_path / "a.txt", umask=0o022)
    assert proc.returncode == 0, proc.stderr
    for name in ("c.bin", "c.json", "c.docs", "c.docs.json"):
        assert oct((tmp_path / "out" / name).stat().st_mode & 0o777) == oct(0o644), name


def test_a_tokenizer_made_file_round_trips_to_its_text(tmp_path):
    """A BPE trained on the inputs (--train-tokenizer), two workers; then the same tokenizer as a
    Hugging Face directory (--tokenizer DIR, EOS from its tokenizer_config.json)."""
    from tokenizers import Tokenizer

    inputs = write_inputs(tmp_path)
    proc = run_tool("--out", tmp_path / "bpe.bin", "--train-tokenizer", 300, "--workers", 2, *inputs)
    assert proc.returncode == 0, proc.stderr
    header = read_header(tmp_path / "bpe.bin")
    tokenizer = Tokenizer.from_file(header.tokenizer.path)
    ids = np.asarray(TokenFile.open(tmp_path / "bpe.bin").tokens)
    assert header.eos_id == tokenizer.token_to_id("<|endoftext|>") and header.max_id < header.vocab_size
    assert len(ids) < sum(len(d.encode()) for d in DOCS), "BPE merges bytes"
    assert [tokenizer.decode(d) for d in split_documents(ids, header.eos_id)] == IN_ORDER

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(header.tokenizer.path, hf_dir / "tokenizer.json")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    proc = run_tool("--out", tmp_path / "hf.bin", "--tokenizer", hf_dir, *inputs)
    assert proc.returncode == 0, proc.stderr
    assert read_header(tmp_path / "hf.bin").tokenizer.sha256 == header.tokenizer.sha256
    assert np.array_equal(np.asarray(TokenFile.open(tmp_path / "hf.bin").tokens), ids)


def test_ids_at_or_above_the_vocabulary_are_refused_at_preparation(tmp_path):
    """A vocabulary declared smaller than the tokenizer's (--vocab-size): merged tokens (ids >= 257
    in a trained BPE) do not fit, and nothing is written."""
    (tmp_path / "a.txt").write_text("the cat and the dog and the bird " * 20)
    proc = run_tool("--out", tmp_path / "bpe.bin", "--train-tokenizer", 300, tmp_path / "a.txt")
    assert proc.returncode == 0, proc.stderr
    proc = run_tool("--out", tmp_path / "c.bin", "--tokenizer", tmp_path / "bpe.tokenizer.json",
                    "--vocab-size", 257, tmp_path / "a.txt")
    assert proc.returncode == 1
    refused = re.search(r"c.bin: token id (\d+) is outside the vocabulary of 257", proc.stderr)
    assert refused and int(refused.group(1)) >= 257, proc.stderr
    assert not (tmp_path / "c.bin").exists() and not list(tmp_path.glob(".c.bin*")), "nothing written"


def test_a_jsonl_record_without_the_text_key_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    proc = run_tool("--out", tmp_path / "c.bin", tmp_path / "d.jsonl")
    assert proc.returncode == 1 and "d.jsonl:2: no string under key 'text'" in proc.stderr


def test_long_documents_are_encoded_in_pieces_with_unchanged_tokens(tmp_path, monkeypatch):
    """A document longer than PIECE_BYTES is cut where byte-level pre-tokenization cuts anyway."""
    text = "".join(f"line {i}: {'é' * (i % 5)} words\n    indented {i}\n\n" for i in range(300))
    (tmp_path / "long.txt").write_text(text)
    proc = run_tool("--out", tmp_path / "bpe.bin", "--train-tokenizer", 300, tmp_path / "long.txt")
    assert proc.returncode == 0, proc.stderr
    encoder = prepare.load_tokenizer(read_header(tmp_path / "bpe.bin").tokenizer.path)
    monkeypatch.setattr(docs, "PIECE_BYTES", 97)  # many pieces
    files = [tmp_path / "long.txt"]
    assert len(list(docs.documents(files, "text", docs.Progress(files)))) > 50
    header = prepare.prepare(docs.documents(files, "text", docs.Progress(files)), tmp_path / "pieces.bin", encoder)
    whole = TokenFile.open(tmp_path / "bpe.bin").tokens
    assert header.n_tokens == len(whole) and np.array_equal(TokenFile.open(tmp_path / "pieces.bin").tokens, whole)


def test_preparation_memory_does_not_grow_with_the_input(tmp_path):
    """Peak traced bytes while preparing 8 MB and 64 MB of text (in process, byte level): the same."""
    line = b"the quick brown fox jumps over the lazy dog, again and again and again\n"

    def pieces(n_bytes):
        doc = line * (256 * 1024 // len(line))
        for _ in range(n_bytes // len(doc)):
            yield docs.Piece(doc, True)

    def peak(n_bytes):
        tracemalloc.start()
        prepare.prepare(pieces(n_bytes), tmp_path / f"m{n_bytes}.bin", prepare.BYTE_ENCODER)
        used = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return used
    small, large = peak(8 << 20), peak(64 << 20)
    print(f"preparation peak: {small / 2**20:.1f} MiB for 8 MB, {large / 2**20:.1f} MiB for 64 MB")
    assert large < 1.25 * small + (1 << 20) and large < 24 << 20
