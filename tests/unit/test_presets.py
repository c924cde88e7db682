"""conf/model/ presets of published models and conf/experiment/ recipes.

A preset is its published model: its fields are what trainer3d's Hugging Face import
(trainer3d/hf/mapping.py) derives from the model's config.json, transcribed below from the
hub, and the model built from it on the meta device has the published parameter count. A
recipe composes, validates, dry-runs, fits in memory by the planner's accounting and holds the
layout the planner ranks first for its cluster.
"""

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, ROOT
from trainer3d import train
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.validate import validate
from trainer3d.hf.mapping import model_fields
from trainer3d.memory.dry_run import describe_plan
from trainer3d.model.transformer import Transformer, count_parameters
from trainer3d.plan.devices import device_for
from trainer3d.plan.search import backend_of, evaluate, layout_overrides, search

HUB = "https://huggingface.co/{}/blob/main/config.json"
LLAMA3_ROPE = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def _config_json(hidden, layers, heads, kv_heads, ffn, vocab, positions, bos, eos, **rest):
    """The architecture fields of a published config.json (the keys transformers' LlamaConfig reads)."""
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": ffn, "vocab_size": vocab,
            "max_position_embeddings": positions, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
            "bos_token_id": bos, "eos_token_id": eos, **rest}


# preset: (hub repository, its config.json's architecture fields, its published parameter count)
#
# The counts are the hub's ``safetensors.total`` (https://huggingface.co/api/models/<repository>,
# the sum of the tensors stored in the model's safetensors files). The Llama-2 checkpoints also
# store each layer's rotary ``inv_freq`` buffer (head_dim / 2 = 64 floats, no parameter:
# trainer3d/hf/mapping.py IGNORED), so their parameters are the total less n_layers * 64.
PUBLISHED = {
    "llama2-7b": ("meta-llama/Llama-2-7b-hf", _config_json(4096, 32, 32, 32, 11008, 32000, 4096, 1, 2),
                  6_738_417_664 - 32 * 64),
    "llama2-13b": ("meta-llama/Llama-2-13b-hf", _config_json(5120, 40, 40, 40, 13824, 32000, 4096, 1, 2),
                   13_015_866_880 - 40 * 64),
    "llama2-70b": ("meta-llama/Llama-2-70b-hf", _config_json(8192, 80, 64, 8, 28672, 32000, 4096, 1, 2),
                   68_976_653_312 - 80 * 64),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B",
                    _config_json(4096, 32, 32, 8, 14336, 128256, 131072, 128000, 128001, **LLAMA3_ROPE),
                    8_030_261_248),
    "llama3.1-70b": ("meta-llama/Llama-3.1-70B",
                     _config_json(8192, 80, 64, 8, 28672, 128256, 131072, 128000, 128001, **LLAMA3_ROPE),
                     70_553_706_496),
    "llama3.1-405b": ("meta-llama/Llama-3.1-405B",
                      _config_json(16384, 126, 128, 8, 53248, 128256, 131072, 128000, 128001, **LLAMA3_ROPE),
                      405_853_388_800),
    # MistralForCausalLM (model_type "mistral", sliding_window null): the same block.
    "mistral-7b-v0.3": ("mistralai/Mistral-7B-v0.3",
                        _config_json(4096, 32, 32, 8, 14336, 32768, 32768, 1, 2, rope_theta=1000000.0),
                        7_248_023_552),
    # MixtralForCausalLM: the Llama block with 8 experts, top-2 (tests/unit/test_presets_moe.py
    # checks its 46.7B total and 12.9B active parameters by a hand count)
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1",
                     _config_json(4096, 32, 32, 8, 14336, 32000, 32768, 1, 2, rope_theta=1000000.0,
                                  architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8,
                                  num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=False,
                                  sliding_window=None),
                     46_702_792_704),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M",
                     _config_json(576, 30, 9, 3, 1536, 49152, 8192, 0, 0, rope_theta=100000,
                                  tie_word_embeddings=True),
                     134_515_008),
    "smollm2-360m": ("HuggingFaceTB/SmolLM2-360M",
                     _config_json(960, 32, 15, 5, 2560, 49152, 8192, 0, 0, rope_theta=100000,
                                  tie_word_embeddings=True),
                     361_821_120),
    "smollm2-1.7b": ("HuggingFaceTB/SmolLM2-1.7B",
                     _config_json(2048, 24, 32, 32, 8192, 49152, 8192, 0, 0, rope_theta=130000,
                                  tie_word_embeddings=True),
                     1_711_376_384),
}

# recipe: the cluster it is planned for (plan.yaml's cluster.*) and the overrides it needs to compose
RECIPES = {
    "llama3.1-8b-8gpu": (["cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=h100-sxm"],
                         ["data.path=/data/web.bin"]),
    "llama3.1-70b-64gpu": (["cluster.nodes=8", "cluster.gpus_per_node=8", "cluster.gpu=h100-sxm"],
                           ["data.path=/data/web.bin"]),
    "smollm2-135m-laptop": (["cluster.nodes=1", "cluster.gpus_per_node=2", "cluster.gpu=cpu"], []),
    "sft-smollm2-135m-laptop": (["cluster.nodes=1", "cluster.gpus_per_node=2", "cluster.gpu=cpu"], []),
}


