"""The steps a run trains without: ``<run_dir>/skipped_steps.json``.

    {"steps": [120, 121, ...], "events": [{"step": 130, "loss": 9.1, "reason": "...", "action": "..."}]}

``steps`` are the steps whose batch is neither read nor trained on (the schedule still
advances over them: a step's data and learning rate are functions of its number alone,
trainer3d/data/sampler.py); ``events`` say why, one per decision of the spike watch
(trainer3d/observe/spikes.py). The file is rewritten whole, atomically (a temporary file,
fsync, rename), by rank 0 at each decision, before training goes on past it — so a run
requeued or resumed at any point reads every decision taken before its checkpoint, and none
after. ``train.skip_steps`` adds steps (a fresh run given another run's ``steps`` replays it).
"""

import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Set

from trainer3d.config.jsonfile import MAX_JSON_BYTES, parse_json

FILE_NAME = "skipped_steps.json"


class SkipLogError(ValueError):
    pass


def read_skip_log(run_dir: str) -> Dict[str, list]:
    """The run dir's skip log ({"steps": [], "events": []} if there is none), checked."""
    path = Path(run_dir) / FILE_NAME
    if not path.exists():
        return {"steps": [], "events": []}
    fix = f"repair or delete {path} (a run reads it to know which steps it skipped)"
    if path.stat().st_size > MAX_JSON_BYTES:
        raise SkipLogError(f"{path} is larger than {MAX_JSON_BYTES} bytes; {fix}")
    try:
        value = parse_json(path.read_bytes(), str(path))
    except ValueError as err:
        raise SkipLogError(f"{err}; {fix}") from None
    steps = value.get("steps") if isinstance(value, dict) else None
    events = value.get("events", []) if isinstance(value, dict) else None
    if (not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                               for s in steps) or not isinstance(events, list)):
        raise SkipLogError(f"{path} must hold {{\"steps\": [non-negative integers], \"events\": [...]}}; {fix}")
    return {"steps": steps, "events": events}


class SkipLog:
    """The steps to skip (the file's and ``train.skip_steps``), and rank 0's record of new ones."""

    def __init__(self, run_dir: str, extra: Iterable[int], writer: bool):
        self.path = Path(run_dir) / FILE_NAME
        self.writer = writer
        self.record = read_skip_log(run_dir)
        self.steps: Set[int] = set(self.record["steps"]) | set(extra)

    def __contains__(self, step: int) -> bool:
        return step in self.steps

    def add(self, steps: List[int], event: dict) -> None:
        """Skip ``steps`` from now on (also after a resume), for the reason ``event`` records."""
        self.steps.update(steps)
        self.record["steps"] = sorted(set(self.record["steps"]) | set(steps))
        self.record["events"].append(event)
        if self.writer:
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(FILE_NAME + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(self.record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
