"""An export is a standard Hugging Face directory: transformers' Auto classes load and generate.

A tiny model trains on data made with a BPE trained locally (tools/prepare_data.py
--train-tokenizer, saved as ``<out>.tokenizer.json``), and another on the built-in
byte-level corpus; tools/export_model.py writes each under umask 022. transformers (the
independent reader) must then load the tokenizer with ``AutoTokenizer`` (special tokens
from the run's ids), the model with ``AutoModelForCausalLM``, and generate; tools/sample.py
must give transformers' greedy ids, and refuse in one line a model whose vocabulary the
tokenizer it would use does not fit.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: missing, these tests fail rather than skip

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
# ASCII text (every BPE token decodes to whole characters): a handful of Python modules.
SOURCES = ["json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "shlex.py"]


def tool(*args, umask=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"bpe": export dir, "bytes": export dir, "data": the BPE token file}."""
    root = tmp_path_factory.mktemp("export-standard")
    texts = root / "texts"
    texts.mkdir()
    stdlib = Path(os.__file__).parent
    for name in SOURCES:
        text = (stdlib / name).read_text()
        (texts / name.replace("/", "_")).write_text(text.encode("ascii", errors="ignore").decode())
    proc = tool("tools/prepare_data.py", "--out", root / "bpe.bin", "--train-tokenizer", 512, texts)
    assert proc.returncode == 0, proc.stderr
    out = {"data": root / "bpe.bin"}
    for name, data in (("bpe", ("data=tokens", f"data.path={root / 'bpe.bin'}", "model.vocab_size=512")),
                       ("bytes", ())):
        train_in_ranks(root / name, [*TRAIN, *data])
        out[name] = root / f"{name}-export"
        proc = tool("tools/export_model.py", store.step_dir(root / name / "checkpoints", STEPS), out[name],
                    umask=0o022)
        assert proc.returncode == 0, proc.stderr
    return out


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
    prompt = "def split(self, text):\n    "
    tokenizer, new = _greedy(export, prompt, 24)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (eos, eos)
    assert tokenizer.eos_token == "<|endoftext|>"
    if name == "bytes":
        assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == list(prompt.encode())
    text = tokenizer.decode(new, skip_special_tokens=True)
    print(f"{name}: {prompt + text!r}")
    assert new and "\ufffd" not in text, "ASCII training text decodes to whole characters"
    # tools/sample.py reads the same directory: transformers' greedy ids (up to an eos it stops at) and text.
    proc = tool("tools/sample.py", export, "--prompt", prompt, "--greedy", "--max-new-tokens", 24, "--show-ids")
    assert proc.returncode == 0, proc.stderr
    ours = [int(i) for i in proc.stdout.splitlines()[-1].split()]
    assert ours == new[:len(ours)] and (len(ours) == len(new) or ours[-1] == eos)
    assert proc.stdout.startswith(prompt + tokenizer.decode(ours, skip_special_tokens=True) + "\n")


@pytest.mark.slow
def test_sample_refuses_a_tokenizer_that_does_not_fit_the_model(exports, tmp_path):
    bare = tmp_path / "bare"  # the BPE export without its tokenizer: byte-level ids would be noise
    shutil.copytree(exports["bpe"], bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    proc = tool("tools/sample.py", bare, "--prompt", "def ")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "vocabulary (512) is not byte-level" in proc.stderr and "--tokenizer" in proc.stderr
    # The byte-level model given the 512-id BPE: ids past its 257.
    proc = tool("tools/sample.py", exports["bytes"], "--prompt", "def ", "--tokenizer",
                exports["bpe"] / "tokenizer.json")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "has 512 ids but the model's vocabulary is 257" in proc.stderr and "--tokenizer" in proc.stderr
    # Given the right one, the bare export samples.
    proc = tool("tools/sample.py", bare, "--prompt", "def ", "--greedy", "--max-new-tokens", 4, "--tokenizer",
                exports["bpe"] / "tokenizer.json")
    assert proc.returncode == 0, proc.stderr
