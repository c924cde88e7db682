"""The engine of tools/prepare_data.py: documents -> token ids in worker processes -> a token file.

Encoders: byte-level (the default; the built-in corpus's 257 ids) or a Hugging Face
``tokenizers`` tokenizer (a tokenizer.json, or a directory holding one). Loading one only
parses JSON (the Rust ``tokenizers`` library; no Python code from the directory runs).
``train_tokenizer`` makes a byte-level BPE from the inputs, offline.

Streaming: the main process reads documents in batches (trainer3d/data/documents.py),
keeps at most ``2 * workers`` of them in flight, and writes the ids in input order, so
memory stays bounded whatever the input size. Each worker is one process encoding with
one thread (TOKENIZERS_PARALLELISM=false), so ``--workers N`` uses N cores.
"""

import collections
import hashlib
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer3d.config.jsonfile import read_json_object
from trainer3d.data.corpus import BYTE_LEVEL, BYTE_VOCAB, EOF_TOKEN
from trainer3d.data.documents import Piece, batched
from trainer3d.data.doc_index import DocIndexWriter
from trainer3d.data.tokens import TokenHeader, TokenizerInfo, TokenWriter

BATCH_BYTES = 1 << 20
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
TRAINED_EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Encoder:
    """What a worker needs to encode: the tokenizer's JSON (None: byte level) and the EOS id."""

    tokenizer_json: Optional[str]
    eos_id: int
    vocab_size: int
    info: TokenizerInfo


BYTE_ENCODER = Encoder(None, EOF_TOKEN, BYTE_VOCAB, BYTE_LEVEL)


def _configured_eos(config_path: Path, where: str) -> Optional[str]:
    """The eos_token a tokenizer_config.json names (a string, or an object with a string
    ``content``), None if it names none; ValueError naming the file and key if malformed."""
    try:
        config = read_json_object(config_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: {config_path} cannot be read ({err}); fix it or name the token with "
                         "--eos-token") from None
    eos = config.get("eos_token")
    token = eos.get("content") if isinstance(eos, dict) else eos
    if token is not None and not isinstance(token, str):
        raise ValueError(f"{where}: {config_path}: eos_token is {type(token).__name__} {token!r}, not a string "
                         "(or an object with a string content); fix it or name the token with --eos-token")
    return token


def _eos_token(tokenizer_dir: Optional[Path], vocab: dict, eos_token: Optional[str], where: str) -> str:
    if eos_token is None and tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").exists():
        eos_token = _configured_eos(tokenizer_dir / "tokenizer_config.json", where)
    if eos_token is None:
        eos_token = next((t for t in EOS_CANDIDATES if t in vocab), None)
    if eos_token is None or eos_token not in vocab:
        raise ValueError(f"{where}: no end-of-document token {'' if eos_token is None else repr(eos_token) + ' '}"
                         "in its vocabulary; name one with --eos-token")
    return eos_token


