"""Class: data preparation inputs. What a file holds is decided by its bytes: gzip/zstd are read
whatever the name, xz and other formats (or binary data) are refused, never tokenised as text;
a corrupt stream, a malformed tokenizer_config.json, an output or header path that is a
directory, a JSON Lines record nested past recursion or longer than the record limit: each one
line naming the file (and line), with no temporary file left behind; memory stays within a
small multiple of the largest record."""

import bz2
import gzip
import json
import lzma
import tracemalloc
import zipfile

import numpy as np
import pytest
import zstandard

from trainer3d.tools import prepare_data
from trainer3d.data import TokenFile
from trainer3d.data import documents as docs
from trainer3d.data import prepare

TEXT = "plain words of a document\nand a second line\n"


def _tool(capsys, tmp_path, *args):
    code = prepare_data.main([*map(str, args)] if "--out" in args else ["--out", str(tmp_path / "out" / "c.bin"),
                                                                         *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    left = [p.name for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert left == [], f"temporary files left: {left}"
    return code, err


def _zip(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a.txt", TEXT)


REFUSED = {
    "a.txt.xz": (lambda p: p.write_bytes(lzma.compress(TEXT.encode())), "xz data"),
    "hidden-xz.txt": (lambda p: p.write_bytes(lzma.compress(TEXT.encode())), "xz data"),
    "b.txt": (lambda p: p.write_bytes(bz2.compress(TEXT.encode())), "bzip2 data"),
    "c.jsonl": (_zip, "zip data"),
    "d.txt.gz": (lambda p: p.write_text(TEXT), "gz (by its name"),
    "e.txt.zst": (lambda p: p.write_text(TEXT), "zst (by its name"),
    "f.txt": (lambda p: p.write_bytes(b"text\0\x01\x02binary"), "binary (NUL bytes"),
    "g.txt.gz": (lambda p: p.write_bytes(gzip.compress(TEXT.encode() * 50)[:60] + b"\xff" * 40), "corrupt"),
    "h.jsonl.zst": (lambda p: p.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n' * 500)[:-9]),
                    "corrupt"),
    "i.jsonl": (lambda p: p.write_text('{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"),
                "i.jsonl:2: nested too deeply"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_an_input_that_is_not_readable_text_is_one_line_naming_it(tmp_path, capsys, name):
    make, expect = REFUSED[name]
    make(tmp_path / name)
    code, err = _tool(capsys, tmp_path, tmp_path / name)
    assert code == 1 and len(err) == 1 and err[0].startswith("prepare_data: ") and name in err[0], err
    assert expect in err[0], err
    assert not (tmp_path / "out" / "c.bin").exists()


def test_compression_is_recognised_by_content_not_by_name(tmp_path, capsys):
    (tmp_path / "plain.txt").write_text(TEXT)
    (tmp_path / "packed.txt").write_bytes(gzip.compress(TEXT.encode()))
    (tmp_path / "packed.md").write_bytes(zstandard.ZstdCompressor().compress(TEXT.encode()))
    outs = []
    for name in ("plain.txt", "packed.txt", "packed.md"):
        out = tmp_path / f"{name}.bin"
        code, err = _tool(capsys, tmp_path, "--out", out, tmp_path / name)
        assert code == 0, err
        outs.append(TokenFile.open(out).tokens)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    prepare.train_tokenizer(iter([TEXT] * 20), 300, d / "tokenizer.json")
    return d


@pytest.mark.parametrize("config,expect", [
    ("{not json", "is not valid JSON"),
    ('{"eos_token": ["<|endoftext|>"]}', "eos_token is list"),
    ('{"eos_token": {"content": 7}}', "eos_token is int 7"),
    ('{"eos_token": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests lists or objects deeper"),
    (None, "is a directory"),
], ids=["not-json", "list", "content-int", "deep", "directory"])
def test_a_malformed_tokenizer_config_is_one_line(tmp_path, capsys, tokenizer_dir, config, expect):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    if config is None:
        (d / "tokenizer_config.json").mkdir()
    else:
        (d / "tokenizer_config.json").write_text(config)
    (tmp_path / "a.txt").write_text(TEXT)
    code, err = _tool(capsys, tmp_path, "--tokenizer", d, tmp_path / "a.txt")
    assert code == 1 and len(err) == 1 and "tokenizer_config.json" in err[0] and expect in err[0], err


@pytest.mark.parametrize("directory", ["c.bin", "c.json"])
def test_an_output_or_header_path_that_is_a_directory_is_one_line(tmp_path, capsys, directory):
    (tmp_path / "out" / directory).mkdir(parents=True)
    (tmp_path / "a.txt").write_text(TEXT)
    code, err = _tool(capsys, tmp_path, tmp_path / "a.txt")
    assert code == 1 and len(err) == 1 and f"{tmp_path / 'out' / directory} is a directory" in err[0], err
    assert (tmp_path / "out" / directory).is_dir() and len(list((tmp_path / "out").iterdir())) == 1


def test_a_record_over_the_limit_is_refused_naming_its_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(docs, "MAX_RECORD_BYTES", 1000)
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "x" * 2000}) + "\n")
    code, err = _tool(capsys, tmp_path, tmp_path / "r.jsonl")
    assert code == 1 and len(err) == 1 and "r.jsonl:2: a record longer than 1000 bytes" in err[0], err


def test_preparation_memory_is_a_small_multiple_of_the_largest_record(tmp_path):
    """A 24 MB record among small ones, byte level, in process: the peak traced bytes stay
    within the four copies documents.py states (plus the batches' fixed share)."""
    record = 24 << 20
    with open(tmp_path / "big.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"small record {i}"}) + "\n")
        f.write(json.dumps({"text": "y" * record}) + "\n")
    files = [tmp_path / "big.jsonl"]
    tracemalloc.start()
    try:
        prepare.prepare(docs.documents(files, "text", docs.Progress(files)), tmp_path / "m.bin", prepare.BYTE_ENCODER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"peak {peak / record:.2f} x the largest record")
    assert peak < 4 * record + (8 << 20)


def test_a_token_header_that_is_a_directory_is_refused_when_read(tmp_path):
    from trainer3d.data.tokens import TokenFileError, read_header

    (tmp_path / "c.bin").write_bytes(b"\0" * 8)
    (tmp_path / "c.json").mkdir()
    with pytest.raises(TokenFileError, match=rf"{tmp_path / 'c.json'} is a directory, not a JSON file"):
        read_header(tmp_path / "c.bin")


def test_an_empty_suffix_entry_takes_files_without_a_suffix(tmp_path, capsys):
    """As --help and docs/data.md say: ``--suffixes .txt,`` reads README beside a.txt; without
    the empty entry README is not an input."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(TEXT)
    (tmp_path / "in" / "README").write_text(TEXT)
    counts = {}
    for suffixes in (".txt", ".txt,"):
        out = tmp_path / f"out{len(counts)}.bin"
        code, err = _tool(capsys, tmp_path, "--out", out, "--suffixes", suffixes, tmp_path / "in")
        assert code == 0, err
        counts[suffixes] = TokenFile.open(out).header.n_tokens
    assert counts[".txt,"] == 2 * counts[".txt"]


def test_an_output_inside_an_input_directory_is_refused_and_other_token_files_are_not_read(tmp_path, capsys):
    """An output inside a directory it reads is refused (it would read its own header and trained
    tokenizer back next time); a directory holding another run's token file, header and trained
    tokenizer (.json, a default suffix) is read as its text alone (the reference: a run on the text)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(TEXT * 20)
    other = tmp_path / "in" / "older.bin"
    assert _tool(capsys, tmp_path, "--out", other, "--train-tokenizer", 300, tmp_path / "in" / "a.txt")[0] == 0
    code, err = _tool(capsys, tmp_path, "--out", tmp_path / "in" / "c.bin", tmp_path / "in")
    assert code == 1 and "lies inside the input" in err[0] and len(err) == 1, err
    out = tmp_path / "c.bin"
    assert _tool(capsys, tmp_path, "--out", out, "--train-tokenizer", 300, tmp_path / "in")[0] == 0
    reference = tmp_path / "ref.bin"
    assert _tool(capsys, tmp_path, "--out", reference, "--train-tokenizer", 300, tmp_path / "in" / "a.txt")[0] == 0
    assert TokenFile.open(out).header.n_tokens == TokenFile.open(reference).header.n_tokens
    assert docs.collect([str(tmp_path / "in")], {".txt", ".json"}) == [tmp_path / "in" / "a.txt"]


def test_an_output_given_as_an_input_is_refused(tmp_path, capsys):
    out = tmp_path / "c.bin"
    (tmp_path / "a.txt").write_text(TEXT)
    assert _tool(capsys, tmp_path, "--out", out, tmp_path / "a.txt")[0] == 0
    code, err = _tool(capsys, tmp_path, "--out", out, tmp_path / "a.txt", tmp_path / "c.json")
    assert code == 1 and err == [f"prepare_data: {tmp_path / 'c.json'} is also an input of this command; write "
                                 "the output elsewhere"], err


def test_symlinked_sub_directories_are_followed_once_each(tmp_path):
    """A linked directory's files are inputs (they were skipped); a link back up (a cycle) and a
    second link to the same directory add nothing."""
    root, shared = tmp_path / "in", tmp_path / "shared"
    root.mkdir()
    shared.mkdir()
    (root / "a.txt").write_text(TEXT)
    (shared / "b.txt").write_text(TEXT)
    (root / "linked").symlink_to(shared)
    (root / "again").symlink_to(shared)
    (shared / "up").symlink_to(root)  # a cycle
    found = docs.collect([str(root)], {".txt"})
    assert sorted(p.name for p in found) == ["a.txt", "b.txt"], found
