"""Reading DCP's ``.metadata`` pickle from a checkpoint that may not be trusted.

torch.distributed.checkpoint stores the index of a checkpoint (which tensor, which chunk,
which byte range of which file) as a pickle, and its own reader unpickles it with plain
``pickle.load`` — any callable a pickle names would run. Here the pickle is read by an
unpickler that resolves exactly the (module, name) pairs in ``ALLOWED`` and nothing else:
the globals found in the metadata of real checkpoints of every kind this engine writes
(fp32/bf16/fp16, ZeRO 0-3, tp and pp, torch 2.13), plus the other tensor dtypes. Each is an
inert value or a plain dataclass whose construction only stores fields (TensorProperties'
``__setstate__`` unpacks a tuple). Opcodes that reach code by other routes are refused before
unpickling: persistent ids (PERSID/BINPERSID, resolved by ``persistent_load``), the copyreg
extension registry (EXT1/2/4) and the protocol-0/1 class calls (INST/OBJ), none of which DCP
writes. The result is then checked for shape — every entry a tensor (the engine stores no
pickled objects, and DCP would read such an entry back with ``torch.load(weights_only=False)``),
every data file a plain name inside the checkpoint directory, every byte range non-negative —
so that nothing DCP does with it later reaches outside the checkpoint or into pickle again.
"""

import io
import pickle
import pickletools
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the checks import it where they run (check_shape)
    from torch.distributed.checkpoint.metadata import Metadata

_DCP = "torch.distributed.checkpoint"
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
ALLOWED = frozenset({
    (f"{_DCP}.metadata", "Metadata"), (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"), (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "MetadataIndex"), (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"), (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    *(("torch", dtype) for dtype in _DTYPES),
})
_REFUSED_OPCODES = frozenset({"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "INST", "OBJ"})
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
"""The data files DCP's FileSystemWriter names (rank, file index): nothing else is read."""


class MetadataError(ValueError):
    """The metadata is not what this engine's DCP writes; the message says what was found."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise MetadataError(f"it names {module}.{name}, which checkpoint metadata never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise MetadataError("it holds a persistent id, which checkpoint metadata never holds")


def unpickle(data: bytes) -> "Metadata":
    """The metadata in ``data``, or MetadataError (never anything a pickle could make happen)."""
    try:
        for opcode, _, _ in pickletools.genops(data):
            if opcode.name in _REFUSED_OPCODES:
                raise MetadataError(f"it holds the pickle opcode {opcode.name}, which DCP never writes")
        metadata = _Unpickler(io.BytesIO(data)).load()
    except MetadataError:
        raise
    except Exception as err:  # a malformed pickle fails in many ways; every one is a refusal
        raise MetadataError(f"it is not a readable pickle ({type(err).__name__}: {err})") from None
    check_shape(metadata)
    return metadata


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise MetadataError(what)


def _sizes(value, key: str, size_type: type) -> None:
    _require(isinstance(value, size_type) and all(isinstance(v, int) and v >= 0 for v in value),
             f"entry {key!r} has a malformed shape")


def check_shape(metadata) -> None:
    """Every field of ``metadata`` is of the type and range DCP's FileSystemWriter writes."""
    # Here, not at the top: torch.distributed.checkpoint imports DTensor and sympy (about two
    # seconds of CPU), and torch itself two more, which the launcher and the tools that only list
    # checkpoints skip (the pickle being checked names torch's classes: reading it imports torch).
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    _require(type(metadata) is Metadata, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    _require(isinstance(metadata.state_dict_metadata, dict), "its state_dict_metadata is not a dict")
    for key, entry in metadata.state_dict_metadata.items():
        _require(isinstance(key, str), "a key is not a string")
        _require(type(entry) is TensorStorageMetadata,
                 f"entry {key!r} is a {type(entry).__name__}, not a tensor (this engine stores tensors only)")
        _require(type(entry.properties) is TensorProperties and isinstance(entry.properties.dtype, torch.dtype),
                 f"entry {key!r} has malformed tensor properties")
        _sizes(entry.size, key, torch.Size)
        _require(isinstance(entry.chunks, list), f"entry {key!r} has malformed chunks")
        for chunk in entry.chunks:
            _require(type(chunk) is ChunkStorageMetadata, f"entry {key!r} has a malformed chunk")
            _sizes(chunk.offsets, key, torch.Size)
            _sizes(chunk.sizes, key, torch.Size)
            _require(len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                     and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size)),
                     f"entry {key!r} has a chunk outside its shape")
    _require(isinstance(metadata.storage_data, dict), "its storage_data is not a dict")
    for index, info in metadata.storage_data.items():
        _require(type(index) is MetadataIndex and isinstance(index.fqn, str), "a storage index is malformed")
        _require(type(info) is _StorageInfo and isinstance(info.relative_path, str)
                 and DATA_FILE.match(info.relative_path) is not None,
                 f"{index.fqn!r} points to a file other than a DCP data file in the checkpoint directory")
        _require(isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                 and info.length >= 0, f"{index.fqn!r} has a malformed byte range")
        _require(not info.transform_descriptors, f"{index.fqn!r} asks for stream transforms this engine never writes")
    _require(metadata.planner_data is None or isinstance(metadata.planner_data, dict), "its planner_data is malformed")
    _require(metadata.storage_meta is None or type(metadata.storage_meta) is StorageMeta,
             "its storage_meta is malformed")


def read(path: Path) -> "Metadata":
    """The checked metadata of the checkpoint directory ``path`` (MetadataError, OSError)."""
    return unpickle((Path(path) / ".metadata").read_bytes())
