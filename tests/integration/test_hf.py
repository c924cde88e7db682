"""Hugging Face Llama in and out, with transformers as the independent reference model.

Every model here is a tiny random Llama made locally by transformers itself
(``LlamaConfig(...)``, ``LlamaForCausalLM(config).save_pretrained``): no hub downloads.

- logits: trainer3d's model filled from a transformers checkpoint gives transformers'
  logits (GQA and MHA, tied and untied, Llama-3 rope scaling, a head_dim other than
  dim / heads), which pins RMSNorm, RoPE, GQA and SwiGLU against an outside implementation;
- the entry point's work on in-process ranks (tests/support/runs.py), ``model.init_from`` in
  1x1x1 and tp2 x pp2 x dp2 ZeRO-1 (tied, a vocabulary tp pads, rope scaling): the first step's
  loss and gradients equal transformers' on the same batch, the 3D run trains the model the
  single process trains (20 steps, fp32, rel 1e-5), its export loads in transformers without
  warnings and gives trainer3d's logits, and importing the export again gives bit-identical
  weights;
- bad input is refused before launch, one line each.
"""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # a dev dependency: missing, these tests fail rather than skip

from tests.support.run_scripts import run as run_script
from tests.support.runs import REL_TOL, read_metrics, run_train, train_in_ranks
from trainer3d.checkpoint import store
from trainer3d.checkpoint.export import export, load_full_model
from trainer3d.config.schema import Config
from trainer3d.hf.files import read_json
from trainer3d.hf.mapping import from_hf, model_config
from trainer3d.hf.source import HFSource
from trainer3d.model.init import fill_parameters
from trainer3d.model.transformer import Transformer

# Its tests share a module fixture: one xdist worker runs them all (tests/conftest.py: xdist_scope).

ROOT = Path(__file__).resolve().parents[2]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=301, max_position_embeddings=256, rope_theta=10000.0)


