"""tools/prepare_data.py --chat: conversations rendered with the tokenizer's chat template in
Jinja2's sandbox, the loss mask beside the ids, and the refusals (a template reaching for
Python's internals, a template that raises, one whose prefixes are not prefixes)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from trainer3d.data import TokenFile
from trainer3d.data.chat_sample import CHATML, byte_chat_tokenizer
from trainer3d.data.doc_index import document_starts
from trainer3d.data.loss_mask import mask_header_path, mask_path, open_mask

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
     {"role": "assistant", "content": "Hello, wörld."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6, ünd done"}],
]
EOT, IM_START, IM_END = 256, 257, 258  # trainer3d/data/chat_sample.py's special tokens


def run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _tokenizer(tmp_path, template=CHATML):
    directory = byte_chat_tokenizer(tmp_path / "tok")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


def _inputs(tmp_path, conversations=CONVERSATIONS):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def _by_hand(conversations, train_on_all=False):
    """ChatML written out by hand in the byte-level ids: the assistant's content and its
    <|im_end|>\\n kept, the header <|im_start|>assistant\\n and every other turn left out."""
    ids, mask = [], []
    for messages in conversations:
        for m in messages:
            head = [IM_START, *(m["role"] + "\n").encode()]
            body = [*m["content"].encode(), IM_END, *b"\n"]
            ids += head + body
            mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
        ids.append(EOT)
        mask.append(0)
    return ids, ([1] * len(mask) if train_on_all else mask)


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_chat_ids_and_mask_are_chatml_written_by_hand(tmp_path, train_on):
    out = tmp_path / "out" / "sft.bin"
    proc = run_tool("--chat", "--tokenizer", _tokenizer(tmp_path), "--train-on", train_on, "--out", out,
                    _inputs(tmp_path))
    assert proc.returncode == 0, proc.stderr
    want_ids, want_mask = _by_hand(CONVERSATIONS, train_on_all=train_on == "all")
    tokens = TokenFile.open(out)
    assert np.asarray(tokens.tokens).tolist() == want_ids
    assert np.asarray(open_mask(out, tokens.header, cache_dir=None)).tolist() == want_mask
    header = json.loads(mask_header_path(out).read_text())
    assert header["kept"] == sum(want_mask) and header["train_on"] == train_on
    assert header["tokens_sha256"] == tokens.header.sha256
    assert f"{sum(want_mask):,} of {len(want_mask):,} tokens trained on" in proc.stdout
    lengths = [len(_by_hand([m])[0]) for m in CONVERSATIONS]  # each conversation a document
    assert document_starts(tokens).tolist() == np.cumsum([0] + lengths[:-1]).tolist()


def test_an_end_of_text_inside_a_conversation_is_no_document_boundary(tmp_path):
    said = [{"role": "user", "content": "what is <|endoftext|>?"}, {"role": "assistant", "content": "an id"}]
    out = tmp_path / "sft.bin"
    proc = run_tool("--chat", "--tokenizer", _tokenizer(tmp_path), "--out", out,
                    _inputs(tmp_path, [said, CONVERSATIONS[0]]))
    assert proc.returncode == 0, proc.stderr
    tokens = TokenFile.open(out)
    ids = np.asarray(tokens.tokens)
    assert (ids == EOT).sum() == 3  # the special token matched inside the text, and one after each conversation
    second = int(np.flatnonzero(ids == EOT)[1]) + 1
    assert document_starts(tokens).tolist() == [0, second]


MALICIOUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{% set x = messages.append(1) %}{{ x }}",
    "{{ raise_exception.__globals__ }}",
]


@pytest.mark.parametrize("template", MALICIOUS)
def test_a_template_reaching_for_python_internals_is_refused(tmp_path, template, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sft.bin"
    proc = run_tool("--chat", "--tokenizer", _tokenizer(tmp_path, template), "--out", out, _inputs(tmp_path))
    assert proc.returncode == 1, proc.stdout
    assert f"{tmp_path / 'chats.jsonl'}:1: the chat template of {tmp_path / 'tok' / 'tokenizer_config.json'}" \
        in proc.stderr, proc.stderr
    assert "Security" in proc.stderr or "unsafe" in proc.stderr, proc.stderr
    assert not (tmp_path / "PWNED").exists()
    assert not out.exists() and not mask_path(out).exists() and not mask_header_path(out).exists()


def test_a_template_that_raises_is_refused_naming_the_record(tmp_path):
    template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
                + CHATML)
    conversations = [CONVERSATIONS[0], CONVERSATIONS[0], CONVERSATIONS[1]]
    proc = run_tool("--chat", "--tokenizer", _tokenizer(tmp_path, template), "--out", tmp_path / "sft.bin",
                    _inputs(tmp_path, conversations))
    assert proc.returncode == 1
    assert f"{tmp_path / 'chats.jsonl'}:3: the chat template of" in proc.stderr
    assert "a system message first" in proc.stderr


def test_a_template_whose_prefixes_are_not_prefixes_is_refused_for_the_assistant_mask(tmp_path):
    """A template that renders each turn with the conversation's length in it: the prefix up to
    an assistant turn is not a prefix of the whole, so the mask cannot be placed; --train-on all
    needs no mask and renders it."""
    template = "{% for m in messages %}[{{ loop.length }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok, chats = _tokenizer(tmp_path, template), _inputs(tmp_path)
    proc = run_tool("--chat", "--tokenizer", tok, "--out", tmp_path / "a.bin", chats)
    assert proc.returncode == 1
    assert f"{chats}:1:" in proc.stderr and "prefix" in proc.stderr and "--train-on all" in proc.stderr
    assert run_tool("--chat", "--tokenizer", tok, "--train-on", "all", "--out", tmp_path / "b.bin",
                    chats).returncode == 0


def test_chat_refusals_of_the_command_line_and_the_records(tmp_path):
    chats = _inputs(tmp_path)
    proc = run_tool("--chat", "--out", tmp_path / "a.bin", chats)
    assert proc.returncode == 2 and "--chat renders with a tokenizer's own chat template" in proc.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((_tokenizer(tmp_path) / "tokenizer.json").read_text())
    proc = run_tool("--chat", "--tokenizer", bare, "--out", tmp_path / "a.bin", chats)
    assert proc.returncode == 1 and "has no chat template" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps({"text": "no messages"}) + "\n")
    proc = run_tool("--chat", "--tokenizer", _tokenizer(tmp_path), "--out", tmp_path / "a.bin", bad)
    assert proc.returncode == 1 and f"{bad}:2: no non-empty list under key 'messages'" in proc.stderr
