"""Each rank's parameters from a Hugging Face safetensors directory (``model.init_from``).

``HFSource`` is a parameter source (trainer3d/model/init.py): asked for a parameter's
slice, it opens the shard that holds the tensor with ``safe_open`` and reads only that
slice with ``get_slice`` (rows for a column-parallel or vocabulary-parallel shard, columns
for a row-parallel one, and only the rows of its data-parallel shard under ZeRO-2/3), so a
rank never reads what it does not hold and host memory peaks at its own parameters. Rows past the vocabulary (tensor-parallel padding) are zeros.

A Mixtral expert weight (trainer3d's 3-D (E, in, out)) is read as the block of each of its
experts the rank holds, from the per-expert (out, in) tensors, transposed (trainer3d/hf/mixtral.py).

The directory was checked before launch (trainer3d/hf/check.py); here each tensor's
shape is checked again as it is read, in case the files changed since.
"""

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open

from trainer3d.config.schema import ModelConfig
from trainer3d.hf.files import tensor_infos
from trainer3d.hf.mapping import to_hf
from trainer3d.hf.mixtral import expert_names, join_experts
from trainer3d.model.init import Rows, TPShard, pad_slice, slice_bounds


class HFSource:
    def __init__(self, directory, cfg: ModelConfig):
        self.directory = Path(directory).expanduser()
        self.infos = tensor_infos(self.directory)
        self.cfg = cfg
        self._handles: Dict[Path, object] = {}

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def _view(self, hf: str, shape: Tuple[int, ...]):
        info = self.infos.get(hf)
        if info is None or info.shape != tuple(shape):
            found = "missing" if info is None else f"of shape {list(info.shape)}"
            raise ValueError(f"model.init_from={self.directory}: {hf} is {found}, the model needs {list(shape)} "
                             "(the directory changed since the run was checked?)")
        return self._handle(info.file).get_slice(hf)

    def __call__(self, name: str, shape: Tuple[int, ...], shard: Optional[TPShard],
                 rows: Rows = None) -> torch.Tensor:
        bounds, padding = slice_bounds(shape, shard, rows)
        experts = expert_names(name, shape[0])
        if experts is not None:  # expert e's (out, in) block, transposed into (in, out)
            (first, last), (i0, i1), (o0, o1) = bounds
            blocks = [self._view(hf, (shape[2], shape[1]))[o0:o1, i0:i1] for hf in experts[first:last]]
            return pad_slice(join_experts(blocks), shard, padding)
        view = self._view(to_hf(name), shape)
        if shard is None and rows is None:
            return view[:]
        return pad_slice(view[tuple(slice(start, stop) for start, stop in bounds)], shard, padding)

    def close(self) -> None:
        self._handles.clear()