def make_hf(directory: Path, seed: int = 0, max_shard_size=None, **overrides) -> Path:
    """A random tiny Llama saved by transformers (fp32)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**BASE, **overrides})
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    transformers.LlamaForCausalLM(config).save_pretrained(directory, **kwargs)
    return directory


def trainer3d_model(directory: Path) -> Transformer:
    cfg = model_config(read_json(directory / "config.json"))
    model = Transformer(cfg)
    fill_parameters(model, HFSource(directory, cfg))
    return model


def hf_model(directory: Path):
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- the model vs transformers

@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gqa-untied"),
    pytest.param({"num_key_value_heads": 4, "tie_word_embeddings": True}, id="mha-tied"),
    pytest.param({"rope_scaling": LLAMA3, "head_dim": 24, "rope_theta": 500000.0}, id="gqa-llama3-headdim24"),
])
def test_logits_equal_transformers(tmp_path, overrides):
    directory = make_hf(tmp_path / "hf", **overrides)
    ours, theirs = trainer3d_model(directory), hf_model(directory)
    tokens = torch.randint(0, BASE["vocab_size"], (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"max |logits - transformers'| = {diff:.1e}")
    assert diff <= 1e-5


def test_llama3_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer3d.model.transformer import rotary_cos_sin

    config = transformers.LlamaConfig(**{**BASE, "rope_scaling": LLAMA3, "rope_theta": 500000.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    cfg = model_config(config.to_dict())
    positions = torch.arange(200, dtype=torch.float32)
    expected = torch.outer(positions, inv_freq)
    cos, _ = rotary_cos_sin(200, 16, cfg.rope_theta, torch.device("cpu"), cfg.rope_scaling)
    unscaled, _ = rotary_cos_sin(200, 16, cfg.rope_theta, torch.device("cpu"))
    torch.testing.assert_close(cos[:, :8], expected.cos(), rtol=0, atol=1e-6)
    assert not torch.allclose(unscaled, cos, atol=1e-3), "the scaling must change the long wavelengths"


# ----------------------------------------------------------------------------- through the entry point

COMMON = ("train.max_steps=20", "train.log_every=1", "train.seq_len=64", "train.micro_batch_size=2",
          "train.global_batch_size=8", "train.grad_accum_steps=null", "optim.warmup_steps=5",
          "parallel.timeout_s=120")
# beta1=0 leaves the step's gradient in exp_avg, no clipping keeps it raw: the checkpoint of a
# one-step run holds the first step's gradient, as the engine computed it. (A one-step run of
# its own costs less than a save after every step of the 20-step run.)
FIRST_STEP = ("train.max_steps=1", "optim.beta1=0.0", "optim.grad_clip=0")
LAYOUTS = {"1x1x1": ("parallel=single",),
           # reduce_scatter: each rank's gradient is valid only where it owns it (NCCL's default;
           # gloo defaults to all_reduce), the harder case for summing the tied copies.
           "tp2-pp2-dp2-z1": ("parallel=tp2-pp2-dp2", "parallel.zero_stage=1", "parallel.zero_reduce=reduce_scatter")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tied GQA Llama with rope scaling and a vocabulary tp=2 pads (301), trained 20 steps
    from model.init_from in one process and in tp2 x pp2 x dp2 with ZeRO-1 (in-process ranks:
    tests/support/runs.py train_in_ranks), and one step of each with its gradient kept. Two
    layers, one per pipeline stage (as tests/support/runs.py TWO_LAYERS): the tied embedding's
    two copies still sit on the first and the last stage."""
    root = tmp_path_factory.mktemp("hf-runs")
    out = {"hf": make_hf(root / "hf", tie_word_embeddings=True, rope_scaling=LLAMA3)}
    for name, layout in LAYOUTS.items():
        out[name], out[f"{name}-first"] = root / name, root / f"{name}-first"
        train_in_ranks(out[name], [*COMMON, f"model.init_from={out['hf']}", *layout])
        train_in_ranks(out[f"{name}-first"], [*COMMON, *FIRST_STEP, f"model.init_from={out['hf']}", *layout])
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_step_loss_and_gradients_equal_transformers(runs, layout):
    from trainer3d.data.loader import build_readers
    from trainer3d.config.validate import validate
    from tests.unit.test_validate import make

    data, _ = build_readers(validate(make([*COMMON, "parallel=single"])), dp=1, dp_rank=0)
    inputs, targets = (t.flatten(0, 1) for t in data.batch(0))  # the step's global batch: 8 sequences
    model = hf_model(runs["hf"])
    loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    expected = {from_hf(n): p.grad for n, p in model.named_parameters()}
    got_loss = read_metrics(runs[layout])[0]["loss"]
    assert read_metrics(runs[f"{layout}-first"])[0]["loss"] == got_loss, "the one-step run is the run's first step"
    grads = load_full_model(store.step_dir(runs[f"{layout}-first"] / "checkpoints", 1), prefix="optim.exp_avg.")
    assert set(grads) == set(expected), "one gradient per parameter; the tied embedding once"
    worst = max(_rel(grads[n], expected[n]) for n in expected)
    print(f"{layout}: loss rel diff {abs(got_loss - loss.item()) / loss.item():.1e}, worst gradient rel diff {worst:.1e}")
    assert abs(got_loss - loss.item()) / loss.item() <= REL_TOL
    assert worst <= REL_TOL


@pytest.mark.slow
def test_tied_3d_run_matches_single_process(runs):
    single = [r["loss"] for r in read_metrics(runs["1x1x1"])]
    grid = [r["loss"] for r in read_metrics(runs["tp2-pp2-dp2-z1"])]
    assert len(single) == len(grid) == 20 and single[-1] < single[0]
    worst = max(abs(a - b) / b for a, b in zip(grid, single))
    print(f"tied tp2-pp2-dp2 ZeRO-1 vs one process: worst relative loss difference {worst:.1e}")
    assert worst <= REL_TOL
    keys = store.read_metadata(store.step_dir(runs["tp2-pp2-dp2-z1"] / "checkpoints", 20)).state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys


