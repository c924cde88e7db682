"""Everything about the data that can be known before launch, checked in the submitting process.

``check_data(cfg)`` returns one line per problem, each naming the file and the fix (the
entry point prints them and exits with status 2, as for config errors): a missing file, an
incomplete or inconsistent header, a size that disagrees with it, an empty file, data that
fails its full scan (checksum, max id; trainer3d/data/verify.py caches a passed scan), a
vocabulary or an id the model cannot embed, blended or validation files made with different
tokenizers, a corpus shorter than one window or than a global batch, a validation split
without one window (naming the smallest ``data.val_fraction`` that holds one; any number of
windows evaluates, the last global batch partial), with ``data.document_mask`` a document
index that does not belong to its token file, and a loss mask (``data.loss_mask``) missing, of
another version of its token file, or damaged. The ranks re-check only what could have changed
since (size and mtime, through the same cache).
"""

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional

from trainer3d.config.schema import Config
from trainer3d.data.doc_index import document_starts
from trainer3d.data.sources import evaluates, plan, short_parts, train_files, val_file
from trainer3d.data.loss_mask import open_mask
from trainer3d.data.tokenfile import TokenFile
from trainer3d.data.tokens import TokenFileError, TokenHeader


def _open_headers(cfg: Config, problems: List[str]) -> Dict[Path, TokenHeader]:
    paths = [p for p, _ in train_files(cfg.data)] + ([val_file(cfg.data)] if cfg.data.val_path else [])
    headers: Dict[Path, TokenHeader] = {}
    for path in dict.fromkeys(paths):
        try:
            opened = TokenFile.open(path, cache_dir=cfg.data.cache_dir, eos_id=cfg.data.eos_id,
                                    vocab_size=cfg.model.vocab_size)
            headers[path] = opened.header
            if cfg.data.document_mask:
                document_starts(opened)  # a mismatched or damaged document index is refused, naming it
        except TokenFileError as err:
            problems.append(str(err))
    return headers


def _check_vocab(cfg: Config, headers: Dict[Path, TokenHeader], problems: List[str]) -> None:
    model_vocab = cfg.model.vocab_size
    for path, h in headers.items():
        # Every id is below the header's vocabulary (read_header) and the data holds no larger
        # one (the scan), so this one comparison keeps every id inside the model's embedding.
        if h.vocab_size > model_vocab:
            problems.append(f"{path}: tokenizer vocabulary {h.vocab_size} > model.vocab_size={model_vocab}; "
                            f"set model.vocab_size={h.vocab_size} (or more)")
    identities = {h.tokenizer.sha256: (path, h.tokenizer.name) for path, h in headers.items()}
    if len(identities) > 1:
        (a, a_name), (b, b_name) = list(identities.values())[:2]
        problems.append(f"{a} (tokenizer {a_name}) and {b} (tokenizer {b_name}) were made with different "
                        "tokenizers: blended and validation files must share one; re-tokenize one of them "
                        "with the other's tokenizer (tools/prepare_data.py --tokenizer ...)")


def _check_windows(cfg: Config, headers: Dict[Path, TokenHeader], problems: List[str]) -> None:
    t = cfg.train
    window, batch = t.seq_len + 1, t.global_batch_size
    train, val = plan(cfg, lambda path: headers[path].n_tokens)
    short = short_parts(cfg, train, val)
    problems += short
    total = sum(p.span.n_windows for p in train)
    if all(p.span.n_windows for p in train) and total < batch:
        names = ", ".join(str(p.path) for p in train)
        problems.append(f"{names}: {total} windows of train.seq_len+1 = {window} tokens, fewer than "
                        f"train.global_batch_size={batch}; lower train.global_batch_size or train.seq_len")
    if not evaluates(cfg) or short or any(p.span.n_windows for p in val):
        return  # a split of any number of windows evaluates, its last global batch partial (observe/evaluate.py)
    # Only data.val_fraction gets here: a data.val_path shorter than a window is one of ``short``.
    fraction = smallest_val_fraction(cfg, lambda path: headers[path].n_tokens)
    fix = (f"set data.val_fraction={fraction} (the smallest that holds one)" if fraction is not None else
           "the corpus cannot spare one for validation: lower train.seq_len or train.global_batch_size")
    problems.append(f"data.val_fraction={cfg.data.val_fraction}: the validation split holds no window of "
                    f"train.seq_len+1 = {window} tokens; {fix}, or set train.eval_every=0")


def smallest_val_fraction(cfg: Config, n_tokens_of) -> Optional[float]:
    """The smallest data.val_fraction, in steps of 0.001, whose split holds a validation window
    (one in every blended file's tail that holds a token) and leaves one global batch of
    training windows; None where none does."""
    batch = cfg.train.global_batch_size
    for thousandths in range(1, 500):
        trial = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_fraction=thousandths / 1000))
        train, val = plan(trial, n_tokens_of)
        if any(p.span.n_windows for p in val) and not short_parts(trial, train, val):
            return thousandths / 1000 if sum(p.span.n_windows for p in train) >= batch else None
    return None


def check_data(cfg: Config) -> List[str]:
    """One line per problem with the run's data (empty: all good). ``cfg`` is validated."""
    problems: List[str] = []
    headers = _open_headers(cfg, problems)
    if problems:
        return problems
    _check_vocab(cfg, headers, problems)
    _check_windows(cfg, headers, problems)
    _check_masks(cfg, headers, problems)
    return problems


def _check_masks(cfg: Config, headers: Dict[Path, TokenHeader], problems: List[str]) -> None:
    """data.loss_mask: every training and validation file has its loss mask, of its own version,
    intact (trainer3d/data/loss_mask.py; the full scan is remembered as a token file's is)."""
    if not cfg.data.loss_mask:
        return
    for path, header in headers.items():
        try:
            open_mask(path, header, cfg.data.cache_dir)
        except (TokenFileError, OSError) as err:
            problems.append(str(err))

