"""Export a checkpoint's model as consolidated safetensors, for use outside the toolkit.

    python -m trainer3d.checkpoint.export CHECKPOINT_DIR OUT_DIR [--max-shard-gb 5]

Writes ``OUT_DIR/model.safetensors`` (or ``model-00001-of-0000N.safetensors`` shards with a
``model.safetensors.index.json`` weight map, the layout Hugging Face tools read) holding
every parameter under its 1-rank name (``layers.0.attention.wq.weight``) in its full shape,
whatever layout trained it, plus ``config.json`` (the model section of the run's config).
It runs in one process without a process group: DCP reads the pieces of every tensor from
the checkpoint into full tensors. The checkpoint's metadata is read with a restricted
unpickler (DCP's own classes only) and its data files hold raw tensor bytes, so exporting an
untrusted checkpoint unpickles nothing arbitrary.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed.checkpoint as dcp

from trainer3d.checkpoint import store


def load_full_model(path: Path) -> Dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the checkpoint, full size, keyed by its 1-rank name."""
    store.require_complete(path, "checkpoint")
    metadata = store.read_metadata(path)
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {key[len("model."):]: tensor for key, tensor in state.items()}


def _shards(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t.contiguous(), size + nbytes
    return shards + [current] if current else shards


def export(path: Path, out: Path, max_shard_bytes: int = 5 * 10 ** 9) -> List[Path]:
    from safetensors.torch import save_file

    tensors = load_full_model(Path(path))
    info = store.read_marker(path)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    meta = {"format": "pt", "trainer3d_step": str(info["step"])}
    if len(shards) == 1:
        files = [out / "model.safetensors"]
        save_file(shards[0], str(files[0]), metadata=meta)
    else:
        files = [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {}
        for file, shard in zip(files, shards):
            save_file(shard, str(file), metadata=meta)
            weight_map.update({name: file.name for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(info["config"]["model"], indent=1))
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a published checkpoint dir (…/checkpoints/step_N)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        files = export(args.checkpoint, args.out, int(args.max_shard_gb * 1e9))
    except ValueError as err:
        print(f"trainer3d: {err}", file=sys.stderr)
        return 2
    print(f"exported {len(files)} file(s) to {args.out}: " + ", ".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
