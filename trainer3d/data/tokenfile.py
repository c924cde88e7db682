"""An opened token file: its header checked, its contents verified once, its ids memory-mapped.

The header format and the writer are in trainer3d/data/tokens.py; the once-per-file scan
(checksum and max id) is trainer3d/data/verify.py, which reads that format too.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from trainer3d.data.tokens import DTYPES, PREPARE_HINT, TokenFileError, TokenHeader, bin_path, read_header
from trainer3d.data.verify import verify_token_file


@dataclass
class TokenFile:
    """An opened token file: its checked header and its ids, memory-mapped (read-only)."""

    path: Path
    header: TokenHeader
    tokens: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @classmethod
    def open(cls, path, cache_dir: Optional[str] = None, verify: bool = True) -> "TokenFile":
        """Check and map ``path``: header, size, and (``verify``) a full scan of checksum and max id,
        done at most once per version of the file (cached under ``cache_dir``)."""
        path = bin_path(path)
        header = read_header(path)
        size = path.stat().st_size
        if size != header.n_tokens * header.itemsize:
            raise TokenFileError(f"{path} is {size} bytes, its header says {header.n_tokens} {header.dtype} "
                                 f"tokens = {header.n_tokens * header.itemsize} bytes: the file is truncated or "
                                 f"was changed; {PREPARE_HINT}")
        if header.n_tokens == 0:
            raise TokenFileError(f"{path} holds no tokens (empty input?); {PREPARE_HINT} from non-empty texts")
        if verify:
            verify_token_file(path, header, cache_dir)
        tokens = np.memmap(path, dtype=DTYPES[header.dtype], mode="r", shape=(header.n_tokens,))
        return cls(path=path, header=header, tokens=tokens)
