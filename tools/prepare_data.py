#!/usr/bin/env python
"""Build a token file from text files, for ``data=tokens data.path=<out.bin>``.

    python tools/prepare_data.py --out data/corpus.bin my_texts/ notes.md
    python -m trainer3d.train data=tokens data.path=data/corpus.bin

Tokens are byte-level (256 byte values + an end-of-document token, vocabulary 257), the
same as the built-in corpus, so ``model=tiny`` trains on it as is. Directories are walked
recursively for files with the given suffixes; files are read in sorted order, so the
output is reproducible.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.data import BYTE_VOCAB, byte_tokens, write_token_file  # noqa: E402


def collect(inputs, suffixes):
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            files.extend(p for p in item.rglob("*") if p.is_file() and p.suffix in suffixes)
        elif item.is_file():
            files.append(item)
        else:
            raise SystemExit(f"prepare_data: {item} does not exist")
    return sorted(files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="text files or directories")
    parser.add_argument("--out", required=True, help="output token file (.bin; a .json header is written beside it)")
    parser.add_argument("--suffixes", default=".txt,.md,.py,.rst,.json",
                        help="file suffixes taken from directories (default: %(default)s)")
    args = parser.parse_args(argv)
    files = collect(args.inputs, set(args.suffixes.split(",")))
    if not files:
        raise SystemExit("prepare_data: no input files found")
    tokens = byte_tokens(f.read_bytes() for f in files)
    path = write_token_file(Path(args.out), tokens, BYTE_VOCAB)
    print(f"prepare_data: {len(files)} files -> {tokens.size:,} tokens in {path} (vocab {BYTE_VOCAB})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
