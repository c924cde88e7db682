"""Training tokens: token files, the built-in corpus, and a deterministic, resumable sampler.

A token file is a flat array of token ids (``<name>.bin``, uint16 or uint32) with a JSON
header beside it (``<name>.json``: dtype, vocab_size, n_tokens). It is memory-mapped, so
every rank reads only the windows it trains on.

The built-in corpus is this Python's standard-library source: present on every machine,
no download. It is tokenised byte-level (256 byte values + an end-of-file token = 257)
once into the cache directory.

Sampling: the corpus is cut into non-overlapping windows of seq_len + 1 tokens, and
shuffled by a permutation drawn from the seed (a new one each epoch). Step ``s`` trains on
windows ``s * G ... (s + 1) * G - 1`` of that order (G = global batch), so the global batch
of a step is the same whatever the layout; data-parallel rank ``d`` takes the ``d``-th
contiguous slice of it and splits that into grad_accum micro-batches. The whole position
is the step number: resuming at step ``s`` reads exactly what an uninterrupted run would.
"""

import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import torch

from trainer3d.config import DataConfig

EOF_TOKEN = 256
BYTE_VOCAB = 257


# --------------------------------------------------------------------------- token files

def write_token_file(path: Path, tokens: np.ndarray, vocab_size: int) -> Path:
    """Write ``tokens`` and its header atomically (temp file + rename), return the .bin path."""
    path = Path(path).with_suffix(".bin")
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    header = {"dtype": np.dtype(dtype).name, "vocab_size": int(vocab_size), "n_tokens": int(tokens.size)}
    for target, write in ((path, lambda f: f.write(tokens.astype(dtype).tobytes())),
                          (path.with_suffix(".json"), lambda f: f.write(json.dumps(header).encode()))):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    return path


@dataclass
class TokenFile:
    path: Path
    tokens: np.ndarray  # memory-mapped
    vocab_size: int

    @classmethod
    def open(cls, path) -> "TokenFile":
        path = Path(path).expanduser().with_suffix(".bin")
        header_path = path.with_suffix(".json")
        if not path.exists() or not header_path.exists():
            raise FileNotFoundError(f"token file {path} (or its header {header_path.name}) not found; "
                                    "make one with: python tools/prepare_data.py --out <file.bin> <texts...>")
        header = json.loads(header_path.read_text())
        tokens = np.memmap(path, dtype=np.dtype(header["dtype"]), mode="r")
        if tokens.size != header["n_tokens"]:
            raise ValueError(f"{path} holds {tokens.size} tokens, its header says {header['n_tokens']}: "
                             "the file is truncated; rebuild it")
        return cls(path=path, tokens=tokens, vocab_size=int(header["vocab_size"]))


def byte_tokens(chunks: Iterable[bytes]) -> np.ndarray:
    """Byte-level tokens: each chunk's bytes, then EOF_TOKEN."""
    parts = []
    for chunk in chunks:
        parts.append(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([EOF_TOKEN], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


# --------------------------------------------------------------------------- the built-in corpus

def stdlib_sources() -> list:
    """This interpreter's standard-library .py files, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def stdlib_corpus(cache_dir: str) -> Path:
    """Tokenise the standard library once into ``cache_dir``; return the token file path."""
    tag = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}{sys.version_info.micro}"
    path = Path(cache_dir).expanduser() / f"{tag}.bin"
    if path.exists() and path.with_suffix(".json").exists():
        return path
    print(f"trainer3d: tokenising the standard library into {path} (once)", flush=True)
    write_token_file(path, byte_tokens(p.read_bytes() for p in stdlib_sources()), BYTE_VOCAB)
    return path


def prepare_dataset(cfg: DataConfig) -> Path:
    """Make sure the token file exists (in the submitting process, before ranks start)."""
    if cfg.name == "stdlib":
        return stdlib_corpus(cfg.cache_dir)
    return TokenFile.open(cfg.path).path


# --------------------------------------------------------------------------- sampling

class WindowSampler:
    """Which corpus windows make up each step's global batch (pure, deterministic)."""

    def __init__(self, n_tokens: int, seq_len: int, global_batch_size: int, seed: int):
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.n_windows = (n_tokens - 1) // seq_len
        if self.n_windows < global_batch_size:
            raise ValueError(f"corpus of {n_tokens} tokens has {self.n_windows} windows of "
                             f"train.seq_len={seq_len}, fewer than train.global_batch_size={global_batch_size}")
        self._perms: Dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._perms[epoch]

    def windows(self, step: int, start: int = 0, count: Optional[int] = None) -> np.ndarray:
        """Window ids of samples ``start .. start+count`` of step ``step``'s global batch."""
        count = self.global_batch_size - start if count is None else count
        first = step * self.global_batch_size + start
        ids = np.empty(count, dtype=np.int64)
        for i in range(count):
            epoch, pos = divmod(first + i, self.n_windows)
            ids[i] = self._order(epoch)[pos]
        return ids


class DataLoader:
    """This data-parallel rank's micro-batches for a step.

    ``batch(step)`` returns (inputs, targets), each (grad_accum, micro_batch, seq_len) int64;
    the pipeline reads inputs on its first stage and targets on its last.
    """

    def __init__(self, token_file: TokenFile, seq_len: int, micro_batch_size: int,
                 grad_accum_steps: int, dp: int, dp_rank: int, seed: int):
        self.tokens = token_file.tokens
        self.seq_len = seq_len
        self.micro = micro_batch_size
        self.accum = grad_accum_steps
        self.dp_rank = dp_rank
        self.sampler = WindowSampler(len(self.tokens), seq_len, micro_batch_size * grad_accum_steps * dp, seed)

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.micro * self.accum
        ids = self.sampler.windows(step, start=self.dp_rank * per_rank, count=per_rank)
        starts = ids * self.seq_len
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        rows = torch.from_numpy(rows).view(self.accum, self.micro, self.seq_len + 1)
        return rows[..., :-1], rows[..., 1:]

    @staticmethod
    def state_dict(step: int, global_batch_size: int) -> dict:
        """The whole loader position: the next step (and samples consumed, for the record)."""
        return {"step": step, "consumed_samples": step * global_batch_size}