def load_tokenizer(spec: str, eos_token: Optional[str] = None) -> Encoder:
    """An Encoder from a tokenizer.json or a directory holding one (and maybe tokenizer_config.json)."""
    path = Path(spec).expanduser().resolve()
    directory = path if path.is_dir() else None
    file = path / "tokenizer.json" if directory else path
    if not file.is_file():
        raise ValueError(f"--tokenizer {spec}: no {file.name} there (give a tokenizer.json or a directory "
                         "holding one, e.g. a Hugging Face model directory)")
    try:
        text = file.read_text()
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises its own exception type for a malformed file
        raise ValueError(f"--tokenizer {spec}: {file} is not a tokenizers JSON file ({err})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos = _eos_token(directory, vocab, eos_token, f"--tokenizer {spec}")
    info = TokenizerInfo(name=path.name, sha256=hashlib.sha256(text.encode()).hexdigest(), path=str(file))
    return Encoder(text, vocab[eos], max(vocab.values()) + 1, info)


def train_tokenizer(texts: Iterator[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` is id 0) on ``texts``; save it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(tokenizer.to_str())  # open(): the umask's permissions, as for the token file
        os.replace(tmp, out)
    except BaseException:  # a full disk, an output path that is a directory: no temp file stays
        tmp.unlink(missing_ok=True)
        raise
    return out


# --------------------------------------------------------------------------- encoding

_WORKER: dict = {}


def _init_worker(encoder: Encoder) -> None:
    _WORKER["encoder"], _WORKER["tokenizer"] = encoder, None
    if encoder.tokenizer_json is not None:
        _WORKER["tokenizer"] = Tokenizer.from_str(encoder.tokenizer_json)


def encode_batch(batch: List[Piece]) -> Tuple[np.ndarray, List[int]]:
    """Token ids of a batch of pieces, the EOS id after each piece that ends a document; and
    where each of those documents ends (the offset after its EOS id), for the document index."""
    encoder, tokenizer = _WORKER["encoder"], _WORKER["tokenizer"]
    dtype = np.uint16 if encoder.vocab_size <= 2 ** 16 else np.uint32  # the token file's own width
    if tokenizer is None:  # bytes straight into the output: no per-piece copy of the ids
        data = [p.text if isinstance(p.text, bytes) else p.text.encode() for p in batch]
        ids = [np.frombuffer(d, dtype=np.uint8) for d in data]
    else:
        texts = [p.text.decode("utf-8", errors="replace") if isinstance(p.text, bytes) else p.text for p in batch]
        ids = [np.asarray(e.ids, dtype=dtype) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    out = np.empty(sum(len(i) for i in ids) + sum(p.ends_document for p in batch), dtype=dtype)
    at, ends = 0, []
    for piece, piece_ids in zip(batch, ids):
        out[at:at + len(piece_ids)] = piece_ids
        at += len(piece_ids)
        if piece.ends_document:
            out[at] = encoder.eos_id
            at += 1
            ends.append(at)
    return out, ends


def encode_all(batches: Iterator[List[Piece]], encoder: Encoder,
               workers: int) -> Iterator[Tuple[np.ndarray, List[int]]]:
    """Encoded batches, in input order; at most 2 * workers batches in flight."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: --workers decides the cores
    if workers <= 1:
        _init_worker(encoder)
        yield from map(encode_batch, batches)
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.submit(encode_batch, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def prepare(pieces: Iterator[Piece], out: Path, encoder: Encoder, workers: int = 1,
            vocab_size: Optional[int] = None, on_tokens: Callable[[int], None] = lambda n: None) -> TokenHeader:
    """Encode ``pieces`` into the token file ``out``; returns its header. ``vocab_size`` (default:
    the tokenizer's) is recorded in the header, and ids at or above it are refused. The document
    index (trainer3d/data/doc_index.py) is written beside it from the pieces' own boundaries."""
    index = DocIndexWriter(out)
    try:
        with TokenWriter(out, vocab_size or encoder.vocab_size, encoder.info, encoder.eos_id) as writer:
            pending = 0  # the next document's start, written once a token of it is
            for ids, ends in encode_all(batched(pieces, BATCH_BYTES), encoder, workers):
                base, top = writer.n_tokens, writer.n_tokens + len(ids)
                writer.write(ids)
                starts = ([] if pending is None else [pending]) + [base + e for e in ends]
                index.add([s for s in starts if s < top])
                pending = top if starts and starts[-1] == top else None
                on_tokens(writer.n_tokens)
            if writer.n_tokens == 0:
                raise ValueError(f"{out}: the inputs hold no text")
        index.close(writer.header)
    except BaseException:
        index.abort()
        raise
    return writer.header


def texts_of(pieces: Iterator[Piece]) -> Iterator[str]:
    """The pieces as strings (for tokenizer training)."""
    for p in pieces:
        yield p.text.decode("utf-8", errors="replace") if isinstance(p.text, bytes) else p.text

