"""What a run's data is, cheaply: the record a checkpoint keeps of the tokens it was trained on.

A token file's header already carries the sha256 of its ids and of the tokenizer that made
them (trainer3d/data/tokens.py, written by tools/prepare_data.py), so naming a token file's
identity costs one small JSON read, not a re-hash of its bytes: a file re-made with another
tokenizer of the same vocabulary size differs in both. A Megatron-LM dataset read in place
(PREFIX.bin + PREFIX.idx) records neither: its identity is the two files' sizes and the
sha256 of the index's first ``INDEX_PREFIX_BYTES`` (its header, dtype and the first
documents' sizes), which a re-tokenised corpus changes. The built-in corpus has no file to
name (it is this Python's standard library, tokenised byte by byte): its identity is its name.

``data_identity(cfg)`` maps each data knob that names a file (``data.path``,
``data.blend[i].path``, ``data.val_path``) to its record; ``data_changes`` says, one phrase
per knob, what differs between two such maps; ``tokenizer_file_sha256`` is what a
tokenizer.json holds now, against what the header recorded when the file was made.
"""

import hashlib
from pathlib import Path
from typing import Dict, List, Optional

from trainer3d.config.schema import Config
from trainer3d.data import megatron
from trainer3d.data.tokens import TokenFileError, bin_path, read_header

INDEX_PREFIX_BYTES = 1 << 20
"""The part of a Megatron index hashed: its header and the first documents' sizes."""


def _token_file(path: str) -> dict:
    if megatron.is_megatron(path):
        bin_file, idx = megatron.paths(path)
        with open(idx, "rb") as f:
            head = hashlib.sha256(f.read(INDEX_PREFIX_BYTES)).hexdigest()
        return {"path": str(bin_file.resolve()), "bytes": bin_file.stat().st_size,
                "index_bytes": idx.stat().st_size, "index_sha256": head}
    header = read_header(path)
    return {"path": str(bin_path(path).resolve()), "sha256": header.sha256, "n_tokens": header.n_tokens,
            "vocab_size": header.vocab_size, "tokenizer": header.tokenizer.name,
            "tokenizer_sha256": header.tokenizer.sha256}


def data_files(cfg: Config) -> Dict[str, str]:
    """Each data knob that names a file, and the file."""
    data = cfg.data
    if data.name != "tokens":
        return {}
    named = {"data.path": data.path} if data.path else {}
    named.update({f"data.blend[{i}].path": b.path for i, b in enumerate(data.blend)})
    if data.val_path:
        named["data.val_path"] = data.val_path
    return named


def data_identity(cfg: Config) -> Dict[str, dict]:
    """``{knob: record}`` of the run's data (``{"data.name": {"name": ...}}`` for the built-in corpus);
    a file that cannot be read is recorded as ``{"missing": why}``."""
    if cfg.data.name != "tokens":
        return {"data.name": {"name": cfg.data.name}}
    found = {}
    for knob, path in data_files(cfg).items():
        try:
            found[knob] = _token_file(path)
        except (OSError, TokenFileError) as err:
            found[knob] = {"missing": str(err)}
    return found


def _describe(record: Optional[dict]) -> str:
    if not record:
        return "nothing"
    if "missing" in record:
        return "an unreadable file"
    if "name" in record:
        return record["name"]
    tokenizer = f", tokenizer {record['tokenizer']}" if record.get("tokenizer") else ""
    return f"{record.get('path')}{tokenizer}"


def data_changes(saved: Dict[str, dict], now: Dict[str, dict]) -> List[str]:
    """One phrase per knob whose data differs: ``data.path: tokenizer sha256 1a2b... -> 3c4d...``."""
    changes = []
    for knob in sorted(set(saved) | set(now)):
        before, after = saved.get(knob), now.get(knob)
        if before == after:
            continue
        if before is None or after is None or "missing" in after or set(before) != set(after):
            changes.append(f"{knob}: {_describe(before)} -> {_describe(after)}")
            continue
        what = [f"{key} {str(before[key])[:12]} -> {str(after[key])[:12]}" for key in sorted(before)
                if before[key] != after[key]]
        changes.append(f"{knob}: {', '.join(what)}")
    return changes


def tokenizer_file_sha256(path) -> Optional[str]:
    """sha256 of a tokenizer file as it is now (None when it cannot be read)."""
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError:
        return None
