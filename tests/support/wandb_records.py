"""Read an offline wandb run back from its ``run-<id>.wandb`` file.

The file is wandb's record log (the LevelDB log format: a 7-byte file header, then 32 KiB
blocks of records, each with a 7-byte header: crc32 (4), length (2), type (1: full,
2: first, 3: middle, 4: last)); each record is a ``wandb_internal_pb2.Record`` protobuf.
"""

import json
import struct
from pathlib import Path
from typing import Dict, Iterator, List

BLOCK = 32 * 1024
HEADER = 7


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a wandb record log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            yield pending
            pending = b""


def read_run(run_file: Path) -> Dict[str, object]:
    """{'run': Record.run, 'config': {key: value}, 'history': [{key: value}], 'summary': {key: value}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = {"run": None, "config": {}, "history": [], "summary": {}}
    for payload in _payloads(Path(run_file).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = rec.run
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in rec.history.item})
        elif kind == "summary":
            out["summary"].update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in rec.summary.update})
    return out


def run_files(run_dir: Path) -> List[Path]:
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
