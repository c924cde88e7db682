"""An export is a standard Hugging Face directory: transformers' Auto classes load and generate.

A tiny model trains on data made with a BPE trained locally (tools/prepare_data.py
--train-tokenizer, saved as ``<out>.tokenizer.json``), and another on the built-in
byte-level corpus; tools/export_model.py writes each under umask 022. transformers (the
independent reader) must then load the tokenizer with ``AutoTokenizer`` (special tokens
from the run's ids), the model with ``AutoModelForCausalLM``, and generate; tools/sample.py
must give transformers' greedy ids, and refuse in one line a model whose vocabulary the
tokenizer it would use does not fit. The data's preparation, the exports and the samples run as
``python tools/X.py`` runs them, to their end in this process (tests/support/run_scripts.py ``run``), which has torch,
transformers and the engine imported already: what is under test is the files they write and
read, not a tool's start.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: missing, these tests fail rather than skip

from tests.support import run_scripts
from tests.support.runs import train_in_ranks
from trainer3d.checkpoint import store
from trainer3d.data import EOF_TOKEN, read_header
from trainer3d.hf.files import read_json

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
TRAIN = (f"train.max_steps={STEPS}", "train.log_every=10", "train.seq_len=64", "train.micro_batch_size=4",
         "train.global_batch_size=8", "train.grad_accum_steps=null", "optim.warmup_steps=2", "optim.lr=3e-3",
         "model.dim=64", "model.n_layers=2", "model.ffn_dim=128", "model.max_seq_len=64",
         f"checkpoint.every={STEPS}", "parallel=single")
PROMPT = "def split(self, text):\n    "
# ASCII text (every BPE token decodes to whole characters): a handful of Python modules.
SOURCES = ["json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "shlex.py"]


def tools_in_this_process(entries, umask=None) -> list:
    """Each (script, args) run to its end as ``python SCRIPT ARGS`` runs it from the checkout's
    root, in this process, under ``umask`` where given (this process's own restored after), as
    tests/tools/test_parity_tool.py runs its tool; one {"code", "stdout", "stderr"} per entry."""
    results = []
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        before = os.umask(umask) if umask is not None else None
        try:
            for script, args in entries:
                results.append(run_scripts.run(script, [str(a) for a in args]))
        finally:
            if before is not None:
                os.umask(before)
    return results


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"bpe": export dir, "bytes": export dir, "data": the BPE token file, "bare": the BPE export
    without its tokenizer, "sampled": tools/sample.py's results, by sample_commands' names}."""
    root = tmp_path_factory.mktemp("export-standard")
    texts = root / "texts"
    texts.mkdir()
    stdlib = Path(os.__file__).parent
    for name in SOURCES:
        text = (stdlib / name).read_text()
        (texts / name.replace("/", "_")).write_text(text.encode("ascii", errors="ignore").decode())
    with pytest.MonkeyPatch.context() as patch:  # the encoder sets it in os.environ (trainer3d/data/prepare.py)
        patch.setenv("TOKENIZERS_PARALLELISM", "false")
        (prepared,) = tools_in_this_process([("tools/prepare_data.py", ["--out", root / "bpe.bin", "--train-tokenizer",
                                                                        512, texts])])
    assert prepared["code"] == 0, prepared["stderr"][-3000:]
    out = {"data": root / "bpe.bin", "bare": root / "bare"}
    for name, data in (("bpe", ("data=tokens", f"data.path={root / 'bpe.bin'}", "model.vocab_size=512")),
                       ("bytes", ())):
        train_in_ranks(root / name, [*TRAIN, *data])
        out[name] = root / f"{name}-export"
    exported = tools_in_this_process([("tools/export_model.py", [store.step_dir(root / name / "checkpoints", STEPS),
                                                                out[name]]) for name in ("bpe", "bytes")], umask=0o022)
    for result in exported:
        assert result["code"] == 0, result["stderr"][-3000:]
    shutil.copytree(out["bpe"], out["bare"])  # without its tokenizer: byte-level ids would be noise to it
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out["bare"] / name).unlink()
    samples = sample_commands(out)
    results = tools_in_this_process([("tools/sample.py", args) for args in samples.values()])
    out["sampled"] = dict(zip(samples, results))
    return out


def sample_commands(out) -> dict:
    """tools/sample.py's commands the tests check, by name."""
    greedy = ("--prompt", PROMPT, "--greedy", "--max-new-tokens", 24, "--show-ids")
    bpe_tokenizer = ("--tokenizer", out["bpe"] / "tokenizer.json")
    return {"bpe": (out["bpe"], *greedy), "bytes": (out["bytes"], *greedy),
            "bare": (out["bare"], "--prompt", "def "),
            "bytes+bpe tokenizer": (out["bytes"], "--prompt", "def ", *bpe_tokenizer),
            "bare+bpe tokenizer": (out["bare"], "--prompt", "def ", "--greedy", "--max-new-tokens", 4, *bpe_tokenizer)}


def _greedy(export: Path, prompt: str, n: int):
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:]
    return tokenizer, new.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bpe", "bytes"])
def test_export_loads_with_auto_classes_and_generates(exports, name):
    export = exports[name]
    files = sorted(p.name for p in export.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= set(files), files
    for f in export.iterdir():  # umask 022: every file 0644, the weights included
        assert oct(f.stat().st_mode & 0o777) == oct(0o644), f.name
    eos = read_header(exports["data"]).eos_id if name == "bpe" else EOF_TOKEN
    generation = read_json(export / "generation_config.json")
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (eos, eos)
    prompt = PROMPT
    tokenizer, new = _greedy(export, prompt, 24)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (eos, eos)
    assert tokenizer.eos_token == "<|endoftext|>"
    if name == "bytes":
        assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == list(prompt.encode())
    text = tokenizer.decode(new, skip_special_tokens=True)
    print(f"{name}: {prompt + text!r}")
    assert new and "\ufffd" not in text, "ASCII training text decodes to whole characters"
    # tools/sample.py reads the same directory: transformers' greedy ids (up to an eos it stops at) and text.
    sampled = exports["sampled"][name]
    assert sampled["code"] == 0, sampled["stderr"]
    ours = [int(i) for i in sampled["stdout"].splitlines()[-1].split()]
    assert ours == new[:len(ours)] and (len(ours) == len(new) or ours[-1] == eos)
    assert sampled["stdout"].startswith(prompt + tokenizer.decode(ours, skip_special_tokens=True) + "\n")


@pytest.mark.slow
def test_sample_refuses_a_tokenizer_that_does_not_fit_the_model(exports):
    sampled = exports["sampled"]
    bare = sampled["bare"]  # the BPE export without its tokenizer: byte-level ids would be noise
    assert bare["code"] != 0 and len(bare["stderr"].strip().splitlines()) == 1, bare["stderr"]
    assert "vocabulary (512) is not byte-level" in bare["stderr"] and "--tokenizer" in bare["stderr"]
    # The byte-level model given the 512-id BPE: ids past its 257.
    wrong = sampled["bytes+bpe tokenizer"]
    assert wrong["code"] != 0 and len(wrong["stderr"].strip().splitlines()) == 1, wrong["stderr"]
    assert "has 512 ids but the model's vocabulary is 257" in wrong["stderr"] and "--tokenizer" in wrong["stderr"]
    # Given the right one, the bare export samples.
    assert sampled["bare+bpe tokenizer"]["code"] == 0, sampled["bare+bpe tokenizer"]["stderr"]
