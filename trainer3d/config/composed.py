"""What composing the config with Hydra needs: the schema in Hydra's ConfigStore, the run
dir's resolver, and the check of a composed config's keys.

Importing this module registers ``Config`` (trainer3d/config/schema.py) as
``trainer3d_schema``, which conf/config.yaml names first in its defaults list, and the
``trainer3d_run_dir`` resolver its ``hydra.run.dir`` reads. Every place that composes
imports it: the entry point (trainer3d/train.py), the one-line refusal of overrides
(trainer3d/config/command_line.py), the ``--help`` page (trainer3d/config/help.py), the
planner's probe (trainer3d/plan/probe.py) and its schema (trainer3d/plan/composed.py), and the
tests that compose. The schema itself imports no Hydra: a rank unpickles its ``Config`` and
composes nothing, so it imports neither Hydra nor OmegaConf (tests/unit/test_import_cost.py).

``unknown_keys`` finds keys the schema lacks: Hydra's ``+key=value`` adds them to the
composed config, and ``OmegaConf.to_object`` would drop them without a word.
"""

import dataclasses
import typing
from typing import List

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer3d.config.schema import Config, named_run_dir

OmegaConf.register_new_resolver("trainer3d_run_dir", named_run_dir, replace=True)
ConfigStore.instance().store(name="trainer3d_schema", node=Config)


def _unwrap(hint):
    """The dataclass a field holds (directly, optionally, or as list elements), else None."""
    for arg in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def unknown_keys(node, schema=Config, prefix: str = "") -> List[str]:
    """The keys of the composed config ``node`` that the dataclass ``schema`` has no field for."""
    hints = typing.get_type_hints(schema)
    found = []
    for key in node.keys() if isinstance(node, DictConfig) else ():
        name = f"{prefix}{key}"
        if key not in hints:
            where = f"the keys of {prefix[:-1]}" if prefix else "the top-level keys"
            found.append(f"{name} is not a config key (misspelled?); {where} are: {', '.join(sorted(hints))}")
            continue
        inner = _unwrap(hints[key])
        child = node._get_node(key)
        if inner is not None and isinstance(child, DictConfig):
            found += unknown_keys(child, inner, f"{name}.")
        elif inner is not None and isinstance(child, ListConfig):
            for i, item in enumerate(child):
                found += unknown_keys(item, inner, f"{name}[{i}].")
    return found
