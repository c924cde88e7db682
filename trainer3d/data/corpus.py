"""The built-in corpus and the byte-level tokenizer it uses.

The built-in corpus is this Python's standard-library source: present on every machine,
no download. It is tokenised byte-level — the 256 byte values, and 256 as the end of a
document (vocabulary 257) — once into the cache directory. tools/prepare_data.py makes
the same tokens from your texts when no ``--tokenizer`` is given.
"""

import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

from trainer3d.data.tokens import TokenizerInfo, TokenWriter, bin_path, header_path, read_header, TokenFileError

EOF_TOKEN = 256
BYTE_VOCAB = 257
BYTE_LEVEL = TokenizerInfo(
    name="byte-level",
    sha256=hashlib.sha256(b"trainer3d byte-level: ids 0-255 are bytes, 256 ends a document").hexdigest())
CORPUS_VERSION = 2
"""Bumped when the cached corpus's format changes, so an older cache is never read."""


def byte_tokens(chunks: Iterable[bytes]) -> np.ndarray:
    """Byte-level tokens: each chunk's bytes, then EOF_TOKEN."""
    parts = []
    for chunk in chunks:
        parts.append(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([EOF_TOKEN], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def stdlib_sources() -> list:
    """This interpreter's standard-library .py files, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def stdlib_corpus(cache_dir: str) -> Path:
    """Tokenise the standard library once into ``cache_dir``; return the token file path."""
    v = sys.version_info
    path = bin_path(Path(cache_dir).expanduser() / f"stdlib-py{v.major}{v.minor}{v.micro}-v{CORPUS_VERSION}.bin")
    if path.exists() and header_path(path).exists():
        try:
            read_header(path)
            return path
        except TokenFileError:  # a damaged cache: make it again
            pass
    print(f"trainer3d: tokenising the standard library into {path} (once)", flush=True)
    with TokenWriter(path, BYTE_VOCAB, BYTE_LEVEL, EOF_TOKEN) as out:
        for source in stdlib_sources():
            out.write(byte_tokens([source.read_bytes()]))
    return path
