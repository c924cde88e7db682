"""The one table between trainer3d's model and Hugging Face's Llama, read in both directions
(Mixtral's mixture-of-experts blocks: trainer3d/hf/mixtral.py).

Parameter names: the layouts are the same tensors (transformers' Llama rotates the pairs
(i, i + head_dim/2) as model/transformer.py does, so q/k need no permutation; SwiGLU's silu
branch w1 is ``gate_proj``), only the names differ.

config.json: ``CONFIG`` pairs each ModelConfig field with its config.json key and the value
transformers' LlamaConfig assumes when the key is absent (``REQUIRED``: refused if absent);
``FIXED`` lists what a plain Llama must say and what an export writes; the rotary settings
are read from the legacy (``rope_theta`` + ``rope_scaling``) or the transformers 5
(``rope_parameters``) spelling and written in both.
"""

import dataclasses
import math
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from trainer3d.config.schema import ModelConfig, RopeScalingConfig
from trainer3d.hf import mixtral
from trainer3d.model.transformer import Transformer, head_dim_of

# (trainer3d name, Hugging Face name); {i} is the layer index.
NAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    mixtral.ROUTER,
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
# Tensors some Llama checkpoints carry that hold no weights (older transformers saved the
# rotary inverse frequencies as a buffer).
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

REQUIRED = object()
# (ModelConfig field, config.json key, value when absent: REQUIRED, LlamaConfig's default,
#  or the name of the key it defaults to)
CONFIG = (
    ("dim", "hidden_size", REQUIRED),
    ("ffn_dim", "intermediate_size", REQUIRED),
    ("n_layers", "num_hidden_layers", REQUIRED),
    ("n_heads", "num_attention_heads", REQUIRED),
    ("n_kv_heads", "num_key_value_heads", "num_attention_heads"),
    ("head_dim", "head_dim", None),  # None: hidden_size // num_attention_heads
    ("vocab_size", "vocab_size", REQUIRED),
    ("norm_eps", "rms_norm_eps", 1e-6),
    ("max_seq_len", "max_position_embeddings", 2048),
    ("tie_embeddings", "tie_word_embeddings", False),
    ("bos_token_id", "bos_token_id", None),
)
ROPE_SCALING = (  # (RopeScalingConfig field, key in rope_scaling / rope_parameters)
    ("factor", "factor"),
    ("low_freq_factor", "low_freq_factor"),
    ("high_freq_factor", "high_freq_factor"),
    ("original_max_seq_len", "original_max_position_embeddings"),
)
FIXED = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "attention_bias": False, "mlp_bias": False}
ARCHITECTURES = {"llama": FIXED, "mixtral": mixtral.FIXED}
DEFAULT_ROPE_THETA = 10000.0
_TYPES = {"tie_embeddings": bool, "norm_eps": float, "rope_theta": float, "factor": float,
          "low_freq_factor": float, "high_freq_factor": float, "aux_loss_coef": float}


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), theirs) for ours, theirs in NAMES]
_FROM_HF = [(_pattern(theirs), ours) for ours, theirs in NAMES]


def _rename(name: str, table) -> Optional[str]:
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.group(1)) if match.groups() else template
    return None


def to_hf(name: str) -> str:
    """The Hugging Face name of a 2-D or 1-D trainer3d weight (a 3-D expert weight is one per
    expert: ``hf_tensors``)."""
    hf = _rename(name, _TO_HF)
    if hf is None:
        raise KeyError(f"{name} has no Hugging Face Llama name")
    return hf


def from_hf(name: str) -> Optional[str]:
    """trainer3d's name for a Hugging Face tensor name (the 3-D weight a Mixtral expert's
    belongs to), or None for an unknown one."""
    expert = mixtral.from_hf_expert(name)
    return expert[0] if expert else _rename(name, _FROM_HF)


