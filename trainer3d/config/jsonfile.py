"""Reading JSON the run did not write (token headers, Hugging Face config and index files,
safetensors headers, checkpoint markers, JSONL records): bounded in size and in nesting, and
refused with the file named unless it holds what is expected. Parsing JSON executes nothing;
the size bound keeps a hostile file from exhausting memory before anything is checked, the
nesting bound keeps it from exhausting the interpreter's recursion — in the parser itself
(``json.loads`` raises RecursionError, which no ``except ValueError`` catches) or in any code
that walks the value afterwards (sealing a marker, comparing configs)."""

import json
from pathlib import Path
from typing import Any, Union

MAX_JSON_BYTES = 16 * 2 ** 20
MAX_DEPTH = 64
"""Nesting any file of these kinds needs is a handful of levels; 64 is far beyond it and far
below Python's recursion limit."""


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists/objects deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def parse_json(data: Union[bytes, str], what: str, limit: int = MAX_DEPTH) -> Any:
    """The JSON value in ``data``; ValueError naming ``what`` if it is not JSON or nests
    deeper than ``limit`` levels."""
    try:
        value = json.loads(data)
    except RecursionError:
        value = None
        deep = True
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} is not valid JSON ({err})") from None
    else:
        deep = too_deep(value, limit)
    if deep:
        raise ValueError(f"{what} nests lists or objects deeper than {limit} levels; not a file of this kind")
    return value


def read_json_object(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in ``path``; ValueError naming the file if it is too large, not JSON,
    nested too deeply or not an object (callers add their own fix to the message)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}, not a JSON file")
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes; not a config, index or header file")
    value = parse_json(path.read_bytes(), str(path))
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value
