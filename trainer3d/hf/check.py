"""``model.init_from`` before launch: the model section from config.json, and the weights
checked against it, in the submitting process.

Every refusal is one line naming the field, file or override at fault, and all of them are
reported together (``ConfigError``), before any rank starts: a config.json of another
architecture or with settings this model does not implement, an explicit ``model.*``
override that disagrees with config.json, a missing shard, a tensor missing or of the
wrong shape or dtype, overlapping or out-of-range byte ranges, a NaN or Inf in a weight.
JSON and safetensors headers are read and checked first (trainer3d/hf/files.py); the model's
tensors are listed only once the files hold as many tensors as config.json implies (a config
that declares a million layers is refused by arithmetic, not by building the list); then each
weight's bytes are scanned for non-finite values through a memory map, a bounded chunk at a
time (the one pass over the data before launch; it leaves the pages cached for the ranks).
"""

import dataclasses
from pathlib import Path
from typing import Collection, Dict, List

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.hf.files import DTYPES, DirError, TensorInfo, first_nonfinite, read_json, tensor_infos
from trainer3d.hf.mapping import CONFIG, IGNORED, hf_shapes, model_fields, with_fields
from trainer3d.hf.mixtral import sliding_window_problem
from trainer3d.config.validate import ConfigError

_HF_KEY = {**{field: key for field, key, _ in CONFIG}, "moe.num_experts": "num_local_experts",
           "moe.top_k": "num_experts_per_tok"}
TRAINING_KNOBS = ("aux_loss_coef",)
"""model.moe fields config.json suggests (router_aux_loss_coef) that an explicit override replaces."""


def _get(cfg: ModelConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def conflicts(user: ModelConfig, derived: ModelConfig, explicit: Collection[str], config_path: Path) -> List[str]:
    """Explicit ``model.<field>=`` overrides that disagree with config.json."""
    problems = []
    for field in sorted(explicit):
        try:
            mine, theirs = _get(user, field), _get(derived, field)
        except AttributeError:
            continue  # Hydra already refused unknown keys; nothing to compare
        if mine != theirs:
            key = _HF_KEY.get(field, field)
            problems.append(f"model.{field}={mine} conflicts with {key}={theirs} in {config_path}; "
                            f"drop the override (model.init_from sets it)")
    return problems


def weight_problems(directory: Path, cfg: ModelConfig) -> List[str]:
    """What keeps the safetensors in ``directory`` from filling a model of ``cfg``."""
    try:
        infos = tensor_infos(directory)
    except DirError as err:
        return [str(err)]
    implied = expected_count(cfg)
    if implied > len(infos):
        return [f"{directory}: config.json implies {implied} tensors ({cfg.n_layers} layers), the weights hold "
                f"{len(infos)}; the weights do not match config.json"]
    try:
        need = hf_shapes(cfg)
    except (ValueError, RuntimeError, ArithmeticError, AssertionError) as err:
        return [f"{directory / 'config.json'}: describes no model that can be built ({type(err).__name__}: {err})"]
    problems = []
    missing = [name for name in need if name not in infos]
    if missing:
        problems.append(f"{directory}: {len(missing)} tensor(s) config.json implies are missing, "
                        f"first {missing[0]}; the weights do not match config.json")
    wrong = [(name, infos[name]) for name in need if name in infos and infos[name].shape != need[name]]
    if wrong:
        name, info = wrong[0]
        problems.append(f"{info.file}: {name} has shape {list(info.shape)}, config.json implies "
                        f"{list(need[name])} ({len(wrong)} tensor(s) differ); the weights do not match config.json")
    bad_dtype = [(name, info) for name, info in infos.items() if name in need and info.dtype not in DTYPES]
    if bad_dtype:
        name, info = bad_dtype[0]
        problems.append(f"{info.file}: {name} is {info.dtype}; only {', '.join(DTYPES)} weights can be loaded")
    problems += _unexpected(infos, need, cfg)
    return problems or _nonfinite(infos, need)


def expected_count(cfg: ModelConfig) -> int:
    """Tensors a Llama or Mixtral of ``cfg`` has: 9 per dense layer, 7 + 3 per expert per MoE
    layer (attention, norms, router, each expert's w1, w2, w3), the embedding, the final norm, the head."""
    moe = cfg.moe  # model/moe.py moe_layer, counted without a loop over a config.json's layer count
    dense_lead = min(moe.first_dense_layers, cfg.n_layers)
    moe_layers = -(-(cfg.n_layers - dense_lead) // moe.every) if moe.num_experts else 0
    per_moe = 7 + 3 * cfg.moe.num_experts
    return 9 * (cfg.n_layers - moe_layers) + per_moe * moe_layers + 2 + (0 if cfg.tie_embeddings else 1)


def _nonfinite(infos: Dict[str, TensorInfo], need: Dict[str, tuple]) -> List[str]:
    for name in need:
        index = first_nonfinite(infos[name])
        if index is not None:
            return [f"{infos[name].file}: {name} holds a NaN or Inf (element {index}); the weights are damaged "
                    "or diverged: give a checkpoint with finite weights"]
    return []


def _unexpected(infos: Dict[str, TensorInfo], need: Dict[str, tuple], cfg: ModelConfig) -> List[str]:
    extra = [n for n in infos if n not in need and not IGNORED.match(n)]
    if not extra:
        return []
    kind = "MixtralForCausalLM" if cfg.moe.num_experts else "LlamaForCausalLM"
    return [f"{infos[extra[0]].file} holds {len(extra)} tensor(s) a {kind} of config.json does not have, first "
            f"{extra[0]}; not a {kind} checkpoint"]


def apply_init_from(cfg: Config, explicit: Collection[str] = ()) -> Config:
    """``cfg`` with its model section derived from ``model.init_from``'s config.json (name:
    the directory's), after checking the weights; raises ConfigError with every problem.
    ``explicit``: the model fields the user set on the command line (``dim``,
    ``rope_scaling.factor``), which must agree with config.json."""
    directory = Path(cfg.model.init_from).expanduser()
    knob = f"model.init_from={cfg.model.init_from}"
    if not directory.is_dir():
        raise ConfigError([f"{knob}: not a directory; give a Hugging Face model directory (config.json + safetensors)"])
    try:
        config = read_json(directory / "config.json")
    except DirError as err:
        raise ConfigError([f"{knob}: {err}"]) from None
    fields, problems = model_fields(config)
    window = sliding_window_problem(config, cfg.train.seq_len)
    problems += [window] if window else []
    if problems:
        raise ConfigError([f"{knob}: {p}" for p in problems])
    for key in TRAINING_KNOBS:
        if f"moe.{key}" in explicit:
            fields["moe"].pop(key, None)
    name = cfg.model.name if "name" in explicit else directory.resolve().name
    derived = with_fields(cfg.model, fields, name=name, init_from=str(directory))
    compared = [field for field in explicit if field not in ("init_from", "name")]
    problems = conflicts(cfg.model, derived, compared, directory / "config.json")
    problems += [f"{knob}: {p}" for p in weight_problems(directory, derived)]
    if problems:
        raise ConfigError(problems)
    cfg = dataclasses.replace(cfg, model=derived)
    return cfg
