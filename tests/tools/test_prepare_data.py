"""tools/prepare_data.py: inputs, tokenizers, workers, streaming, refusals, permissions."""

import gzip
import json
import re
import shutil
import tracemalloc

import numpy as np
import pytest

from trainer3d.data import EOF_TOKEN, TokenFile, read_header
from trainer3d.data import documents as docs
from trainer3d.data import prepare
from tests.conftest import ROOT
from tests.support.run_scripts import run_all

DOCS = ["def f(x):\n    return x + 1\n", "Ünïcödé text, twice: ünïcödé.\n", "one more document\n\nwith a gap",
        "short"]
IN_ORDER = DOCS[2:] + DOCS[:2]  # c.jsonl.zst sorts before texts/


TOOL = ROOT / "tools" / "prepare_data.py"


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tool's runs this file checks, each on inputs of its own directory, one after another in
    one interpreter with umask 022 (tests/support/run_scripts.py: torch imported once, not once per
    run); a run that reads an earlier one's tokenizer follows it, and the one reading a copy of it
    (the Hugging Face directory) is a second interpreter's. {name: (its directory, CompletedProcess)}."""
    root = tmp_path_factory.mktemp("prepare")
    cases = {}

    def add(name, make_args, directory=None):
        directory = directory or root / name
        directory.mkdir(exist_ok=True)
        cases[name] = (directory, make_args(directory))

    add("bytes", lambda d: ["--out", d / "c.bin", *write_inputs(d)])

    def hello(d):
        (d / "a.txt").write_text("hello")
        return ["--out", d / "out" / "c.bin", d / "a.txt"]
    add("umask", hello)
    add("bpe", lambda d: ["--out", d / "bpe.bin", "--train-tokenizer", 300, "--workers", 2, *write_inputs(d)])

    def repeated(d):
        (d / "a.txt").write_text("the cat and the dog and the bird " * 20)
        return ["--out", d / "bpe.bin", "--train-tokenizer", 300, d / "a.txt"]
    add("small-vocab-bpe", repeated, root / "small-vocab")
    add("small-vocab", lambda d: ["--out", d / "c.bin", "--tokenizer", d / "bpe.tokenizer.json",
                                  "--vocab-size", 257, d / "a.txt"])

    def no_text(d):
        (d / "d.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
        return ["--out", d / "c.bin", d / "d.jsonl"]
    add("no-text-key", no_text)

    def long(d):
        (d / "long.txt").write_text("".join(f"line {i}: {'é' * (i % 5)} words\n    indented {i}\n\n"
                                            for i in range(300)))
        return ["--out", d / "bpe.bin", "--train-tokenizer", 300, d / "long.txt"]
    add("long", long)
    done = dict(zip(cases, run_all([(TOOL, args) for _, args in cases.values()], cwd=root, umask=0o022)))

    bpe = root / "bpe"
    (bpe / "hf").mkdir()
    if done["bpe"].returncode == 0:
        shutil.copy(read_header(bpe / "bpe.bin").tokenizer.path, bpe / "hf" / "tokenizer.json")
    (bpe / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    done["hf"], = run_all([(TOOL, ["--out", bpe / "hf.bin", "--tokenizer", bpe / "hf",
                                   bpe / "texts", bpe / "c.jsonl.zst"])], cwd=root)
    return {name: (cases[name][0] if name in cases else bpe, proc) for name, proc in done.items()}


def test_byte_level_from_directories_jsonl_and_compressed_files(runs):
    tmp_path, proc = runs["bytes"]
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout
    tf = TokenFile.open(tmp_path / "c.bin")
    assert tf.header.eos_id == EOF_TOKEN and tf.vocab_size == 257
    assert split_documents(np.asarray(tf.tokens), EOF_TOKEN) == [list(d.encode()) for d in IN_ORDER]


def test_prepared_files_get_the_umask_permissions(runs):
    tmp_path, proc = runs["umask"]  # made with umask 022
    assert proc.returncode == 0, proc.stderr
    for name in ("c.bin", "c.json", "c.docs", "c.docs.json"):
        assert oct((tmp_path / "out" / name).stat().st_mode & 0o777) == oct(0o644), name


def test_a_tokenizer_made_file_round_trips_to_its_text(runs):
    """A BPE trained on the inputs (--train-tokenizer), two workers; then the same tokenizer as a
    Hugging Face directory (--tokenizer DIR, EOS from its tokenizer_config.json)."""
    from tokenizers import Tokenizer

    tmp_path, proc = runs["bpe"]
    assert proc.returncode == 0, proc.stderr
    header = read_header(tmp_path / "bpe.bin")
    tokenizer = Tokenizer.from_file(header.tokenizer.path)
    ids = np.asarray(TokenFile.open(tmp_path / "bpe.bin").tokens)
    assert header.eos_id == tokenizer.token_to_id("<|endoftext|>") and header.max_id < header.vocab_size
    assert len(ids) < sum(len(d.encode()) for d in DOCS), "BPE merges bytes"
    assert [tokenizer.decode(d) for d in split_documents(ids, header.eos_id)] == IN_ORDER

    proc = runs["hf"][1]  # the inputs again, with tmp_path / "hf": a copy of the trained tokenizer.json
    assert proc.returncode == 0, proc.stderr
    assert read_header(tmp_path / "hf.bin").tokenizer.sha256 == header.tokenizer.sha256
    assert np.array_equal(np.asarray(TokenFile.open(tmp_path / "hf.bin").tokens), ids)


def test_ids_at_or_above_the_vocabulary_are_refused_at_preparation(runs):
    """A vocabulary declared smaller than the tokenizer's (--vocab-size): merged tokens (ids >= 257
    in a trained BPE) do not fit, and nothing is written."""
    assert runs["small-vocab-bpe"][1].returncode == 0, runs["small-vocab-bpe"][1].stderr
    tmp_path, proc = runs["small-vocab"]
    assert proc.returncode == 1
    refused = re.search(r"c.bin: token id (\d+) is outside the vocabulary of 257", proc.stderr)
    assert refused and int(refused.group(1)) >= 257, proc.stderr
    assert not (tmp_path / "c.bin").exists() and not list(tmp_path.glob(".c.bin*")), "nothing written"


def test_a_jsonl_record_without_the_text_key_is_named(runs):
    proc = runs["no-text-key"][1]
    assert proc.returncode == 1 and "d.jsonl:2: no string under key 'text'" in proc.stderr


def test_long_documents_are_encoded_in_pieces_with_unchanged_tokens(runs, tmp_path, monkeypatch):
    """A document longer than PIECE_BYTES is cut where byte-level pre-tokenization cuts anyway."""
    made, proc = runs["long"]  # the tool on long.txt, its tokenizer trained on it
    assert proc.returncode == 0, proc.stderr
    encoder = prepare.load_tokenizer(read_header(made / "bpe.bin").tokenizer.path)
    monkeypatch.setattr(docs, "PIECE_BYTES", 97)  # many pieces
    files = [made / "long.txt"]
    assert len(list(docs.documents(files, "text", docs.Progress(files)))) > 50
    header = prepare.prepare(docs.documents(files, "text", docs.Progress(files)), tmp_path / "pieces.bin", encoder)
    whole = TokenFile.open(made / "bpe.bin").tokens
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