@pytest.mark.slow
def test_export_loads_in_transformers_and_reimports_bit_identical(runs, tmp_path, caplog):
    checkpoint = store.step_dir(runs["tp2-pp2-dp2-z1"] / "checkpoints", 20)
    out = tmp_path / "export"
    prompt = "def main("
    # tools/export_model.py, then tools/sample.py (greedy, from the export and from the checkpoint),
    # each as ``python SCRIPT`` runs it, in this process (tests/support/run_scripts.py)
    sample = ["--prompt", prompt, "--greedy", "--max-new-tokens", "8", "--show-ids"]
    exported, *sampled = [run_script(str(ROOT / script), [str(a) for a in args]) for script, args in (
        ("tools/export_model.py", [checkpoint, out, "--max-shard-gb", "0.0002"]),
        ("tools/sample.py", [out, *sample]), ("tools/sample.py", [checkpoint, *sample]))]
    assert exported["code"] == 0, exported["stderr"]
    assert (out / "model.safetensors.index.json").exists() and (out / "generation_config.json").exists()
    with caplog.at_level(logging.WARNING, logger="transformers"):
        theirs, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert not [r for r in caplog.records if r.name.startswith("transformers")], caplog.text
    trained = load_full_model(checkpoint)
    ours = Transformer(model_config(read_json(out / "config.json")))
    fill_parameters(ours, lambda name, shape, shard: trained[name])
    tokens = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours(tokens) - theirs.eval()(tokens).logits).abs().max().item()
    print(f"exported model: max |logits - transformers'| = {diff:.1e}")
    assert diff <= 1e-5
    again = trainer3d_model(out)
    for name, p in again.named_parameters():
        assert torch.equal(p, trained[name]), name
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # carried from model.init_from's config
    # tools/sample.py's greedy ids, from the export and from the checkpoint: transformers' greedy ids.
    expected = theirs.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=8, do_sample=False)
    expected = expected[0, len(prompt):].tolist()
    for done in sampled:
        assert done["code"] == 0, done["stderr"]
        assert done["stdout"].startswith(prompt) and done["stdout"].splitlines()[-1] == " ".join(map(str, expected))


@pytest.mark.slow
def test_bf16_export_writes_bf16_weights_and_config(runs, tmp_path):
    out = tmp_path / "bf16"
    export(store.step_dir(runs["1x1x1"] / "checkpoints", 20), out, dtype="bf16")
    config = read_json(out / "config.json")
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ----------------------------------------------------------------------------- refused before launch

def _refusal(cfg: Config, monkeypatch, capsys, explicit=()) -> str:
    """Run the entry point's checks; nothing may launch. Returns its one error line."""
    import trainer3d.train
    from trainer3d.train import run

    monkeypatch.setattr(trainer3d.train, "launch", lambda cfg: pytest.fail("launched"))
    capsys.readouterr()
    assert run(cfg, explicit) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    print(lines[0])
    return lines[0]


def _cfg(directory: Path) -> Config:
    cfg = Config()
    cfg.run_dir = "unused"
    cfg.model.init_from = str(directory)
    return cfg


def _other_architecture(d: Path):
    config = json.loads((d / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (d / "config.json").write_text(json.dumps(config))


def _missing_shard(d: Path):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[-1]).unlink()


def _shape_mismatch(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(config))


def _outside_index(d: Path):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../model.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _huge_header(d: Path):
    shard = sorted(d.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = (2 ** 40).to_bytes(8, "little")
    shard.write_bytes(bytes(data))


def _truncated_shard(d: Path):
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])


@pytest.mark.parametrize("spoil,expect", [
    (_other_architecture, "model_type='mistral' is not a LlamaForCausalLM"),
    (_missing_shard, "(listed in model.safetensors.index.json) is missing"),
    (_shape_mismatch, "config.json implies"),
    (_outside_index, "shard files must be plain names inside the directory"),
    (_huge_header, "header length"),
    (_truncated_shard, "points outside the file (truncated?)"),
])
def test_bad_hf_directory_is_refused_before_launch(tmp_path, monkeypatch, capsys, spoil, expect):
    directory = make_hf(tmp_path / "hf", max_shard_size="20KB")
    spoil(directory)
    line = _refusal(_cfg(directory), monkeypatch, capsys)
    assert expect in line and "model.init_from" in line


