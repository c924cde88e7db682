"""A trained model as a Hugging Face Llama (or, with experts, Mixtral) directory (``tools/export_model.py --format hf``).

Writes what ``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer`` read: the weights
under transformers' names (trainer3d/hf/mapping.py; a tied model has no ``lm_head.weight``)
in ``model.safetensors`` or shards with an index, ``config.json`` (architecture, sizes,
rotary settings, dtype, token ids), ``generation_config.json`` (bos/eos/pad ids, as
``GenerationConfig.from_model_config`` writes them), and, when the training data records the
tokenizer that made it (or one is given), the tokenizer: ``tokenizer.json`` (a single file
such as ``corpus.tokenizer.json`` is copied under that name), plus ``tokenizer_config.json``
and ``special_tokens_map.json`` naming the run's bos/eos/pad tokens where the source has
none (the fields ``PreTrainedTokenizerFast.save_pretrained`` writes). Byte-level data (the
built-in corpus, tools/prepare_data.py without a tokenizer) gets a ``tokenizer.json`` that
tokenises as they do (byte b is id b; end-of-document, the eos id, is 256).

Every file gets the permissions of the process umask, as any file a user makes.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from trainer3d.config.schema import ModelConfig
from trainer3d.data import BYTE_VOCAB, EOF_TOKEN
from trainer3d.hf.files import umask_mode, write_safetensors_dir
from trainer3d.hf.mapping import hf_config, hf_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
BYTE_EOS = "<|endoftext|>"
"""The end-of-document token of the byte-level tokenizer.json (id EOF_TOKEN, after the 256 bytes)."""
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class DataTokens:
    """What a run's training data says about its tokens (from the first token file's header)."""

    tokenizer: Optional[Path] = None
    """The tokenizer.json the data was made with, when its header records one that exists."""
    byte_level: bool = False
    """The data is byte-level (ids 0-255, end-of-document 256)."""
    eos_id: Optional[int] = None
    """The end-of-document id written after every document."""
    refused: Optional[str] = None
    """Why the data's tokenizer is not used (it is not the one the model was trained with)."""


def data_tokenizer(run_config: dict) -> DataTokens:
    """What the training data of a run's config (a checkpoint marker's) records about its tokens."""
    data = run_config.get("data", {})
    if data.get("name") == "stdlib":
        return DataTokens(byte_level=True, eos_id=BYTE_VOCAB - 1)
    first = data.get("path") or next((b.get("path") for b in data.get("blend") or [] if isinstance(b, dict)), None)
    try:
        header = json.loads(Path(first or "").expanduser().with_suffix(".json").read_text())
    except (OSError, ValueError):  # no token-file header: a Megatron dataset read in place names its eos
        return DataTokens(eos_id=data.get("eos_id") if type(data.get("eos_id")) is int else None)
    eos = header.get("eos_id") if type(header.get("eos_id")) is int else None
    recorded = header.get("tokenizer")
    if isinstance(recorded, dict):
        recorded = recorded.get("path")
    if isinstance(recorded, str) and Path(recorded).expanduser().is_file():
        return DataTokens(Path(recorded).expanduser(), False, eos)
    return DataTokens(None, recorded is None and header.get("vocab_size") == BYTE_VOCAB, eos)


@dataclass(frozen=True)
class SpecialIds:
    """The run's special token ids (None: the run has none)."""

    bos: Optional[int]
    eos: List[int]
    pad: Optional[int]


def special_ids(cfg: ModelConfig) -> SpecialIds:
    """bos and eos as the model config records them; pad is the (first) eos id, which
    generation pads finished sequences with (the model was never trained on a pad token)."""
    eos = list(cfg.eos_token_ids)
    return SpecialIds(cfg.bos_token_id, eos, eos[0] if eos else None)


def byte_tokenizer() -> Tokenizer:
    """The built-in byte-level tokenisation (byte b is id b, ``<|endoftext|>`` 256) as a
    ``tokenizers`` tokenizer: a BPE without merges over GPT-2's byte-to-character table (bytes
    as printable characters, Radford et al. 2019; the ``tokenizers`` ByteLevel pre-tokenizer
    and decoder use the same table), so ``AutoTokenizer`` reads an export of a byte-level run."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:  # the others move past 255, in byte order
            chars[b], extra = chr(256 + extra), extra + 1
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    assert tokenizer.token_to_id(BYTE_EOS) == EOF_TOKEN
    return tokenizer


def copy_tokenizer(source: Path, out: Path) -> List[str]:
    """Copy a tokenizer (its directory, or one tokenizer.json under any name, which is copied
    as ``tokenizer.json``) into ``out``; returns the names written."""
    if source.is_file():
        copies = {source: "tokenizer.json"}
    else:
        copies = {source / n: n for n in TOKENIZER_FILES if (source / n).is_file()}
    for src, name in copies.items():
        shutil.copyfile(src, out / name)
        umask_mode(out / name)
    return list(copies.values())


def write_tokenizer_config(out: Path, ids: SpecialIds, max_len: int) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for ``out/tokenizer.json``
    naming the run's special tokens, as ``PreTrainedTokenizerFast.save_pretrained`` writes them."""
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    named = (("bos_token", ids.bos), ("eos_token", ids.eos[0] if ids.eos else None), ("pad_token", ids.pad))
    tokens = {key: tokenizer.id_to_token(i) for key, i in named if i is not None and tokenizer.id_to_token(i)}
    special = {str(i): {"content": tokenizer.id_to_token(i), "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}
               for i in sorted({ids.bos, ids.pad, *ids.eos} - {None}) if tokenizer.id_to_token(i)}
    config = {"added_tokens_decoder": special, **tokens, "clean_up_tokenization_spaces": False,
              "model_max_length": max_len, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")


def write_hf(tensors: Dict[str, torch.Tensor], cfg: ModelConfig, out: Path, dtype: torch.dtype,
             max_shard_bytes: int, tokenizer: Optional[Path] = None, metadata: Optional[dict] = None,
             byte_level: bool = False) -> List[Path]:
    """Write ``tensors`` (trainer3d names, full shapes) as a Hugging Face Llama directory, with
    ``tokenizer`` (a directory or one tokenizer.json), or the byte-level one for ``byte_level`` data."""
    config = hf_config(cfg, DTYPE_NAMES[dtype])  # first: a model Hugging Face cannot hold writes nothing
    hf = {}
    for name, t in tensors.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue  # the head is the embedding matrix; transformers ties it on load
        hf.update({key: value.to(dtype) for key, value in hf_tensors(name, t).items()})
    files = write_safetensors_dir(hf, out, max_shard_bytes, {"format": "pt", **(metadata or {})})
    ids = special_ids(cfg)
    config["pad_token_id"] = ids.pad
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True, "bos_token_id": ids.bos,
                  "eos_token_id": (ids.eos[0] if len(ids.eos) == 1 else ids.eos) if ids.eos else None,
                  "pad_token_id": ids.pad}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    written = copy_tokenizer(tokenizer, out) if tokenizer is not None else []
    if tokenizer is None and byte_level:
        (out / "tokenizer.json").write_text(byte_tokenizer().to_str())
        written.append("tokenizer.json")
    if "tokenizer.json" in written and "tokenizer_config.json" not in written:
        write_tokenizer_config(out, ids, cfg.max_seq_len)
    return files
