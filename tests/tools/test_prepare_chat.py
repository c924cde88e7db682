"""tools/prepare_data.py --chat: conversations rendered with the tokenizer's chat template in
Jinja2's sandbox, the loss mask beside the ids, and the refusals (a template reaching for
Python's internals, a template that raises, one whose prefixes are not prefixes)."""

import json

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.support.run_scripts import run_all
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


TOOL = ROOT / "tools" / "prepare_data.py"


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


MALICIOUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{% set x = messages.append(1) %}{{ x }}",
    "{{ raise_exception.__globals__ }}",
]
RAISES = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
          + CHATML)
LOOP_LENGTH = "{% for m in messages %}[{{ loop.length }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
"""A template that renders each turn with the conversation's length in it: the prefix up to an
assistant turn is not a prefix of the whole."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the tool this file checks, each on inputs of its own directory, made one after
    another in one interpreter started in ``root`` (tests/support/run_scripts.py: torch imported
    once, not once per run): ``root`` and {name: (its directory, its CompletedProcess)}."""
    root = tmp_path_factory.mktemp("chat")
    cases = {}

    def add(name, make_args):
        (root / name).mkdir()
        cases[name] = (root / name, make_args(root / name))

    for train_on in ("assistant", "all"):
        add(f"train-on-{train_on}", lambda d, train_on=train_on: ["--chat", "--tokenizer", _tokenizer(d), "--train-on", train_on,
                                                             "--out", d / "out" / "sft.bin", _inputs(d)])
    said = [{"role": "user", "content": "what is <|endoftext|>?"}, {"role": "assistant", "content": "an id"}]
    add("eot-inside", lambda d: ["--chat", "--tokenizer", _tokenizer(d), "--out", d / "sft.bin",
                                 _inputs(d, [said, CONVERSATIONS[0]])])
    for i, template in enumerate(MALICIOUS):
        add(f"malicious-{i}", lambda d, template=template: ["--chat", "--tokenizer", _tokenizer(d, template),
                                                            "--out", d / "sft.bin", _inputs(d)])
    add("raises", lambda d: ["--chat", "--tokenizer", _tokenizer(d, RAISES), "--out", d / "sft.bin",
                             _inputs(d, [CONVERSATIONS[0], CONVERSATIONS[0], CONVERSATIONS[1]])])
    add("not-prefixes", lambda d: ["--chat", "--tokenizer", _tokenizer(d, LOOP_LENGTH), "--out", d / "a.bin",
                                   _inputs(d)])
    add("not-prefixes-all", lambda d: ["--chat", "--tokenizer", _tokenizer(d, LOOP_LENGTH), "--train-on", "all",
                                       "--out", d / "b.bin", _inputs(d)])
    add("no-tokenizer", lambda d: ["--chat", "--out", d / "a.bin", _inputs(d)])

    def bare(d):
        (d / "bare").mkdir()
        (d / "bare" / "tokenizer.json").write_text((_tokenizer(d) / "tokenizer.json").read_text())
        return ["--chat", "--tokenizer", d / "bare", "--out", d / "a.bin", _inputs(d)]
    add("no-template", bare)

    def bad(d):
        (d / "bad.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n"
                                     + json.dumps({"text": "no messages"}) + "\n")
        return ["--chat", "--tokenizer", _tokenizer(d), "--out", d / "a.bin", d / "bad.jsonl"]
    add("no-messages", bad)
    done = run_all([(TOOL, args) for _, args in cases.values()], cwd=root)
    return root, {name: (directory, proc) for (name, (directory, _)), proc in zip(cases.items(), done)}


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_chat_ids_and_mask_are_chatml_written_by_hand(runs, train_on):
    tmp_path, proc = runs[1][f"train-on-{train_on}"]
    out = tmp_path / "out" / "sft.bin"
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


def test_an_end_of_text_inside_a_conversation_is_no_document_boundary(runs):
    tmp_path, proc = runs[1]["eot-inside"]
    assert proc.returncode == 0, proc.stderr
    tokens = TokenFile.open(tmp_path / "sft.bin")
    ids = np.asarray(tokens.tokens)
    assert (ids == EOT).sum() == 3  # the special token matched inside the text, and one after each conversation
    second = int(np.flatnonzero(ids == EOT)[1]) + 1
    assert document_starts(tokens).tolist() == [0, second]


@pytest.mark.parametrize("template", range(len(MALICIOUS)), ids=MALICIOUS)
def test_a_template_reaching_for_python_internals_is_refused(runs, template):
    root, (tmp_path, proc) = runs[0], runs[1][f"malicious-{template}"]
    out = tmp_path / "sft.bin"
    assert proc.returncode == 1, proc.stdout
    assert f"{tmp_path / 'chats.jsonl'}:1: the chat template of {tmp_path / 'tok' / 'tokenizer_config.json'}" \
        in proc.stderr, proc.stderr
    assert "Security" in proc.stderr or "unsafe" in proc.stderr, proc.stderr
    assert not (root / "PWNED").exists()  # the runs' working directory
    assert not out.exists() and not mask_path(out).exists() and not mask_header_path(out).exists()


def test_a_template_that_raises_is_refused_naming_the_record(runs):
    tmp_path, proc = runs[1]["raises"]
    assert proc.returncode == 1
    assert f"{tmp_path / 'chats.jsonl'}:3: the chat template of" in proc.stderr
    assert "a system message first" in proc.stderr


def test_a_template_whose_prefixes_are_not_prefixes_is_refused_for_the_assistant_mask(runs):
    """LOOP_LENGTH: the mask cannot be placed; --train-on all needs no mask and renders it."""
    tmp_path, proc = runs[1]["not-prefixes"]
    chats = tmp_path / "chats.jsonl"
    assert proc.returncode == 1
    assert f"{chats}:1:" in proc.stderr and "prefix" in proc.stderr and "--train-on all" in proc.stderr
    assert runs[1]["not-prefixes-all"][1].returncode == 0


def test_chat_refusals_of_the_command_line_and_the_records(runs):
    proc = runs[1]["no-tokenizer"][1]
    assert proc.returncode == 2 and "--chat renders with a tokenizer's own chat template" in proc.stderr
    proc = runs[1]["no-template"][1]
    assert proc.returncode == 1 and "has no chat template" in proc.stderr
    bad, proc = runs[1]["no-messages"][0] / "bad.jsonl", runs[1]["no-messages"][1]
    assert proc.returncode == 1 and f"{bad}:2: no non-empty list under key 'messages'" in proc.stderr
