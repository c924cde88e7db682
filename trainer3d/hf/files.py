"""A safetensors directory as untrusted input, and writing one.

Reading never executes anything: JSON (config.json, the shard index) and safetensors
headers only, each bounded in size. A header is checked against its file before anything
trusts it: known dtypes, non-negative shapes, and byte ranges that lie inside the file and
match the shape (a truncated or doctored shard is refused, not read past). Index entries
must be plain file names in the directory (no ``/``, no ``..``).

Layout (what transformers writes and reads): ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` shards listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``).
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from safetensors.torch import save_file

from trainer3d.config.jsonfile import read_json_object

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TAGS = {dtype: tag for tag, dtype in DTYPES.items()}


class DirError(ValueError):
    """A directory or file that cannot be read as a Hugging Face checkpoint (one line)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: Tuple[int, ...]
    file: Path


def read_json(path: Path) -> dict:
    """A JSON object from a file of bounded size (trainer3d/config/jsonfile.py)."""
    if not path.is_file():
        raise DirError(f"{path} is missing")
    try:
        return read_json_object(path)
    except ValueError as err:
        raise DirError(str(err)) from None


def read_header(path: Path) -> Dict[str, TensorInfo]:
    """The tensors a safetensors file declares, after checking the header against the file."""
    if not path.is_file():
        raise DirError(f"{path} is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DirError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise DirError(f"{path}: header length {n} is beyond the file or the format's limit")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise DirError(f"{path}: the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise DirError(f"{path}: the header is not a JSON object")
    data_bytes = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, entry, data_bytes)
    return out


def _entry(path: Path, name: str, entry, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        valid = (dtype in _ITEM_BYTES and all(isinstance(s, int) and s >= 0 for s in shape)
                 and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes
                 and end - begin == math.prod(shape) * _ITEM_BYTES[dtype])
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise DirError(f"{path}: the entry of {name} is malformed or points outside the file (truncated?)")
    return TensorInfo(dtype=dtype, shape=tuple(shape), file=path)


def _shard_name(directory: Path, name) -> Path:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise DirError(f"{directory / INDEX} names {name!r}: shard files must be plain names inside the directory")
    return directory / name


def tensor_infos(directory: Path) -> Dict[str, TensorInfo]:
    """Every tensor of the checkpoint in ``directory`` (index or single file), by name."""
    directory = Path(directory)
    if (directory / INDEX).exists():
        weight_map = read_json(directory / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DirError(f"{directory / INDEX} has no weight_map object")
        files = {name: _shard_name(directory, file) for name, file in weight_map.items()}
        headers = {}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise DirError(f"{file} (listed in {INDEX}) is missing")
            headers[file] = read_header(file)
        out = {}
        for name, file in files.items():
            if name not in headers[file]:
                raise DirError(f"{INDEX} puts {name} in {file.name}, which does not hold it")
            out[name] = headers[file][name]
        return out
    if (directory / SINGLE).exists():
        return read_header(directory / SINGLE)
    raise DirError(f"{directory} has neither {SINGLE} nor {INDEX}")


# ----------------------------------------------------------------------------- writing

def umask_mode(path: Path) -> None:
    """Give ``path`` the permissions ``open()`` gives a new file, 0666 less the process umask
    (safetensors' ``save_file`` creates its files 0600)."""
    path.chmod(0o666 & ~process_umask())


def process_umask() -> int:
    """The umask, read from /proc (Linux, proc(5)) without changing it; elsewhere set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def plan_shards(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    """Tensors in order, cut into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t.contiguous(), size + nbytes
    return shards + [current] if current else shards


def write_safetensors_dir(tensors: Dict[str, torch.Tensor], out: Path, max_shard_bytes: int,
                          metadata: Dict[str, str]) -> List[Path]:
    """``model.safetensors``, or shards with ``model.safetensors.index.json``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=metadata)
        umask_mode(out / SINGLE)
        return [out / SINGLE]
    files = [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file(shard, str(file), metadata=metadata)
        umask_mode(file)
        weight_map.update({name: file.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files
