"""Token-file headers, the full scan and its cache, and the permissions of written files."""

import json
import os

import numpy as np
import pytest

import trainer3d.data.verify as verify
from trainer3d.data import BYTE_LEVEL, TokenFile, TokenFileError, TokenWriter, read_header, write_token_file
from trainer3d.data.tokens import HEADER_KEYS, header_path


@pytest.fixture
def path(tmp_path):
    return write_token_file(tmp_path / "t.bin", np.arange(5000) % 200, 250, BYTE_LEVEL, eos_id=0)


def edit_header(path, **changes):
    header = json.loads(header_path(path).read_text())
    for key, value in changes.items():
        if value is None:
            del header[key]
        else:
            header[key] = value
    header_path(path).write_text(json.dumps(header))


@pytest.mark.parametrize("key", HEADER_KEYS)
def test_a_header_missing_a_key_is_refused_naming_it(path, key):
    edit_header(path, **{key: None})
    with pytest.raises(TokenFileError, match=f"lacks {key}.*prepare_data"):
        read_header(path)


def test_an_older_header_is_refused_with_the_fix(path):
    header_path(path).write_text(json.dumps({"dtype": "uint16", "vocab_size": 250, "n_tokens": 5000}))
    with pytest.raises(TokenFileError, match=r"lacks max_id, eos_id, tokenizer, sha256 .*tools/prepare_data.py"):
        TokenFile.open(path)


def test_ids_at_or_above_the_vocabulary_are_refused_when_written(tmp_path):
    with pytest.raises(TokenFileError, match=r"token id 250 is outside the vocabulary of 250"):
        with TokenWriter(tmp_path / "bad.bin", 250, BYTE_LEVEL, eos_id=0) as out:
            out.write(np.arange(100))
            out.write(np.array([3, 250, 4]))
    assert list(tmp_path.iterdir()) == [], "nothing published, no temp file left"


def test_a_header_that_lies_about_the_max_id_is_caught_by_the_scan(path, tmp_path):
    edit_header(path, max_id=150)  # the data holds 199
    with pytest.raises(TokenFileError, match="holds ids up to 199, its header says max_id 150"):
        TokenFile.open(path, cache_dir=str(tmp_path / "cache"))


def test_changed_data_is_caught_by_the_checksum(path, tmp_path):
    data = bytearray(path.read_bytes())
    data[100:102] = (7).to_bytes(2, "little")  # same size, same max id, other content
    path.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match="sha256 of the data does not match"):
        TokenFile.open(path, cache_dir=str(tmp_path / "cache"))


def test_a_file_is_scanned_once_per_version(path, tmp_path, monkeypatch):
    scans = []
    real_scan = verify.scan
    monkeypatch.setattr(verify, "scan", lambda *a: scans.append(a) or real_scan(*a))
    cache = str(tmp_path / "cache")
    for _ in range(3):
        TokenFile.open(path, cache_dir=cache)
    assert len(scans) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10 ** 9))  # "changed"
    TokenFile.open(path, cache_dir=cache)
    assert len(scans) == 2


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = write_token_file(tmp_path / "u.bin", np.arange(10), 257, BYTE_LEVEL)
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(mode)
    assert oct(header_path(path).stat().st_mode & 0o777) == oct(mode)


def test_a_cache_that_cannot_be_written_means_a_scan_every_time(path, tmp_path, monkeypatch):
    scans = []
    real_scan = verify.scan
    monkeypatch.setattr(verify, "scan", lambda *a: scans.append(a) or real_scan(*a))
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory would be")
    for _ in range(2):
        TokenFile.open(path, cache_dir=str(blocked))
    assert len(scans) == 2


def test_ids_at_or_above_the_vocabulary_are_refused_when_opened(path, tmp_path):
    edit_header(path, vocab_size=150)  # the header's own max_id (199) no longer fits
    with pytest.raises(TokenFileError, match="ids up to 199 .* but vocab_size 150: ids must be below the vocabulary"):
        TokenFile.open(path)
    edit_header(path, vocab_size=250, max_id=149)  # a header hiding the ids 150..199: the scan finds them
    with pytest.raises(TokenFileError, match="holds ids up to 199, its header says max_id 149"):
        TokenFile.open(path, cache_dir=str(tmp_path / "cache"))
