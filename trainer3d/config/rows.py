"""The one reader of ``metrics.jsonl`` (one JSON object per step, written by rank 0:
trainer3d/observe/metrics.py), for the run's own resume and for every tool that reads a run's
curves (plot_metrics, parity, gpu_check, the planner's probe).

A crash or a full disk can cut the last line short; a resume drops such a line and keeps the
rows before it, and every reader does the same: a line that is not a JSON object with an
integer ``step`` is counted as torn and skipped, never a traceback.
"""

import json
from pathlib import Path
from typing import List, Optional, Tuple


def metric_row(line: str) -> Optional[dict]:
    """A metrics.jsonl line as a row (a JSON object with an integer step), or None."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) and type(row.get("step")) is int else None


def read_metrics(path) -> Tuple[List[dict], int]:
    """The rows of ``path`` in file order, and how many non-blank lines were not rows."""
    rows, torn = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        row = metric_row(line)
        if row is None:
            torn += bool(line.strip())
        else:
            rows.append(row)
    return rows, torn
