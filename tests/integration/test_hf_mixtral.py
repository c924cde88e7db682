"""Hugging Face Mixtral in and out, with transformers as the independent reference model.

Every model is a tiny random ``MixtralForCausalLM`` made locally by transformers
(``MixtralConfig(...)``, ``save_pretrained``; no hub): trainer3d's model filled from it gives
transformers' logits (router, experts and their transposed layout pinned against an outside
implementation); the export of those weights is, tensor by tensor, the file transformers wrote
and loads in transformers without warnings; ``model.init_from`` derives ``model.moe`` from
config.json, reads a tensor-parallel block of the experts, and refuses a sliding window shorter
than the sequence, naming the field.
"""

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: missing, these tests fail rather than skip
from safetensors import safe_open

from tests.unit.test_presets import _training
from trainer3d.config.validate import ConfigError, validate
from trainer3d.hf.check import apply_init_from
from trainer3d.hf.export import write_hf
from trainer3d.hf.files import read_json
from trainer3d.hf.mapping import model_config
from trainer3d.hf.source import HFSource
from trainer3d.model.init import TPShard, fill_parameters
from trainer3d.model.transformer import Transformer

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=301, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
            router_aux_loss_coef=0.02)


def make_hf(directory: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(**{**BASE, **overrides})
    transformers.MixtralForCausalLM(config).save_pretrained(directory)
    return directory


def trainer3d_model(directory: Path) -> Transformer:
    cfg = model_config(read_json(directory / "config.json"))
    model = Transformer(cfg)
    fill_parameters(model, HFSource(directory, cfg))
    return model


def _tensors(directory: Path):
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("overrides", [pytest.param({}, id="e4-top2"),
                                       pytest.param({"num_local_experts": 8, "num_experts_per_tok": 1}, id="e8-top1")])
def test_logits_equal_transformers(tmp_path, overrides):
    directory = make_hf(tmp_path / "hf", **overrides)
    ours = trainer3d_model(directory)
    theirs = transformers.MixtralForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = torch.randint(0, BASE["vocab_size"], (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = theirs(tokens).logits
        diff = (ours(tokens) - logits).abs().max().item()
        # the comparison can fail: one expert's w1 taken untransposed (a square block of it
        # swapped for its transpose) moves the logits far past the tolerance
        w1 = ours.layers["0"].feed_forward.experts.w1
        w1[1, :64, :64] = w1[1, :64, :64].t().clone()
        wrong = (ours(tokens) - logits).abs().max().item()
    print(f"max |logits - transformers'| = {diff:.1e} (a transposed expert block: {wrong:.1e})")
    assert diff <= 1e-5 and wrong > 1e-3


def test_export_is_the_file_transformers_wrote_and_loads_without_warnings(tmp_path, caplog):
    directory = make_hf(tmp_path / "hf")
    model = trainer3d_model(directory)
    cfg = model_config(read_json(directory / "config.json"))
    out = tmp_path / "export"
    write_hf({n: p.detach() for n, p in model.named_parameters()}, cfg, out, torch.float32, 1 << 30)
    original, exported = _tensors(directory), _tensors(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert config["router_aux_loss_coef"] == pytest.approx(0.02)
    with caplog.at_level(logging.WARNING, logger="transformers"):
        theirs, info = transformers.MixtralForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert not [r for r in caplog.records if r.name.startswith("transformers")], caplog.text
    again = trainer3d_model(out)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def test_a_tensor_parallel_block_of_the_experts_is_read_from_the_per_expert_tensors(tmp_path):
    directory = make_hf(tmp_path / "hf")
    cfg = model_config(read_json(directory / "config.json"))
    source = HFSource(directory, cfg)
    full = source("layers.1.feed_forward.experts.w2", (4, 96, 64), None)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:  # expert 3's down projection, by hand
        torch.testing.assert_close(full[3], f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight").t(),
                                   rtol=0, atol=0)
    block = source("layers.1.feed_forward.experts.w2", (4, 96, 64), TPShard(dim=1, rank=1, size=2, full=96))
    assert torch.equal(block, full[:, 48:])


def test_init_from_derives_model_moe_and_validates(tmp_path):
    directory = make_hf(tmp_path / "hf")
    base = _training([f"model.init_from={directory}", "parallel=single", "train.seq_len=64"])
    cfg = validate(apply_init_from(base))
    moe = cfg.model.moe
    assert (moe.num_experts, moe.top_k, moe.router, cfg.model.ffn_dim) == (4, 2, "softmax_topk", 96)
    assert moe.aux_loss_coef == pytest.approx(2 * 0.02)  # transformers' loss is top_k times trainer3d's
    kept = apply_init_from(base, ["moe.aux_loss_coef"])  # a training knob the command line may set
    assert kept.model.moe.aux_loss_coef == base.model.moe.aux_loss_coef


def test_sliding_window_shorter_than_the_sequence_is_refused_naming_it(tmp_path):
    directory = make_hf(tmp_path / "hf", sliding_window=32)
    with pytest.raises(ConfigError) as err:
        apply_init_from(_training([f"model.init_from={directory}", "parallel=single", "train.seq_len=64"]))
    assert "sliding_window=32" in str(err.value) and "train.seq_len<=32" in str(err.value)
    cfg = apply_init_from(_training([f"model.init_from={directory}", "parallel=single", "train.seq_len=32"]))
    assert cfg.model.moe.num_experts == 4  # a window as long as the sequence is full causal attention


def test_an_experts_override_that_disagrees_with_config_json_is_refused(tmp_path):
    directory = make_hf(tmp_path / "hf")
    base = _training([f"model.init_from={directory}", "parallel=single", "model.moe.num_experts=8"])
    with pytest.raises(ConfigError, match="num_local_experts=4"):
        apply_init_from(base, ["moe.num_experts"])
