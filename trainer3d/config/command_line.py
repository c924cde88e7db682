"""Refusals of a command line's Hydra overrides, in the project's one language: one line,
``trainer3d: config error: <problem>``, exit status 2, for every entry point that takes
overrides (``python -m trainer3d.train``, ``python -m trainer3d.plan``, the tools that pass
overrides on: trainer3d/tools/parity.py).

Hydra refuses a mistyped key, a missing group option or a value of the wrong type itself,
with a multi-line message, a ``HYDRA_FULL_ERROR`` hint and exit status 1. ``overrides_problem``
composes the overrides first (the first point of a sweep) with Hydra's own ``compose`` and
turns its exception into one line: an unknown key with the nearest known keys of the
composed config (``difflib``, as Python's own "did you mean" for names), a group option
with the options there are, a value with the type its knob expects.
"""

import difflib
import sys
from typing import Iterable, List, Optional, Sequence

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from trainer3d.config.conf_dir import CONF_DIR
import trainer3d.config.composed  # noqa: F401  (registers the training schema; trainer3d/plan/composed.py the planner's)

# Hydra's own flags that choose another config, or print something other than a run: Hydra handles them
OTHER_CONFIG = ("config_path", "config_name", "config_dir", "info", "shell_completion", "hydra_help", "version")


def _keys(node, prefix: str = "") -> Iterable[str]:
    """Every dotted key of a composed config's leaves (the knobs)."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            yield from _keys(child, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def nearest_keys(key: str, known: Sequence[str], n: int = 3) -> List[str]:
    """The known keys closest to ``key``: by the whole dotted name, else by its last part."""
    close = difflib.get_close_matches(key, known, n=n, cutoff=0.6)
    if close:
        return close
    leaves = {k.rsplit(".", 1)[-1]: k for k in sorted(known, key=len, reverse=True)}
    return [leaves[leaf] for leaf in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=n)]


def _compose(config_name: str, overrides: Sequence[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name, list(overrides))


def _first_point(overrides: Sequence[str]) -> List[str]:
    """The overrides of a sweep's first point (``a=1,2`` -> ``a=1``); hydra.* left to Hydra."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    point = []
    for override in parsed:
        if override.get_key_element().lstrip("+~").startswith("hydra"):
            continue
        if override.is_sweep_override():
            try:
                first = next(iter(override.sweep_string_iterator()))
            except (HydraException, StopIteration, TypeError):
                continue  # a glob or an empty sweep: left to Hydra's sweeper
            point.append(f"{override.get_key_element()}={first}")
        else:
            point.append(override.input_line)
    return point


def _unknown_key(config_name: str, key: str, point: Sequence[str]) -> str:
    groups = [o for o in point if "=" in o and "." not in o.split("=", 1)[0]]  # model=..., parallel=...
    try:
        known = list(_keys(_compose(config_name, groups)))
    except (HydraException, OmegaConfBaseException):
        known = list(_keys(_compose(config_name, [])))
    near = nearest_keys(key, known)
    hint = f"did you mean {' or '.join(near)}?" if near else "no known key is near it"
    return f"{key} is not a knob of this config; {hint} (--help lists every knob with its default)"


TYPES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def _expected(err: ValidationError) -> str:
    """The type a knob's value failed to convert to, from OmegaConf's message
    ("Value 'abc' of type 'str' could not be converted to Integer")."""
    first = str(err.msg).splitlines()[0]
    wanted = first.split("converted to ", 1)[1].strip() if "converted to " in first else ""
    return TYPES.get(wanted, wanted or first)


def _unreadable(overrides: Sequence[str]) -> str:
    """The first override Hydra's grammar cannot read, named."""
    for override in overrides:
        try:
            OverridesParser.create().parse_override(override)
        except HydraException as err:  # the lexer's error is a HydraException, the parser's its subclass
            why = str(err).splitlines()[0]
            return (f"{override} is not an override Hydra can read ({why}); write key=value, quoting a "
                    "value with spaces or special characters: key='a value'")
    return f"Hydra cannot read the overrides {' '.join(overrides)}"


def overrides_problem(config_name: str, argv: Sequence[str]) -> Optional[str]:
    """Why the command line ``argv`` (Hydra's flags and overrides) cannot compose
    ``conf/<config_name>.yaml``, in one line; None where it composes (or Hydra's own flags
    choose another config)."""
    args = get_args_parser().parse_known_args(list(argv))[0]  # the parser hydra.main itself uses
    if any(getattr(args, flag, None) for flag in OTHER_CONFIG):
        return None
    try:
        point = _first_point(args.overrides)
    except OverrideParseException:
        return _unreadable(args.overrides)
    try:
        _compose(config_name, point)
    except MissingConfigException as err:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if group and err.options:
            return f"{group}={option} is not an option of {group}; the options are: {', '.join(err.options)}"
        return str(err).splitlines()[0]
    except HydraException as err:
        cause = err.__cause__
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            return _unknown_key(config_name, cause.full_key, point)
        if isinstance(cause, ValidationError) and cause.full_key:
            return f"{cause.full_key}={cause.value} is refused: {cause.full_key} takes {_expected(cause)}"
        return " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return None


def refuse_bad_overrides(config_name: str, argv: Sequence[str]) -> None:
    """Exit with status 2 after one ``trainer3d: config error:`` line where ``argv`` does not compose."""
    problem = overrides_problem(config_name, argv)
    if problem:
        print(f"trainer3d: config error: {problem}", file=sys.stderr)
        sys.exit(2)