def _compose(name, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name=name, overrides=list(overrides)))


def _training(overrides):
    return _compose("config", [*overrides, "run_dir=/tmp/unused", "launcher.folder=/tmp/unused"])


def _plan(recipe):
    """plan.yaml composed with the recipe and the cluster it is planned for."""
    cluster, needs = RECIPES[recipe]
    return _compose("plan", [f"experiment={recipe}", *needs, *cluster])


def test_every_preset_and_recipe_is_tested():
    cited = {p.stem for p in (CONF_DIR / "model").glob("*.yaml") if "huggingface.co" in p.read_text()}
    assert cited == set(PUBLISHED)
    assert {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")} == set(RECIPES)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_preset_is_its_published_config_json(preset):
    repository, config_json, _ = PUBLISHED[preset]
    cfg = validate(_training([f"model={preset}", "parallel=single"]))
    fields, problems = model_fields(config_json)
    assert problems == []
    moe = fields.pop("moe")  # the model.moe fields config.json sets
    differ = {k: (getattr(cfg.model, k), v) for k, v in fields.items() if getattr(cfg.model, k) != v}
    differ.update({f"moe.{k}": (getattr(cfg.model.moe, k), v) for k, v in moe.items() if getattr(cfg.model.moe, k) != v})
    assert differ == {}, f"conf/model/{preset}.yaml (yaml, config.json) differ from {HUB.format(repository)}"
    assert cfg.model.name == preset
    assert HUB.format(repository) in (CONF_DIR / "model" / f"{preset}.yaml").read_text()  # the source is cited


@pytest.mark.parametrize("preset", PUBLISHED)
def test_preset_built_on_meta_has_the_published_parameter_count(preset):
    cfg = _training([f"model={preset}"]).model
    with torch.device("meta"):
        model = Transformer(cfg)
    built = sum(p.numel() for p in model.parameters())  # a tied embedding is one Parameter, listed once
    assert built == PUBLISHED[preset][2]
    assert count_parameters(cfg) == built  # the formula the dry run and the planner use


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_fits_and_dry_runs(recipe):
    cfg = validate(_training([f"experiment={recipe}", *RECIPES[recipe][1]]))
    p, cluster = cfg.parallel, _plan(recipe).cluster
    plan = describe_plan(cfg)
    assert f"layout: tp={p.tp} x pp={p.pp} x dp={p.dp} = {p.tp * p.pp * p.dp} ranks" in plan
    assert f"model: {cfg.model.name}," in plan
    assert cfg.launcher.nodes == cluster.nodes and p.tp * p.pp * p.dp == cluster.nodes * cluster.gpus_per_node
    device = device_for(cluster.gpu)
    peak = evaluate(cfg, device, cluster.gpus_per_node, backend_of(_plan(recipe), device)).memory.total
    assert peak <= device.usable_bytes(cluster.gpus_per_node), f"{recipe}: {peak / 2 ** 30:.1f} GiB per rank"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_holds_the_planners_first_choice(recipe):
    cluster, needs = RECIPES[recipe]
    plan_cfg = _plan(recipe)
    best = search(plan_cfg, device_for(plan_cfg.cluster.gpu)).plans[0].cfg
    recipe_cfg = validate(_training([f"experiment={recipe}", *needs]))
    assert layout_overrides(recipe_cfg) == layout_overrides(best), (
        f"the planner ranks another layout first; update conf/experiment/{recipe}.yaml from "
        f"python -m trainer3d.plan experiment={recipe} {' '.join(needs + cluster)}")


def test_a_recipe_is_one_command(tmp_path, capsys):
    """``python -m trainer3d.train experiment=llama3.1-70b-64gpu data.path=/data/web.bin dry_run=true``:
    the entry point's ``run`` in this process on the config Hydra composes for that command line
    (a dry run launches nothing; the entry point itself runs a dry run as users type it in
    tests/unit/test_defaults_used.py and tests/tools/test_doc_commands_run.py)."""
    cfg = _compose("config", ["experiment=llama3.1-70b-64gpu", "data.path=/data/web.bin", "dry_run=true",
                              f"run_dir={tmp_path}", f"launcher.folder={tmp_path / 'submitit'}"])
    assert train.run(cfg) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "submitit").exists(), "a dry run launches nothing"
    par = OmegaConf.load(ROOT / "conf" / "experiment" / "llama3.1-70b-64gpu.yaml").parallel
    assert f"layout: tp={par.tp} x pp={par.pp} x dp={par.dp} = 64 ranks, zero_stage={par.zero_stage}" in out
    assert "model: llama3.1-70b, 70,553,706,496 parameters" in out
