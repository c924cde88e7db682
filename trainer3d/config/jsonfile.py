"""Reading a JSON object from a file the run did not write (token headers, Hugging Face
config and index files): bounded in size, and refused with the file named unless it holds
one JSON object. Parsing JSON executes nothing; the bound keeps a hostile file from
exhausting memory before anything is checked."""

import json
from pathlib import Path

MAX_JSON_BYTES = 16 * 2 ** 20


def read_json_object(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in ``path``; ValueError naming the file if it is too large, not JSON,
    or not an object (callers add their own fix to the message)."""
    path = Path(path)
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes; not a config, index or header file")
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value
