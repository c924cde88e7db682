"""An opened token file: its header checked, its contents verified once, its ids memory-mapped.

The header format and the writer are in trainer3d/data/tokens.py; the once-per-file scan
(checksum and max id) is trainer3d/data/verify.py, which reads that format too. A Megatron-LM
dataset (PREFIX.bin + PREFIX.idx, no .json header) opens in place as the same object: its
ids are trainer3d/data/megatron.py's ``DocumentStream``, its header made from the checks.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from trainer3d.data import megatron
from trainer3d.data.tokens import DTYPES, PREPARE_HINT, TokenFileError, TokenHeader, bin_path, read_header
from trainer3d.data.verify import verify_token_file


@dataclass
class TokenFile:
    """An opened token file: its checked header and its ids, memory-mapped (read-only)."""

    path: Path
    header: TokenHeader
    tokens: Union[np.ndarray, megatron.DocumentStream]
    """Sliced as ``tokens[a:b]`` (contiguous ids)."""

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @classmethod
    def open(cls, path, cache_dir: Optional[str] = None, verify: bool = True, eos_id: Optional[int] = None,
             vocab_size: Optional[int] = None) -> "TokenFile":
        """Check and map ``path``: header, size, and (``verify``) a full scan of checksum and max id,
        done at most once per version of the file (cached under ``cache_dir``). A Megatron dataset
        needs ``eos_id`` (data.eos_id) and ``vocab_size`` (the model's), which its files lack."""
        if megatron.is_megatron(path):
            if vocab_size is None:
                raise TokenFileError(f"{path}: a Megatron-LM dataset opens with the model's vocabulary size")
            header, stream = megatron.open_in_place(path, eos_id, vocab_size, cache_dir)
            return cls(path=megatron.paths(path)[0], header=header, tokens=stream)
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
