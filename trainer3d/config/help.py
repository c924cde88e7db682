"""``--help`` of ``python -m trainer3d.train`` and ``python -m trainer3d.plan``: every knob with
its value in the composed config (the defaults, or under the overrides given with --help),
its valid values (trainer3d/config/knobs.py) and its docstring from the schema, and the
option of each config group (conf/<group>/*.yaml).

The docstrings are the string literals under each field of the schema's dataclasses (the
convention of trainer3d/config/schema*.py), read from the source with ``ast``: Python keeps
no runtime trace of them.
"""

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer3d.config.composed  # noqa: F401  (registers the training schema; trainer3d/plan/composed.py the planner's)
from trainer3d.config.conf_dir import CONF_DIR
from trainer3d.config.knobs import CHOICES, RANGES

WIDTH = 100


@lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """{field: docstring} of a dataclass (its own fields and its bases')."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _dataclass_of(hint) -> type:
    if typing.get_origin(hint) is list:
        return None
    return next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)


def _valid(knob: str) -> str:
    if knob in RANGES:
        return " (" + RANGES[knob].describe().replace("must be ", "") + ")"
    if knob in CHOICES:
        return " (" + " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in CHOICES[knob]) + ")"
    return ""


def knob_lines(cls: type, values: dict, prefix: str = "") -> List[str]:
    """``knob = value (valid values)`` and the docstring under it, for every leaf field."""
    lines: List[str] = []
    docs = field_docs(cls)
    for name, hint in typing.get_type_hints(cls).items():
        knob, value = f"{prefix}{name}", values.get(name)
        inner = _dataclass_of(hint)
        if inner is not None and isinstance(value, dict):
            lines += knob_lines(inner, value, f"{knob}.")
            continue
        lines.append(f"  {knob} = {'null' if value is None else value}{_valid(knob)}")
        if docs.get(name):
            lines += textwrap.wrap(docs[name], WIDTH, initial_indent="      ", subsequent_indent="      ")
    return lines


def groups(conf_dir: Path = CONF_DIR) -> List[str]:
    return [f"  {d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}"
            for d in sorted(conf_dir.iterdir()) if d.is_dir() and list(d.glob("*.yaml"))]


def help_text(command: str, config_name: str, schema: type, overrides: Sequence[str]) -> str:
    """The whole --help page: usage, groups, then every knob of ``schema`` as composed."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name=config_name, overrides=list(overrides))
    head = [f"usage: {command} [group=option ...] [knob=value ...]   (Hydra: --cfg job prints the resolved config, "
            "-m sweeps, --hydra-help its own options)", "",
            f"Config groups (conf/ in {CONF_DIR}), e.g. model=7b parallel=single:", *groups(), "",
            "Knobs: value" + (" under the given overrides" if overrides else " by default")
            + " (valid values), then what it does:"]
    values = OmegaConf.to_container(dcfg, resolve=False)  # interpolations as written: ${hydra:...} needs a run
    return "\n".join(head + knob_lines(schema, values)) + "\n"


def wants_help(argv: Sequence[str]) -> bool:
    return "--help" in argv or "-h" in argv


def print_help(command: str, config_name: str, schema: type, argv: Sequence[str]) -> None:
    print(help_text(command, config_name, schema, [a for a in argv if not a.startswith("-")]), end="")
