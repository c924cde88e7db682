"""The knobs that size a run's memory and time which the user left at their defaults.

A dry run of ``model=70b`` composes the schema's ``train.seq_len=128`` and ``train.dtype=fp32``
without a word; ``defaults_used`` names such knobs so the user sees them before believing
the figures. A knob counts as the user's when the command line sets it (``train.seq_len=…``),
chooses its group (``model=7b``, ``parallel=dp2``) or sets a key inside that group
(``model.dim=…``), or when the chosen recipe (``experiment=…``, conf/experiment/) does the
same in its body or its ``defaults`` list. ``train.grad_accum_steps`` left unset is derived
from the other two batch knobs (trainer3d/config/validate.py), not a default, so it is not
listed.
"""

from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set

from omegaconf import OmegaConf

from trainer3d.config.schema import Config

SIZING = ("model", "train.seq_len", "train.dtype", "train.micro_batch_size", "train.global_batch_size",
          "train.grad_accum_steps", "parallel.tp", "parallel.pp", "parallel.dp", "parallel.cp",
          "parallel.zero_stage", "train.activation_checkpointing")
"""Every knob that changes the peak memory or the step time by a factor (the dry run's figures)."""
GROUPS = ("model", "parallel")


def _flat_keys(node, prefix: str = "") -> Iterable[str]:
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        yield dotted
        if OmegaConf.is_dict(value) or isinstance(value, dict):
            yield from _flat_keys(value, dotted + ".")


def recipe_keys(conf_dir: Path, recipe: str) -> Optional[List[str]]:
    """The keys and groups conf/experiment/<recipe>.yaml sets; None if the file is not there."""
    path = Path(conf_dir) / "experiment" / f"{recipe}.yaml"
    if not path.is_file():
        return None
    body = OmegaConf.load(path)
    keys = [k for k in _flat_keys(body) if k != "defaults" and not k.startswith("defaults.")]
    for entry in body.get("defaults", []):
        if OmegaConf.is_dict(entry):
            keys += [str(k).replace("override", "").strip().lstrip("/") for k in entry]
    return keys


def given_keys(overrides: Sequence[str], recipe: Sequence[str] = ()) -> Set[str]:
    """The dotted keys (or group names) the command line's ``overrides`` and a recipe set."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides} | set(recipe)


def _is_given(knob: str, given: Set[str]) -> bool:
    section = knob.split(".")[0]
    if section in GROUPS and (section in given or any(k.startswith(section + ".") for k in given)):
        return knob == "model" or section in given or knob in given
    return knob in given


def _value(cfg: Config, knob: str) -> str:
    if knob == "model":
        return cfg.model.name
    section, field = knob.split(".")
    value = getattr(getattr(cfg, section), field)
    return str(value).lower() if isinstance(value, bool) else str(value)


def defaults_used(cfg: Config, given: Set[str]) -> List[str]:
    """``knob=value`` of every SIZING knob ``given`` leaves at its default (``cfg``: validated)."""
    unset = [k for k in SIZING if not _is_given(k, given)]
    if "train.grad_accum_steps" in unset:  # derived from micro x dp and the global batch
        unset.remove("train.grad_accum_steps")
    return [f"{k}={_value(cfg, k)}" for k in unset]


def defaults_block(cfg: Config, given: Optional[Set[str]], width: int = 100) -> List[str]:
    """The dry run's lines naming the defaults it used (none where ``given`` is unknown)."""
    if given is None:
        return []
    used = defaults_used(cfg, given)
    if not used:
        return ["defaults used: none of the knobs that size memory and time"]
    lines = ["defaults used (set on the command line to change; they size memory and time):"]
    line = " "
    for item in used:
        if len(line) + len(item) + 1 > width and line.strip():
            lines.append(line)
            line = " "
        line += " " + item
    return lines + [line]
