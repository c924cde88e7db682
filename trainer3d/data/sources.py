"""What a run trains and evaluates on, from ``cfg.data``: token files, their weights and spans.

    data=stdlib                        the built-in corpus (made once in data.cache_dir)
    data=chat_sample                   the built-in conversations and their loss mask (made once there)
    data=tokens data.path=a.bin        one token file
    data=tokens data.blend='[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]'
    data=tokens data.path=web_text_document data.eos_id=50256   a Megatron-LM dataset, in place

Validation: ``data.val_fraction`` holds out the last fraction of every training file (the
validation blend uses the training weights; an evaluation reads as many samples as the
held-out windows number, at most train.eval_steps global batches, so in a blend a file whose
share runs out first starts over), or ``data.val_path`` names a token file of its own (weight 1). ``plan`` is shared by the checks before launch (from headers) and by
the ranks (from the opened files), so both see the same windows.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from trainer3d.config.schema import Config, DataConfig
from trainer3d.data.corpus import stdlib_corpus
from trainer3d.data.sampler import Span, split
from trainer3d.data import megatron
from trainer3d.data.tokens import bin_path


@dataclass(frozen=True)
class Part:
    """One token file's share of the training (or validation) samples."""

    path: Path
    weight: float
    span: Span


def data_path(path) -> Path:
    """The .bin of a token file, or of a Megatron-LM dataset named by its prefix (or its .bin or
    .idx): trainer3d/data/megatron.py, read in place."""
    return megatron.paths(path)[0] if megatron.is_megatron(path) else bin_path(path)


def train_files(data: DataConfig) -> List[Tuple[Path, float]]:
    """(token file, weight) of every training source; makes the built-in corpus if needed."""
    if data.name == "stdlib":
        return [(stdlib_corpus(data.cache_dir), 1.0)]
    if data.name == "chat_sample":
        # Here, not at the top: the conversations' template and tokenizer import jinja2 and
        # tokenizers, which only this source uses (every rank and launcher imports this module).
        from trainer3d.data.chat_sample import chat_sample
        return [(chat_sample(data.cache_dir), 1.0)]
    if data.blend:
        return [(data_path(s.path), float(s.weight)) for s in data.blend]
    return [(data_path(data.path), 1.0)]


def val_file(data: DataConfig) -> Optional[Path]:
    return data_path(data.val_path) if data.val_path else None


def plan(cfg: Config, n_tokens_of: Callable[[Path], int]) -> Tuple[List[Part], List[Part]]:
    """(training parts, validation parts; empty without a validation set)."""
    seq, data = cfg.train.seq_len, cfg.data
    train, val = [], []
    for path, weight in train_files(data):
        n_train, n_val = split(n_tokens_of(path), data.val_fraction)
        train.append(Part(path, weight, Span(0, n_train, seq)))
        if n_val:
            val.append(Part(path, weight, Span(n_train, n_val, seq)))
    if data.val_path:
        path = val_file(data)
        val = [Part(path, 1.0, Span(0, n_tokens_of(path), seq))]
    return train, val


def short_parts(cfg: Config, train: List[Part], val: List[Part]) -> List[str]:
    """One line per part of ``plan`` shorter than one window: the sampler cannot draw from it
    (``SampleOrder`` refuses a source without a window), so a validation tail this short
    would end every rank as its reader is built. The checks before launch and the ranks'
    loader (trainer3d/data/loader.py) both ask this, of the same plan."""
    window, lines = cfg.train.seq_len + 1, []
    for part in train:
        if part.span.n_windows < 1:
            lines.append(f"{part.path}: {part.span.n_tokens} training tokens, shorter than one window of "
                         f"train.seq_len+1 = {window}; lower train.seq_len or use a longer corpus")
    for part in val:
        if part.span.n_windows >= 1:
            continue
        if cfg.data.val_path:
            lines.append(f"data.val_path={cfg.data.val_path}: {part.span.n_tokens} tokens, shorter than one window "
                         f"of train.seq_len+1 = {window}; give a longer file or lower train.seq_len")
        else:
            fraction = smallest_fraction(part.span.start + part.span.n_tokens, cfg.train.seq_len)
            fix = (f"set data.val_fraction={fraction} (the smallest that gives it one)" if fraction is not None
                   else "lower train.seq_len")
            lines.append(f"{part.path}: its validation tail (the last data.val_fraction={cfg.data.val_fraction} "
                         f"of it) is {part.span.n_tokens} tokens, shorter than one window of train.seq_len+1 = "
                         f"{window}; {fix}, or leave this file out of data.blend (data.val_fraction=0: no "
                         "validation)")
    return lines


def smallest_fraction(n_tokens: int, seq_len: int) -> Optional[float]:
    """The smallest data.val_fraction, in thousandths, whose tail of a file of ``n_tokens``
    holds one window (None: not below one half)."""
    for thousandths in range(1, 500):
        if Span(0, split(n_tokens, thousandths / 1000)[1], seq_len).n_windows >= 1:
            return thousandths / 1000
    return None


def eval_windows(cfg: Config, val_windows: int) -> int:
    """Validation windows per evaluation: all ``val_windows`` of the split, or the first
    train.eval_steps global batches of them where that is fewer. The last global batch may be
    partial: its padding counts in no loss (trainer3d/observe/evaluate.py)."""
    most = cfg.train.eval_steps
    return val_windows if most is None else min(val_windows, most * cfg.train.global_batch_size)


def evaluates(cfg: Config) -> bool:
    """Whether the run evaluates: an interval and a validation set."""
    return cfg.train.eval_every > 0 and (cfg.data.val_fraction > 0 or cfg.data.val_path is not None)
