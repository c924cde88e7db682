"""Check a config before anything launches.

``validate`` is a pure function of the config (and the world size the launcher will
give): it derives the missing batch knob and returns a completed copy, or raises
``ConfigError`` listing every problem, each naming the knob to change and the fix.
"""

import copy
import math
from typing import List, Optional

from trainer3d.config import device as device_check
from trainer3d.config.schema import RUN_NAME, Config
from trainer3d.config.knobs import choice_problems, expand_paths, range_problems
from trainer3d.config.validate_data import data_problems
from trainer3d.config.validate_moe import moe_problems
from trainer3d.config.validate_optim import optim_problems
from trainer3d.config.validate_pipeline import consistent_batch, pipeline_problems

class ConfigError(ValueError):
    """A config the engine refuses; ``problems`` holds one line per broken rule."""

    def __init__(self, problems: List[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "zero_stage", "pp_schedule", "pp_virtual_stages", "sequence_parallel")


def world_size_of(cfg: Config) -> int:
    p = cfg.parallel
    return p.tp * p.cp * p.pp * p.dp


def _layout_text(cfg: Config) -> str:
    """``tp(2) * pp(2) * dp(2)``, with ``cp(..)`` after tp when cp > 1."""
    p = cfg.parallel
    return f"tp({p.tp}) * {f'cp({p.cp}) * ' if p.cp > 1 else ''}pp({p.pp}) * dp({p.dp})"


def layout_of(cfg: Config) -> dict:
    """The run's layout: the world size and the ``parallel.*`` knobs that decide what each
    rank holds (logged with the config, kept in every checkpoint's marker, compared on resume)."""
    p = cfg.parallel
    layout = {"world_size": world_size_of(cfg), **{k: getattr(p, k) for k in LAYOUT_KEYS}}
    if p.zero_stage >= 2 and p.dp_shard not in (None, p.dp):  # HSDP only: full sharding's marker unchanged
        layout["dp_shard"] = p.dp_shard
    if p.ep > 1:  # expert parallelism only: a marker without experts split stays as it was
        layout["ep"] = p.ep
    return layout


def validate(cfg: Config, world_size: Optional[int] = None) -> Config:
    """Return a copy of ``cfg`` with the batch arithmetic completed, or raise ConfigError.

    ``world_size`` is what the launcher will start (Slurm: nodes * tasks_per_node;
    in place: $WORLD_SIZE); None means the local launcher, which starts tp * cp * pp * dp.
    """
    return validate_owned(copy.deepcopy(cfg), world_size)


def validate_owned(cfg: Config, world_size: Optional[int] = None) -> Config:
    """``validate()`` of a config the caller made for it, completed in place and returned (no
    copy): the two things validation writes are the batch knob it derives (``train``) and each
    path knob's leading ``~`` (``expand_paths``, the same value once expanded). The planner's
    search (trainer3d/plan/search.py) builds every candidate with a ``train`` and ``parallel``
    of its own around groups only it holds, and so skips a deep copy of the whole config per
    candidate."""
    cfg = expand_paths(cfg)
    problems: List[str] = []
    _check_ranges(cfg, problems)
    if problems:  # the rules below divide by these knobs
        raise ConfigError(problems)
    _check_world(cfg, world_size, problems)
    _derive_batch(cfg, problems)
    problems += pipeline_problems(cfg)
    _check_tensor(cfg, problems)
    _check_context(cfg, problems)
    _check_zero_and_precision(cfg, problems)
    problems += data_problems(cfg)
    _check_steps_and_names(cfg, problems)
    problems += moe_problems(cfg)
    problems += optim_problems(cfg)
    problems += choice_problems(cfg)
    problems += device_check.config_problems(cfg, world_size_of(cfg))
    _check_signal_delay(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _check_ranges(cfg: Config, problems: List[str]) -> None:
    """Every numeric knob in its range (the table of trainer3d/config/knobs.py)."""
    problems += range_problems(cfg)
    if cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; "
                        "set optim.min_lr <= optim.lr")
    for i, token in enumerate(cfg.model.eos_token_ids):
        if not 0 <= token < cfg.model.vocab_size:
            problems.append(f"model.eos_token_ids[{i}]={token} is outside the vocabulary [0, model.vocab_size)")
    if cfg.model.bos_token_id is not None and cfg.model.bos_token_id >= cfg.model.vocab_size:
        problems.append(f"model.bos_token_id={cfg.model.bos_token_id} is outside the vocabulary [0, model.vocab_size)")


def _check_signal_delay(cfg: Config, problems: List[str]) -> None:
    launcher = cfg.launcher
    if launcher.name == "slurm" and launcher.signal_delay_s >= launcher.timeout_min * 60:
        problems.append(f"launcher.signal_delay_s={launcher.signal_delay_s} is not below launcher.timeout_min="
                        f"{launcher.timeout_min} minutes: the job would be told to stop as it starts; lower it")


def _check_world(cfg: Config, world_size: Optional[int], problems: List[str]) -> None:
    launcher = cfg.launcher
    layout = world_size_of(cfg)
    if launcher.name == "slurm":
        tasks = launcher.tasks_per_node
        if tasks is None:
            if layout % launcher.nodes:
                problems.append(
                    f"{_layout_text(cfg)} = {layout} ranks do not split evenly over "
                    f"launcher.nodes={launcher.nodes}; change launcher.nodes or parallel.dp")
                return
            tasks = layout // launcher.nodes
        world_size = launcher.nodes * tasks
        if world_size != layout:
            problems.append(
                f"launcher.nodes({launcher.nodes}) * launcher.tasks_per_node({tasks}) = {world_size} "
                f"ranks, but {_layout_text(cfg)} = {layout}; "
                f"set parallel.dp={_suggest_dp(cfg, world_size)} or change launcher.tasks_per_node")
    elif world_size is not None and world_size != layout:
        problems.append(
            f"the allocation has {world_size} ranks but {_layout_text(cfg)} = {layout}; "
            f"set parallel.dp={_suggest_dp(cfg, world_size)}")


def _suggest_dp(cfg: Config, world_size: int) -> str:
    p = cfg.parallel
    model_parallel = p.tp * p.cp * p.pp
    if world_size % model_parallel == 0:
        return str(world_size // model_parallel)
    names = "tp*cp*pp" if p.cp > 1 else "tp*pp"
    return f"<world_size / ({names})> (but {world_size} is not a multiple of {names}={model_parallel})"


def _derive_batch(cfg: Config, problems: List[str]) -> None:
    """global = micro * grad_accum * dp. DP, never the world size: TP and PP ranks share a batch."""
    t, dp = cfg.train, cfg.parallel.dp
    micro, accum, glob = t.micro_batch_size, t.grad_accum_steps, t.global_batch_size
    given = sum(v is not None for v in (micro, accum, glob))
    if given < 2:
        problems.append("give two of train.micro_batch_size, train.grad_accum_steps, "
                        "train.global_batch_size (the third is derived: global = micro * grad_accum * dp)")
        return
    if glob is None:
        t.global_batch_size = micro * accum * dp
    elif accum is None or micro is None:  # the missing one is global / (the given one * dp)
        given_name, given, missing = (("micro_batch_size", micro, "grad_accum_steps") if accum is None
                                      else ("grad_accum_steps", accum, "micro_batch_size"))
        unit = given * dp
        if glob % unit:
            problems.append(
                f"train.global_batch_size={glob} is not a multiple of {given_name}({given}) * dp({dp}) "
                f"= {unit}; set train.global_batch_size={max(1, round(glob / unit)) * unit}, or one consistent "
                f"set: {consistent_batch(cfg)}")
        else:
            setattr(t, missing, glob // unit)
    elif micro * accum * dp != glob:
        problems.append(
            f"train.global_batch_size={glob} is not micro_batch_size({micro}) * grad_accum_steps({accum}) "
            f"* dp({dp}) = {micro * accum * dp}; set train.global_batch_size={micro * accum * dp} "
            f"or leave one of the three unset (null), or one consistent set: {consistent_batch(cfg)}")


def _check_tensor(cfg: Config, problems: List[str]) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if m.head_dim is None and m.dim % m.n_heads:
        problems.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads} "
                        "(or set model.head_dim)")
    if m.n_heads % m.n_kv_heads:
        problems.append(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}")
    elif m.head_dim is not None and (m.head_dim < 2 or m.head_dim % 2):
        problems.append(f"model.head_dim={m.head_dim} must be even (and >= 2) for rotary embeddings")
    elif m.head_dim is None and (m.dim // m.n_heads) % 2:
        problems.append(f"head dim model.dim/model.n_heads={m.dim // m.n_heads} must be even for rotary "
                        "embeddings; change model.dim or model.n_heads")
    _check_rope_scaling(cfg, problems)
    for knob, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                        ("model.ffn_dim", m.ffn_dim)):
        if value % p.tp:
            problems.append(f"{knob}={value} is not divisible by parallel.tp={p.tp}; "
                            f"each tensor-parallel rank needs an equal share: change parallel.tp")
    if t.seq_len > m.max_seq_len:
        problems.append(f"train.seq_len={t.seq_len} > model.max_seq_len={m.max_seq_len}; "
                        "lower train.seq_len or raise model.max_seq_len")
    if p.sequence_parallel and p.tp == 1:
        problems.append("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.sequence_parallel and t.seq_len % p.tp:
        problems.append(f"train.seq_len={t.seq_len} is not divisible by parallel.tp={p.tp}, "
                        "which sequence parallelism needs")


def _check_context(cfg: Config, problems: List[str]) -> None:
    """Context parallelism cuts each sequence into 2 * cp chunks (trainer3d/data/cp_sharding.py);
    with sequence parallelism a cp rank's tokens are split again over tp."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return
    if t.seq_len % (2 * p.cp):
        fit = max(2 * p.cp, t.seq_len // (2 * p.cp) * 2 * p.cp)
        problems.append(f"train.seq_len={t.seq_len} is not a multiple of 2 * parallel.cp = {2 * p.cp} "
                        f"(each cp rank holds two equal chunks); set train.seq_len={fit} or change parallel.cp")
    elif p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        problems.append(f"train.seq_len={t.seq_len} / parallel.cp={p.cp} = {t.seq_len // p.cp} tokens per cp "
                        f"rank is not divisible by parallel.tp={p.tp}, which sequence parallelism needs")


def _check_rope_scaling(cfg: Config, problems: List[str]) -> None:
    r = cfg.model.rope_scaling
    if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        problems.append(f"model.rope_scaling.high_freq_factor={r.high_freq_factor} must exceed "
                        f"model.rope_scaling.low_freq_factor={r.low_freq_factor}")


def _check_zero_and_precision(cfg: Config, problems: List[str]) -> None:
    p = cfg.parallel
    if p.zero_stage >= 2 and p.pp > 1:
        problems.append(
            f"parallel.zero_stage={p.zero_stage} with parallel.pp={p.pp}: pipelining accumulates full "
            "gradients over a step's micro-batches, so partitioned gradients/parameters buy nothing and "
            "break the schedule; use parallel.zero_stage=1 (or 0) with pipelining")
    _check_hsdp(cfg, problems)


def _check_hsdp(cfg: Config, problems: List[str]) -> None:
    """``parallel.dp_shard``: FSDP2's shard group, S neighbouring dp ranks (docs/parallelism.md)."""
    p, launcher = cfg.parallel, cfg.launcher
    if p.dp_shard is None:
        return
    divisors = [d for d in range(1, p.dp + 1) if p.dp % d == 0]
    if p.zero_stage < 2:
        problems.append(f"parallel.dp_shard={p.dp_shard} shards FSDP2's parameters, gradients and optimizer state, "
                        f"which parallel.zero_stage={p.zero_stage} does not use; set parallel.zero_stage=3 (or 2), "
                        "or parallel.dp_shard=null")
    elif p.dp % p.dp_shard:
        problems.append(f"parallel.dp_shard={p.dp_shard} does not divide parallel.dp={p.dp} into equal replicas; "
                        f"set parallel.dp_shard to one of {divisors}")
    elif launcher.name == "slurm":
        per_node = launcher.tasks_per_node or world_size_of(cfg) // launcher.nodes
        group = p.dp_shard * p.cp * p.tp  # consecutive ranks (trainer3d/parallel/topology.py)
        if per_node and per_node % group and group % per_node:
            fits = [d for d in divisors if per_node % (d * p.cp * p.tp) == 0]
            problems.append(f"parallel.dp_shard={p.dp_shard}: a shard group is dp_shard x cp x tp = {group} "
                            f"consecutive ranks, which straddles the nodes' {per_node} ranks each, so its "
                            f"all-gathers cross a node boundary; set parallel.dp_shard to "
                            f"{f'one of {fits} (a group inside a node) or ' if fits else ''}a value whose group "
                            "is a whole number of nodes")


def _check_steps_and_names(cfg: Config, problems: List[str]) -> None:
    """The knobs that name steps of this run, the checkpoint interval, and the run's name."""
    _check_profile(cfg, problems)
    _check_step_lists(cfg, problems)
    every = cfg.checkpoint.every
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        problems.append(f"checkpoint.every={every} must be a number of steps >= 0 (0: only at the end and on "
                        "preemption) or auto (the interval from measured save costs and checkpoint.mtbf_hours)")
    mtbf = cfg.checkpoint.mtbf_hours
    if mtbf != "auto" and (isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or not 0 < mtbf < math.inf):
        problems.append(f"checkpoint.mtbf_hours={mtbf} must be a number of hours > 0 or auto (estimated from the "
                        "run dir's history of interruptions)")
    if cfg.name is not None and not RUN_NAME.match(str(cfg.name)):
        problems.append(f"name={cfg.name!r}: a run name is letters, digits, '.', '_' and '-' (no '/', not starting "
                        "with '.'), e.g. name=llama-1b-web")


def _check_profile(cfg: Config, problems: List[str]) -> None:
    window, steps = list(cfg.train.profile), cfg.train.max_steps
    if window and not (len(window) == 2 and 0 <= window[0] < window[1] <= steps):
        problems.append(f"train.profile={window} must be [first, end] with 0 <= first < end <= train.max_steps"
                        f"={steps} (steps first..end-1 are traced), e.g. train.profile=[{min(2, steps - 1)},"
                        f"{min(5, steps)}], or [] for none")


def _check_step_lists(cfg: Config, problems: List[str]) -> None:
    """train.skip_steps and train.inject.corrupt_steps name steps of this run (0-based)."""
    steps = cfg.train.max_steps
    for knob, values in (("train.skip_steps", cfg.train.skip_steps),
                         ("train.inject.corrupt_steps", cfg.train.inject.corrupt_steps)):
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < steps]
        if bad:
            problems.append(f"{knob}: {bad} are not steps of this run (integers 0 <= step < train.max_steps"
                            f"={steps}); give steps as metrics.jsonl numbers them, e.g. {knob}=[120,121]")
    inject, world = cfg.train.inject, world_size_of(cfg)
    if inject.slow_rank is not None and inject.slow_rank >= world:
        problems.append(f"train.inject.slow_rank={inject.slow_rank} is not a rank of this job ({world} ranks): "
                        f"give 0..{world - 1}, or null for none")
    if (inject.slow_rank is None) != (inject.slow_ms == 0):
        problems.append(f"train.inject.slow_rank={inject.slow_rank} and train.inject.slow_ms={inject.slow_ms:g}: "
                        "the drill needs both (a rank and its delay, e.g. slow_rank=1 slow_ms=200) or neither")
