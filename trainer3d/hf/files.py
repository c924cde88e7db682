"""A safetensors directory as untrusted input, and writing one.

Reading never executes anything: JSON (config.json, the shard index) and safetensors
headers only, each bounded in size. A header is checked against its file before anything
trusts it: known dtypes, non-negative shapes, and byte ranges that lie inside the file, match
the shape and tile the data section exactly — no two tensors overlapping, no gap, none past
the end, the rule safetensors' own loader enforces at load time (a truncated or doctored
shard is refused here, before launch, not read past). JSON nested past a small depth is
refused before anything walks it (trainer3d/config/jsonfile.py). ``first_nonfinite`` scans a
tensor's bytes for NaN/Inf through a memory map, a bounded chunk at a time. Index entries
must be plain file names in the directory (no ``/``, no ``..``).

Layout (what transformers writes and reads): ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` shards listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``).
"""

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from safetensors.torch import save_file

from trainer3d.config.jsonfile import parse_json, read_json_object

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
    span: Tuple[int, int] = field(default=(0, 0), compare=False)
    """Its bytes in ``file``: [start, end), absolute offsets."""


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
            header = parse_json(f.read(n), f"{path}: the header")
        except ValueError as err:
            raise DirError(str(err)) from None
    if not isinstance(header, dict):
        raise DirError(f"{path}: the header is not a JSON object")
    data_bytes = size - 8 - n
    out = {name: _entry(path, name, entry, data_bytes, 8 + n) for name, entry in header.items()
           if name != "__metadata__"}
    _check_tiling(path, out, 8 + n, size)
    return out


def _check_tiling(path: Path, infos: Dict[str, TensorInfo], start: int, size: int) -> None:
    """The tensors' byte ranges, in order, cover the data section exactly once."""
    at, previous = start, None
    for name, info in sorted(infos.items(), key=lambda item: item[1].span):
        begin, end = info.span
        if begin < at:
            raise DirError(f"{path}: the bytes of {name} overlap those of {previous}")
        if begin > at:
            raise DirError(f"{path}: {begin - at} byte(s) before {name} belong to no tensor")
        at, previous = end, name
    if at != size:
        raise DirError(f"{path}: {size - at} byte(s) at the end belong to no tensor")


def _entry(path: Path, name: str, entry, data_bytes: int, data_start: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        valid = (dtype in _ITEM_BYTES and isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
                 and type(begin) is int and type(end) is int and 0 <= begin <= end <= data_bytes
                 and end - begin == math.prod(shape) * _ITEM_BYTES[dtype])
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise DirError(f"{path}: the entry of {name} is malformed or points outside the file (truncated?)")
    return TensorInfo(dtype=dtype, shape=tuple(shape), file=path, span=(data_start + begin, data_start + end))


_EXPONENT = {"F32": (np.uint32, 0x7F800000), "BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00)}
SCAN_ELEMENTS = 1 << 22
"""Elements scanned at a time (16 MiB of fp32): the scan's memory, whatever the tensor's size."""


def first_nonfinite(info: TensorInfo) -> Optional[int]:
    """The flat index of the first NaN or Inf in the tensor, or None. IEEE floats are not
    finite exactly when every exponent bit is set; the bits are read as integers from a memory
    map of the file, so no dtype conversion and no copy of the whole tensor is needed."""
    if info.dtype not in _EXPONENT or info.span[1] <= info.span[0]:
        return None
    kind, mask = _EXPONENT[info.dtype]
    count = (info.span[1] - info.span[0]) // np.dtype(kind).itemsize
    bits = np.memmap(info.file, dtype=kind, mode="r", offset=info.span[0], shape=(count,))
    for start in range(0, count, SCAN_ELEMENTS):
        chunk = bits[start:start + SCAN_ELEMENTS]
        bad = np.flatnonzero((chunk & kind(mask)) == kind(mask))
        if bad.size:
            return start + int(bad[0])
    return None


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
