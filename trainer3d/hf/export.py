"""A trained model as a Hugging Face Llama directory (``tools/export_model.py --format hf``).

Writes what ``transformers.LlamaForCausalLM.from_pretrained`` reads: the weights under
transformers' names (trainer3d/hf/mapping.py; a tied model has no ``lm_head.weight``) in
``model.safetensors`` or shards with an index, ``config.json`` (architecture, sizes, rotary
settings, dtype, token ids), ``generation_config.json``, and the tokenizer's files when the
training data records the tokenizer that made it. Byte-level data (the built-in corpus,
tools/prepare_data.py) has no tokenizer files: its end-of-document token is the eos id.
"""

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from trainer3d.config.schema import ModelConfig
from trainer3d.data import BYTE_VOCAB
from trainer3d.hf.files import write_safetensors_dir
from trainer3d.hf.mapping import hf_config, to_hf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def data_tokenizer(run_config: dict) -> Tuple[Optional[Path], bool]:
    """(the tokenizer the training data was made with, if its header records one that exists;
    whether the data is byte-level) for a run's config (a checkpoint marker's)."""
    data = run_config.get("data", {})
    if data.get("name") == "stdlib":
        return None, True
    header_path = Path(data.get("path") or "").expanduser().with_suffix(".json")
    try:
        header = json.loads(header_path.read_text())
    except (OSError, ValueError):
        return None, False
    recorded = header.get("tokenizer")
    if isinstance(recorded, dict):
        recorded = recorded.get("path")
    if isinstance(recorded, str) and Path(recorded).expanduser().exists():
        return Path(recorded).expanduser(), False
    return None, recorded is None and header.get("vocab_size") == BYTE_VOCAB


def copy_tokenizer(source: Path, out: Path) -> List[str]:
    """Copy a tokenizer's files (from its directory, or one tokenizer.json) into ``out``."""
    files = [source] if source.is_file() else [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    for f in files:
        shutil.copyfile(f, out / f.name)
    return [f.name for f in files]


def write_hf(tensors: Dict[str, torch.Tensor], cfg: ModelConfig, out: Path, dtype: torch.dtype,
             max_shard_bytes: int, tokenizer: Optional[Path] = None, metadata: Optional[dict] = None) -> List[Path]:
    """Write ``tensors`` (trainer3d names, full shapes) as a Hugging Face Llama directory."""
    hf = {}
    for name, t in tensors.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue  # the head is the embedding matrix; transformers ties it on load
        hf[to_hf(name)] = t.to(dtype)
    files = write_safetensors_dir(hf, out, max_shard_bytes, {"format": "pt", **(metadata or {})})
    config = hf_config(cfg, DTYPE_NAMES[dtype])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True, "bos_token_id": config["bos_token_id"],
                  "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        copy_tokenizer(tokenizer, out)
    return files

