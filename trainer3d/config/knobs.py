"""Every knob's valid values, as tables: numeric ranges, string choices, the schema's keys.

``validate`` (trainer3d/config/validate.py) checks each numeric knob against ``RANGES`` and each
string knob against ``CHOICES`` (or lists it in ``FREE_TEXT``): the tests hold every field
of the schema to being in one of them, so a new knob cannot arrive unchecked. NaN and inf
are refused everywhere (a NaN compares false with every bound). Keys of a composed config
that the schema lacks are found by trainer3d/config/composed.py ``unknown_keys`` (this module
is imported by every rank, through ``validate``, and imports no OmegaConf).
"""

import dataclasses
import functools
import math
import operator
import os
import typing
from typing import Dict, List, Optional, Tuple

from trainer3d.config.schema import Config


@dataclasses.dataclass(frozen=True)
class Range:
    """lo <= value (lo < value if ``lo_open``), and value < hi where hi is given."""

    lo: float
    lo_open: bool = False
    hi: Optional[float] = None

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and (self.hi is None or value < self.hi)

    def describe(self) -> str:
        if self.hi is not None:
            return f"must be in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g})"
        return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"


AT_LEAST_1, AT_LEAST_0, POSITIVE, UNIT = Range(1), Range(0), Range(0, lo_open=True), Range(0, hi=1)
YEAR_S = 365 * 86400
"""The longest wait a timeout knob takes: a year (``datetime.timedelta``, which torch's process
groups take, overflows near 1e14 s, and Slurm's time limits stop at a year's order)."""
SECONDS, MINUTES = Range(0, lo_open=True, hi=YEAR_S), Range(1, hi=YEAR_S // 60)

RANGES: Dict[str, Range] = {
    **{f"model.{k}": AT_LEAST_1 for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                                         "vocab_size", "max_seq_len")},
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE, "model.init_std": POSITIVE,
    "model.bos_token_id": AT_LEAST_0,
    **{f"model.moe.{k}": AT_LEAST_0 for k in ("num_experts", "num_shared_experts", "first_dense_layers",
                                             "capacity_factor", "aux_loss_coef", "bias_update_rate", "z_loss_coef")},
    **{f"model.moe.{k}": AT_LEAST_1 for k in ("top_k", "expert_ffn_dim", "every")},
    "model.rope_scaling.factor": POSITIVE, "model.rope_scaling.low_freq_factor": POSITIVE,
    "model.rope_scaling.high_freq_factor": POSITIVE, "model.rope_scaling.original_max_seq_len": AT_LEAST_1,
    **{f"parallel.{k}": AT_LEAST_1 for k in ("tp", "pp", "dp", "cp", "pp_virtual_stages", "dp_shard", "ep")},
    "parallel.bucket_mb": POSITIVE, "parallel.timeout_s": SECONDS, "parallel.init_timeout_s": SECONDS,
    **{f"train.{k}": AT_LEAST_1 for k in ("micro_batch_size", "grad_accum_steps", "global_batch_size", "seq_len",
                                         "max_steps", "log_every", "eval_steps")},
    "train.seed": Range(0, hi=2 ** 63), "train.loss_scale_init": POSITIVE, "train.peak_tflops": POSITIVE,
    "train.eval_every": AT_LEAST_0, "train.loss_chunk_tokens": AT_LEAST_0,
    "train.spike.window": Range(3), "train.spike.threshold": POSITIVE, "train.spike.min_steps": AT_LEAST_0,
    "train.spike.skip_window": AT_LEAST_1,
    "train.straggler.window": AT_LEAST_0, "train.straggler.threshold": Range(1, lo_open=True),
    "train.straggler.persist": AT_LEAST_1,
    "train.inject.slow_rank": AT_LEAST_0, "train.inject.slow_ms": AT_LEAST_0,
    "optim.lr": POSITIVE, "optim.min_lr": AT_LEAST_0, "optim.warmup_steps": AT_LEAST_0,
    "optim.decay_steps": AT_LEAST_1, "optim.weight_decay": AT_LEAST_0, "optim.beta1": UNIT, "optim.beta2": UNIT,
    "optim.eps": POSITIVE, "optim.grad_clip": AT_LEAST_0,
    "optim.muon.lr": POSITIVE, "optim.muon.weight_decay": AT_LEAST_0, "optim.muon.momentum": UNIT,
    "optim.muon.ns_steps": Range(1, hi=100), "optim.muon.eps": POSITIVE,
    "data.val_fraction": UNIT, "data.eos_id": AT_LEAST_0,
    "launcher.timeout_min": MINUTES, "launcher.nodes": AT_LEAST_1, "launcher.tasks_per_node": AT_LEAST_1,
    "launcher.gpus_per_node": AT_LEAST_0, "launcher.cpus_per_task": AT_LEAST_1, "launcher.mem_gb": POSITIVE,
    "launcher.signal_delay_s": Range(0, hi=YEAR_S), "launcher.max_requeues": AT_LEAST_0,
    "checkpoint.keep": AT_LEAST_1,
}
"""Each numeric knob's valid values (None, where the field is optional, means "derive it")."""

