"""Export a checkpoint's model for use outside the toolkit.

    python tools/export_model.py CHECKPOINT_DIR OUT_DIR [--format hf|trainer3d] [--dtype bf16]
                                 [--max-shard-gb 5] [--tokenizer DIR] [--force]

(the command line: trainer3d/tools/export_model.py)

``--format hf`` (default) writes a Hugging Face Llama directory that
``transformers.LlamaForCausalLM.from_pretrained`` loads (trainer3d/hf/export.py).
``--format trainer3d`` writes every parameter under its 1-rank name
(``layers.0.attention.wq.weight``) in ``model.safetensors`` or shards with an index, plus
``config.json`` (the run's model section). Either way the tensors are full, whatever layout
trained them, in the dtype they were trained in unless ``--dtype`` says otherwise.

It runs in one process without a process group: DCP reads the pieces of every tensor from
the checkpoint into full tensors. The checkpoint must match its checksums, its metadata is
read by the restricted reader of trainer3d/checkpoint/metadata.py (an explicit list of DCP's
classes) and only tensor entries are loaded, so exporting an untrusted checkpoint runs no
code from it. The tokenizer bundled (without ``--tokenizer``) is the one the data's header
names, only if it is the one the checkpoint recorded it was trained with
(trainer3d/checkpoint/lineage.py); otherwise the export is refused, naming both.
"""

import json
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from trainer3d.checkpoint import store
from trainer3d.checkpoint.lineage import tokenizer_problem
from trainer3d.checkpoint.reader import CheckpointReader, TensorOnlyLoadPlanner
from trainer3d.config.schema import ModelConfig
from trainer3d.hf.export import data_tokenizer, write_hf
from trainer3d.hf.files import write_safetensors_dir
from trainer3d.optim.mixed_precision import DTYPES


def load_full_model(path: Path, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the checkpoint (or those under another ``prefix``, e.g.
    ``optim.exp_avg.``), full size, keyed by its 1-rank name."""
    store.require_complete(path, "checkpoint")
    metadata = store.read_metadata(path)
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(meta, "size"):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, storage_reader=CheckpointReader(str(path)), planner=TensorOnlyLoadPlanner(), no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in state.items()}


def model_config_of(run_config: dict):
    """The run's ModelConfig from a checkpoint marker's config (older markers lack newer fields)."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), run_config["model"])
    return OmegaConf.to_object(merged)


def export(path: Path, out: Path, fmt: str = "hf", dtype: Optional[str] = None,
           max_shard_bytes: int = 5 * 10 ** 9, tokenizer: Optional[Path] = None) -> List[Path]:
    path = Path(path)
    tensors = load_full_model(path)
    if dtype is not None:
        tensors = {name: t.to(DTYPES[dtype]) for name, t in tensors.items()}
    info = store.read_marker(path)
    meta = {"trainer3d_step": str(info["step"])}
    if fmt == "trainer3d":
        files = write_safetensors_dir(tensors, out, max_shard_bytes, {"format": "pt", **meta})
        (out / "config.json").write_text(json.dumps(info["config"]["model"], indent=1))
        return files
    cfg = model_config_of(info["config"])
    data = data_tokenizer(info["config"])
    problem = None if tokenizer is not None else tokenizer_problem(info, data.tokenizer, path)
    if problem:  # bundle the tokenizer the model was trained with, or none
        raise store.CheckpointError(problem)
    if not cfg.eos_token_ids and data.eos_id is not None:
        cfg.eos_token_ids = [data.eos_id]  # the end-of-document id the model learned to emit
    weight_dtype = next(iter(tensors.values())).dtype
    return write_hf(tensors, cfg, out, weight_dtype, max_shard_bytes, tokenizer or data.tokenizer, meta,
                    byte_level=data.byte_level)