def hf_tensors(name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """A full trainer3d weight as the Hugging Face tensor(s) that store it."""
    experts = mixtral.expert_names(name, tensor.shape[0])
    if experts is None:
        return {to_hf(name): tensor}
    return dict(zip(experts, mixtral.split_experts(tensor)))


def hf_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``cfg`` needs, with its shape (the 1-rank
    model built on the meta device: the shapes come from the model code itself)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {hf: tuple(t.shape) for n, p in model.named_parameters() for hf, t in hf_tensors(n, p).items()}


# ----------------------------------------------------------------------------- config.json -> ModelConfig

POSITIVE = ("dim", "ffn_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")
"""Sizes a model cannot have zero of (zero heads would divide by zero deriving head_dim)."""


def _typed(field: str, key: str, value: Any, problems: List[str]) -> Any:
    want = _TYPES.get(field, int)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = isinstance(value, bool) if want is bool else (
        number and value >= 0 and (want is float or float(value).is_integer()))
    if not ok:
        problems.append(f"config.json: {key}={value!r} is not a valid {want.__name__}")
        return None
    if field in POSITIVE and value < 1:
        problems.append(f"config.json: {key}={value!r} must be a positive integer")
        return None
    return want(value)


def _rope_fields(config: dict, problems: List[str]) -> Dict[str, Any]:
    """rope_theta and rope_scaling from either spelling (rope_scaling wins, as in transformers)."""
    block = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(block, dict):
        problems.append(f"config.json: rope_scaling={block!r} is not an object")
        return {}
    kind = block.get("rope_type", block.get("type", "default"))
    theta = block.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    out: Dict[str, Any] = {"rope_theta": _typed("rope_theta", "rope_theta", theta, problems)}
    if kind == "default":
        return out
    if kind != "llama3":
        problems.append(f"config.json: rope_scaling.rope_type={kind!r} is not supported (llama3 or none)")
        return out
    scaling = {}
    for field, key in ROPE_SCALING:
        value = block.get(key, config.get("max_position_embeddings") if key.startswith("original") else None)
        if value is None:
            problems.append(f"config.json: rope_scaling.{key} is missing")
            continue
        scaling[field] = _typed(field, f"rope_scaling.{key}", value, problems)
    out["rope_scaling"] = RopeScalingConfig(type="llama3", **scaling)
    return out


def unsupported(config: dict) -> List[str]:
    """config.json settings this model does not implement, one line each."""
    problems = []
    fixed = ARCHITECTURES["mixtral" if mixtral.is_mixtral(config) else "llama"]
    architecture = {k: config.get(k) for k in ("architectures", "model_type") if config.get(k) is not None}
    if any(value != fixed[k] for k, value in architecture.items()):
        said = ", ".join(f"{k}={v!r}" for k, v in architecture.items())
        return [f"config.json: {said} is not a LlamaForCausalLM (model_type 'llama') or MixtralForCausalLM "
                "(model_type 'mixtral') checkpoint"]
    for key, want in fixed.items():
        if key not in architecture and config.get(key) is not None and config[key] != want:
            problems.append(f"config.json: {key}={config[key]!r} is not supported ({fixed['model_type']} has {want!r})")
    factor = config.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        problems.append(f"config.json: partial_rotary_factor={factor!r} is not supported (rotary on the whole head)")
    if config.get("quantization_config") is not None:
        problems.append("config.json: quantization_config is set; only unquantised weights can be trained")
    return problems


def model_fields(config: dict) -> Tuple[Dict[str, Any], List[str]]:
    """(ModelConfig fields derived from ``config``, problems): the model section of a run."""
    problems = unsupported(config)
    fields: Dict[str, Any] = {}
    for field, key, default in CONFIG:
        if key in config and config[key] is not None:
            value = config[key]
        elif default is REQUIRED:
            problems.append(f"config.json: {key} is missing")
            continue
        elif isinstance(default, str):
            value = config.get(default)
        else:
            value = default
        fields[field] = None if value is None else _typed(field, key, value, problems)
    eos = config.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    fields["eos_token_ids"] = [_typed("eos_token_ids", "eos_token_id", e, problems) for e in eos]
    if fields.get("head_dim") is None and not problems:
        fields["head_dim"] = fields["dim"] // fields["n_heads"] if fields["n_heads"] else None
    fields.update(_rope_fields(config, problems))
    # model.moe's fields, as a dict: with_fields keeps the knobs config.json does not set
    fields["moe"] = mixtral.moe_fields(config, _typed, problems) if mixtral.is_mixtral(config) else {"num_experts": 0}
    return fields, problems


def with_fields(base: ModelConfig, fields: Dict[str, Any], **extra) -> ModelConfig:
    """``base`` with ``model_fields``' fields (model.moe's merged into base's model.moe)."""
    fields = dict(fields)
    moe = dataclasses.replace(base.moe, **fields.pop("moe", {}))
    return dataclasses.replace(base, **fields, moe=moe, **extra)


def model_config(config: dict, base: Optional[ModelConfig] = None, **extra) -> ModelConfig:
    """A ModelConfig from config.json (on top of ``base``'s other fields); ValueError with
    every problem, one per line."""
    fields, problems = model_fields(config)
    if problems:
        raise ValueError("\n".join(problems))
    return with_fields(base or ModelConfig(), fields, **extra)


# ----------------------------------------------------------------------------- ModelConfig -> config.json

def hf_config(cfg: ModelConfig, dtype: str) -> Dict[str, Any]:
    """config.json for ``cfg`` (``dtype``: "float32" | "bfloat16" | "float16"): a Llama's, or a
    Mixtral's for a mixture of experts (which must be one Mixtral can say: ValueError)."""
    out: Dict[str, Any] = dict(FIXED)
    if cfg.moe.num_experts:
        problems = mixtral.mixtral_problems(cfg)
        if problems:
            raise ValueError("a Hugging Face Mixtral cannot hold " + "; ".join(problems))
        del out["attention_bias"], out["mlp_bias"]
        out.update(mixtral.hf_moe_config(cfg.moe))
    for field, key, _ in CONFIG:
        out[key] = head_dim_of(cfg) if field == "head_dim" else getattr(cfg, field)
    ids = list(cfg.eos_token_ids)
    out["eos_token_id"] = (ids[0] if len(ids) == 1 else ids) if ids else None
    out["rope_theta"] = cfg.rope_theta
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out["rope_scaling"] = None
    if cfg.rope_scaling.type == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3",
                               **{key: getattr(cfg.rope_scaling, field) for field, key in ROPE_SCALING}}
        rope.update(out["rope_scaling"])
    out["rope_parameters"] = rope
    out["initializer_range"] = cfg.init_std
    out["torch_dtype"] = out["dtype"] = dtype
    return out