CHOICES: Dict[str, Tuple[object, ...]] = {
    "parallel.zero_stage": (0, 1, 2, 3),
    "model.rope_scaling.type": ("none", "llama3"),
    "model.moe.router": ("softmax_topk", "sigmoid_topk"),
    "model.moe.balance": ("aux_loss", "aux_free", "none"),
    "parallel.pp_schedule": ("1f1b", "gpipe", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"),
    "parallel.cp_attention": ("ring", "all_gather"),
    "parallel.zero_reduce": ("auto", "all_reduce", "reduce_scatter"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "train.dtype": ("fp32", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.compile_backend": ("inductor", "aot_eager"),
    "train.on_nonfinite": ("stop", "continue"),
    "train.spike.policy": ("skip", "rollback", "warn", "off"),
    "optim.name": ("adamw", "muon"),
    "optim.muon.adjust_lr": ("original", "match_rms_adamw"),
    "optim.muon.ns_dtype": ("bf16", "fp32"),
    "optim.muon.nesterov": (True, False),
    "optim.muon.layer_wise": (True, False),
    "data.name": ("stdlib", "tokens", "chat_sample"),
    "launcher.name": ("local", "slurm", "inplace"),
    "logger.name": ("console", "wandb", "tensorboard"),
    "logger.mode": ("auto", "offline", "online", "disabled"),
    "checkpoint.async_save": (True, False),
}
"""Each knob with a fixed set of values."""

FREE_TEXT = ("model.name", "model.init_from", "train.resume", "data.path", "data.val_path", "data.cache_dir",
             "launcher.folder", "launcher.partition", "launcher.account", "launcher.qos", "launcher.constraint",
             "launcher.job_name", "logger.project", "logger.entity", "logger.group", "logger.run_name",
             "checkpoint.dir", "run_dir", "name")
"""String knobs naming a path or a label: when set, they must not be empty."""


def get(cfg: Config, knob: str):
    return _getter(knob)(cfg)


@functools.lru_cache(maxsize=512)
def _getter(knob: str):
    """``operator.attrgetter`` of the dotted ``knob``: validate() reads every knob of the tables
    above, for each of the planner's thousands of candidates (trainer3d/plan/search.py)."""
    return operator.attrgetter(knob)


def nullable(knob: str) -> bool:
    """The schema lets ``knob`` be null (its field is ``Optional``)."""
    owner = Config
    for part in knob.split("."):
        hint = typing.get_type_hints(owner)[part]
        owner = hint
    return type(None) in typing.get_args(hint)


def range_problems(cfg: Config) -> List[str]:
    """One line per numeric knob outside its range."""
    problems = []
    for knob, valid in RANGES.items():
        value = get(cfg, knob)
        if value is not None and not valid.holds(value):
            problems.append(f"{knob}={value} {valid.describe()}{', or null' if nullable(knob) else ''}")
    return problems


def choice_problems(cfg: Config) -> List[str]:
    """One line per knob not among its choices, or set but empty."""
    problems = []
    for knob, choices in CHOICES.items():
        value = get(cfg, knob)
        if value not in choices:
            shown = knob[:-len(".name")] if knob.endswith(".name") else knob
            problems.append(f"{shown}={value} is not one of {', '.join(map(str, choices))}")
    for knob in FREE_TEXT:
        value = get(cfg, knob)
        if value is not None and not str(value).strip():
            problems.append(f"{knob} is empty; give a value or leave it unset")
    return problems


DIRECTORIES = ("run_dir", "checkpoint.dir", "launcher.folder", "data.cache_dir")
"""Knobs naming a directory the run writes into."""

PATHS = (*DIRECTORIES, "data.path", "data.val_path", "model.init_from", "train.resume")
"""Every knob naming a path (with each ``data.blend[i].path``); ``train.resume``'s words
auto and never are not paths."""


def _nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists: where the file system's limits are read."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def name_problem(path: str) -> Optional[str]:
    """Why the file system cannot hold ``path`` by its name alone, or None: a NUL byte, a
    component longer than its NAME_MAX (255 bytes on ext4, xfs, btrfs, tmpfs: pathconf(3)'s
    _PC_NAME_MAX), or the whole longer than PATH_MAX. Each would end in an OSError
    (ENAMETOOLONG) wherever the path is first used: Hydra's run dir, a rank, a check's open()."""
    if "\0" in path:
        return "holds a NUL byte, which no file name can"
    full = os.path.abspath(os.path.expanduser(path))
    where = _nearest_existing(full)
    try:
        name_max, path_max = os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096  # Linux's limits (limits.h)
    for part in full.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            return (f"has a component of {len(os.fsencode(part))} bytes ({part[:24]}...), more than the "
                    f"{name_max} its file system allows (NAME_MAX); shorten it")
    if len(os.fsencode(full)) >= path_max:
        return f"is {len(os.fsencode(full))} bytes long, not below the {path_max} the system allows (PATH_MAX)"
    return None


def path_values(cfg: Config) -> List[Tuple[str, str]]:
    """(knob, value) of every path knob that is set."""
    found = [(knob, get(cfg, knob)) for knob in PATHS]
    found = [(k, v) for k, v in found if v and not (k == "train.resume" and v in ("auto", "never"))]
    return found + [(f"data.blend[{i}].path", s.path) for i, s in enumerate(cfg.data.blend) if s.path]


def expand_paths(cfg: Config) -> Config:
    """``cfg`` with a leading ``~`` of every path knob (``PATHS``, each ``data.blend`` entry's)
    expanded to the home directory, in place. Bash expands ``~`` only at the start of a word, not
    after ``key=``, and Hydra's override grammar refuses an unquoted one
    (https://hydra.cc/docs/advanced/override_grammar/basic/), so ``'model.init_from=~/m'``
    reaches the config as written."""
    for knob in PATHS:
        section, _, name = knob.rpartition(".")
        holder = get(cfg, section) if section else cfg
        value = getattr(holder, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(holder, name, os.path.expanduser(value))
    for source in cfg.data.blend:
        source.path = os.path.expanduser(source.path)
    if cfg.train.resume not in ("auto", "never"):
        cfg.train.resume = os.path.expanduser(cfg.train.resume)
    return cfg


def path_problems(cfg: Config) -> List[str]:
    """Every path knob in one place, before anything opens one: a name the file system cannot
    hold (``name_problem``), and a directory knob that names an existing file."""
    problems = []
    for knob, value in path_values(cfg):
        problem = name_problem(str(value))
        if problem:
            problems.append(f"{knob}={str(value)[:60]}{'...' if len(str(value)) > 60 else ''} {problem}")
        elif knob in DIRECTORIES and os.path.exists(os.path.expanduser(value)) and not os.path.isdir(os.path.expanduser(value)):
            problems.append(f"{knob}={value} is a file, not a directory; give a directory")
    return problems