@pytest.mark.parametrize("text,expect", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "does not hold a JSON object"),
    ('{"hidden_size": Infinity}', "hidden_size=inf is not a valid int"),
    ('{"num_hidden_layers": true}', "num_hidden_layers=True is not a valid int"),
    ('{"rope_scaling": {"rope_type": "yarn", "factor": 4}}', "rope_scaling.rope_type='yarn' is not supported"),
    ('{"attention_bias": true}', "attention_bias=True is not supported"),
])
def test_malformed_config_json_is_refused_naming_the_field(tmp_path, monkeypatch, capsys, text, expect):
    """A broken file, or a Llama config.json with one field changed (Infinity is valid to Python's json)."""
    directory = make_hf(tmp_path / "hf")
    try:
        change = json.loads(text)
    except ValueError:
        change = None
    if isinstance(change, dict):
        text = json.dumps({**json.loads((directory / "config.json").read_text()), **change})
    (directory / "config.json").write_text(text)
    assert expect in _refusal(_cfg(directory), monkeypatch, capsys)


def test_vocabulary_smaller_than_the_data_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    directory = make_hf(tmp_path / "hf", vocab_size=200)  # the built-in corpus has 257 byte-level ids
    line = _refusal(_cfg(directory), monkeypatch, capsys)
    assert "vocabulary 257 > model.vocab_size=200" in line


def test_override_that_disagrees_with_config_json_is_refused(tmp_path, monkeypatch, capsys):
    directory = make_hf(tmp_path / "hf")
    cfg = _cfg(directory)
    cfg.model.dim = 256
    line = _refusal(cfg, monkeypatch, capsys, explicit=["dim", "init_from"])
    assert line.endswith(f"model.dim=256 conflicts with hidden_size=64 in {directory}/config.json; "
                         "drop the override (model.init_from sets it)")


def test_command_line_override_that_disagrees_is_refused_by_the_entry_point(tmp_path):
    directory = make_hf(tmp_path / "hf")
    proc = run_train(tmp_path / "run", [f"model.init_from={directory}", "model.n_heads=8"], expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"trainer3d: config error: model.n_heads=8 conflicts with num_attention_heads=4 in {directory}/config.json; "
        "drop the override (model.init_from sets it)"]
    assert not (tmp_path / "run" / "submitit").exists()


def test_model_section_is_derived_from_config_json(tmp_path):
    from trainer3d.hf.check import apply_init_from

    directory = make_hf(tmp_path / "Tiny-Llama", tie_word_embeddings=True, rope_scaling=LLAMA3, head_dim=8)
    cfg = _cfg(directory)
    cfg.model.dim = 64  # agrees with hidden_size: allowed
    m = apply_init_from(cfg, explicit=["dim"]).model
    assert (m.name, m.dim, m.ffn_dim, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size) == \
        ("Tiny-Llama", 64, 128, 2, 4, 2, 8, 301)
    assert m.tie_embeddings and m.rope_scaling.type == "llama3" and m.rope_scaling.original_max_seq_len == 32
    assert (m.bos_token_id, m.eos_token_ids, m.norm_eps) == (1, [2], 1e-6)
    shutil.rmtree(directory)
    with pytest.raises(Exception, match="not a directory"):
        apply_init_from(cfg)


def test_config_round_trip_through_transformers(tmp_path):
    """config.json written for a model, read by transformers, read back: the same model."""
    from trainer3d.hf.mapping import hf_config

    cfg = model_config(transformers.LlamaConfig(**{**BASE, "rope_scaling": LLAMA3, "head_dim": 8,
                                                   "tie_word_embeddings": True}).to_dict())
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, "float32")))
    again = model_config(transformers.LlamaConfig.from_pretrained(tmp_path).to_dict())
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
