"""The planner's own knobs (``cluster.*``, ``search.*``) have ranges and choices too, checked with
the training knobs' tables (trainer3d/config/knobs.py) before the search starts.

Without them ``cluster.gpus_per_node=0`` divides by zero inside the device's share of memory,
``cluster.nodes=nan`` fails in Hydra's int conversion or deep in the search, and an empty
``search.micro_batch_sizes`` or a zero ``cluster.host_memory_gb`` makes every layout "not fit"
without a word on why. The upper bounds are far beyond any machine built (a million GPUs, a
PiB of host memory per node) and keep the search's enumeration (every divisor of the world
size) bounded.
"""

from typing import Dict, List, Tuple

from trainer3d.config.knobs import Range, choice_problems, get, range_problems
from trainer3d.plan.settings import PlanConfig

PLAN_RANGES: Dict[str, Range] = {
    "cluster.nodes": Range(1, hi=131073), "cluster.gpus_per_node": Range(1, hi=1025),
    "cluster.host_memory_gb": Range(0, lo_open=True, hi=2 ** 20),
    "cluster.host_memory_gb_s": Range(0, lo_open=True, hi=1e5), "cluster.pcie_gb_s": Range(0, lo_open=True, hi=1e4),
    "search.top": Range(1), "search.context_parallel_from": Range(1), "search.context_parallel_max": Range(1),
}
"""Each numeric knob of ``cluster.*`` and ``search.*`` and its valid values."""

PLAN_LISTS: Dict[str, Range] = {
    "search.micro_batch_sizes": Range(1, hi=2 ** 20), "search.zero_stages": Range(0, hi=4),
    "search.virtual_stages": Range(1, hi=1025),
}
"""List knobs: not empty, each element an integer in its range."""

PLAN_FLAG_LISTS = ("search.sequence_parallel", "search.recompute")
"""List knobs of true/false: not empty (an empty one would leave nothing to search)."""

PLAN_CHOICES: Dict[str, Tuple[str, ...]] = {
    "cluster.attention": ("flash", "math"), "cluster.backend": ("auto", "nccl", "gloo"),
}
SEARCHED_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")
"""What ``search.schedules`` may hold (GPipe is never proposed: see ``SearchConfig.virtual_stages``)."""
PLAN_CHOICE_LISTS: Dict[str, Tuple[str, ...]] = {"search.schedules": SEARCHED_SCHEDULES}
"""List knobs of choices: not empty, each element one of its choices."""
PLAN_FREE_TEXT = ("cluster.gpu", "cluster.calibration")
"""Checked by ``trainer3d.plan.devices.device_for`` (a preset's name, or a calibration file)."""


def plan_problems(cfg: PlanConfig) -> List[str]:
    """One line per knob out of its range or choices: the training knobs' tables (a planner's
    model and batch are the training run's), then the planner's own."""
    problems = range_problems(cfg) + choice_problems(cfg)
    for knob, valid in PLAN_RANGES.items():
        value = get(cfg, knob)
        if not valid.holds(value):
            problems.append(f"{knob}={value} {valid.describe()}")
    for knob, valid in PLAN_LISTS.items():
        values = list(get(cfg, knob))
        bad = [v for v in values if not isinstance(v, int) or not valid.holds(v)]
        if not values or bad:
            problems.append(f"{knob}={values}: give a non-empty list, each {valid.describe().replace('must be ', '')}")
    for knob in PLAN_FLAG_LISTS:
        if not list(get(cfg, knob)):
            problems.append(f"{knob}=[]: give [false], [true] or [false, true]")
    for knob, choices in PLAN_CHOICES.items():
        if get(cfg, knob) not in choices:
            problems.append(f"{knob}={get(cfg, knob)} is not one of {', '.join(choices)}")
    for knob, choices in PLAN_CHOICE_LISTS.items():
        values = list(get(cfg, knob))
        if not values or set(values) - set(choices):
            problems.append(f"{knob}={values}: give a non-empty list of {', '.join(choices)}")
    return problems
