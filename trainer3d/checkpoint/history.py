"""The run's starts and ends, ``<run_dir>/run_history.jsonl``, and the time between interruptions
they show (``checkpoint.mtbf_hours=auto``, trainer3d/checkpoint/interval.py).

Rank 0 appends one line when the training loop starts (fresh, resumed or requeued) and one
when it ends: ``{"event": "start", "time": <unix s>, "step": N}``, ``{"event": "end", "time":
..., "step": N, "how": "finished" | "stopped"}``. A start whose run ended ``stopped`` (a
preemption or a time limit: it saved and stopped) or never wrote an end (a crash, a lost
node) was interrupted; a run that finished and was later continued was not.

The estimate: ``n`` interruptions over ``T`` hours of running (each start to its end, or to
the next start; the current run up to now), with a prior worth one interruption in ``M0``
hours (``DEFAULT_PRIOR_HOURS``): ``M = (T + M0) / (n + 1)``. It is the posterior mean of the
mean time between failures for exponentially distributed interruptions under an inverse-gamma
prior of shape 2 and scale M0 (Gelman et al., Bayesian Data Analysis, 3rd ed., sec. 2.6 on
the exponential model's conjugate prior): with no history it is the prior, and each hour of
running and each interruption move it towards the run's own rate.
"""

import json
import time
from pathlib import Path
from typing import List, Optional, Tuple

FILE_NAME = "run_history.jsonl"
DEFAULT_PRIOR_HOURS = 24.0
"""The prior mean time between interruptions: a day, about what large GPU jobs see (Llama 3's
report, Dubey et al. 2024, sec. 3.3.4: 466 interruptions in 54 days on 16,384 GPUs, one per
~2.8 h for the whole job; a smaller job sees fewer)."""


def append(run_dir: str, event: dict) -> None:
    """Rank 0: one line, flushed (a crash right after loses nothing written before it)."""
    path = Path(run_dir) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({**event, "time": event.get("time", time.time())}) + "\n")
        f.flush()


def read(run_dir: str) -> List[dict]:
    """The recorded events (lines that are not one are skipped: a write cut short by a crash)."""
    path = Path(run_dir) / FILE_NAME
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") in ("start", "end") \
                and isinstance(event.get("time"), (int, float)):
            events.append(event)
    return events


def interruptions(events: List[dict], now: float) -> Tuple[int, float]:
    """(interruptions, hours of running) of ``events`` up to ``now``."""
    count, seconds, started = 0, 0.0, None
    for event in events:
        if event["event"] == "start":
            if started is not None:  # the run before never wrote its end: it was cut off
                count += 1
                seconds += max(0.0, event["time"] - started)
            started = event["time"]
        elif started is not None:
            seconds += max(0.0, event["time"] - started)
            count += event.get("how") == "stopped"
            started = None
    if started is not None:
        seconds += max(0.0, now - started)
    return count, seconds / 3600.0


def estimate(events: List[dict], now: Optional[float] = None,
             prior_hours: float = DEFAULT_PRIOR_HOURS) -> Tuple[float, str]:
    """(mean time between interruptions in hours, the reason in words)."""
    n, hours = interruptions(events, time.time() if now is None else now)
    mtbf = (hours + prior_hours) / (n + 1)
    if n == 0 and hours == 0:
        return mtbf, f"no history in {FILE_NAME} yet: the prior, {prior_hours:g} h"
    return mtbf, (f"{n} interruption(s) in {hours:.2f} h of running ({FILE_NAME}), with a prior of one in "
                  f"{prior_hours:g} h: ({hours:.2f} + {prior_hours:g}) / ({n} + 1) = {mtbf:.2f} h")
