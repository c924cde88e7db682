"""Conversations -> token ids and a loss mask, through the tokenizer's own chat template.

A conversation is one JSON Lines record, ``{"messages": [{"role": ..., "content": ...}, ...]}``.
It is rendered with the chat template its tokenizer ships (``chat_template.jinja``, or the
``chat_template`` key of ``tokenizer_config.json``: a string, or a list of named templates of
which "default" is taken), as transformers' ``apply_chat_template`` renders it: Jinja2 with
``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt`` and
the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), and ``raise_exception``.

The sandbox: a template comes with a downloaded tokenizer and is untrusted, so it runs in
Jinja2's ``ImmutableSandboxedEnvironment`` (https://jinja.palletsprojects.com/en/stable/sandbox/):
attributes starting with an underscore (``__class__``, ``__subclasses__``, ``__globals__`` ...),
calls of unsafe callables and any method that changes a list or dict are refused there, each
raising ``SecurityError`` at once (``_Sandbox``), and a record whose rendering raises anything is
refused naming its file and line. No filter or global of ours reaches the
machine (``tojson`` is Jinja2's own; no ``strftime_now``).

The loss mask marks the tokens the model is trained to produce: the assistant's. It is found by
rendering prefixes, the way TRL and open-instruct mask chat data (transformers'
``return_assistant_tokens_mask`` needs a template rewritten with ``{% generation %}`` blocks, which
published templates mostly lack): for the i-th message, an assistant's, its characters are those
``render(messages[:i + 1])`` adds to ``render(messages[:i], add_generation_prompt=True)``, which
leaves the template's assistant header (``<|im_start|>assistant\\n``) out and the end-of-turn
token in. Each such rendering must be a prefix of the whole conversation's; a template that
renders earlier turns differently once later ones follow (one that drops an earlier turn's
reasoning, say) is refused naming the record, as its mask would not be where its tokens are.
The whole text is tokenised once (ids as a model would read the whole conversation), and a
token is the assistant's where its first character lies in an assistant span: a token that
straddles a boundary (a merge across it) goes to the side it starts on.

Each conversation is one document of the token file's document index (``prepare_chat``), so
``data.document_mask`` keeps a packed conversation from attending to the one before it even
where a template or a message holds the end-of-text token itself.
"""

import collections
import functools
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from jinja2 import TemplateError, ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from trainer3d.config.jsonfile import read_json_object
from trainer3d.data.doc_index import DocIndexWriter
from trainer3d.data.documents import MAX_RECORD_BYTES, InputError, Progress, open_input
from trainer3d.data.loss_mask import MaskHeader, MaskWriter
from trainer3d.data.tokens import TokenHeader, TokenWriter

TRAIN_ON = ("assistant", "all")
"""--train-on: the assistant's tokens only, or every token (the mask all ones)."""
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or compiled; the message names the file."""


def _raise_exception(message):
    raise TemplateError(message)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, where a refused attribute raises at once: the stock one hands
    back an undefined value that renders as nothing, and a template probing ``__globals__`` would
    render on, quietly."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")


@dataclass
class ChatTemplate:
    """A tokenizer's chat template, compiled in the sandbox, with the special tokens it reads."""

    source: str
    where: str
    """The file it came from (named in every refusal)."""
    special: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        try:
            self.template = env.from_string(self.source)
        except TemplateError as err:
            raise ChatTemplateError(f"{self.where}: the chat template does not compile ({err})") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                    **self.special)


def _token_text(value) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, or an object with a string ``content``."""
    text = value.get("content") if isinstance(value, dict) else value
    return text if isinstance(text, str) else None


def load_chat_template(tokenizer_dir: Path) -> ChatTemplate:
    """The chat template of a Hugging Face tokenizer directory (see the module docstring)."""
    jinja, config_path = tokenizer_dir / "chat_template.jinja", tokenizer_dir / "tokenizer_config.json"
    config = read_json_object(config_path) if config_path.is_file() else {}
    special = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(), str(jinja), special)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ChatTemplateError(f"--chat: {tokenizer_dir} has no chat template (neither chat_template.jinja nor a "
                                "string chat_template in tokenizer_config.json); give --tokenizer a directory "
                                "whose tokenizer has one (an instruct model's)")
    return ChatTemplate(template, str(config_path), special)


def assistant_spans(template: ChatTemplate, messages: List[dict]) -> Tuple[str, List[Tuple[int, int]]]:
    """(the rendered conversation, the character spans of its assistant turns) by prefix rendering."""
    whole = template.render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = template.render(messages[:i], add_generation_prompt=True)
        turn = template.render(messages[:i + 1])
        if not (turn.startswith(head) and whole.startswith(turn)):
            raise TemplateError(f"message {i} (assistant): the template does not render the conversation up to it as "
                                "a prefix of the whole, so its tokens cannot be found by prefix rendering; use "
                                "--train-on all")
        spans.append((len(head), len(turn)))
    return whole, spans


def encode_conversation(template: ChatTemplate, tokenizer: Tokenizer, messages: List[dict],
                        train_on: str) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask of 0/1 per token) of one conversation, without an end-of-document id."""
    if train_on == "all":
        text, spans = template.render(messages), None
    else:
        text, spans = assistant_spans(template, messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)  # the template writes its own special tokens
    ids = np.asarray(encoding.ids, dtype=np.int64)
    if spans is None:
        return ids, np.ones(len(ids), dtype=np.uint8)
    starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return ids, mask.astype(np.uint8)


def check_messages(record, where: str) -> List[dict]:
    """The record's messages, checked for the shape every template expects."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: no non-empty list under key 'messages' (a conversation is "
                         '{"messages": [{"role": ..., "content": ...}, ...]})')
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InputError(f"{where}: message {k} is not an object with a string 'role' and a 'content'")
    return messages


@dataclass(frozen=True)
class Conversation:
    """One record of an input: where it is (file:line, named in refusals) and its messages."""

    where: str
    messages: List[dict]


def conversations(files: Sequence[Path], progress: Progress) -> Iterator[Conversation]:
    """Every conversation of the JSON Lines ``files`` (maybe .gz/.zst), in order; blank lines skipped."""
    for path in files:
        raw, stream = open_input(path, progress)
        try:
            for number, line in enumerate(iter(functools.partial(stream.readline, MAX_RECORD_BYTES + 1), b""),
                                          start=1):
                where = f"{path}:{number}"
                if len(line) > MAX_RECORD_BYTES:
                    raise InputError(f"{where}: a record longer than {MAX_RECORD_BYTES} bytes")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.decode("utf-8", errors="replace"))
                except (ValueError, RecursionError) as err:
                    raise InputError(f"{where}: not a JSON record ({type(err).__name__}: {err})") from None
                yield Conversation(where, check_messages(record, where))
        finally:
            stream.close()
            raw.close()
            progress.done_files += path.stat().st_size
            progress._raw = None


def encode_or_refuse(template: ChatTemplate, tokenizer: Tokenizer, conversation: Conversation,
                     train_on: str) -> Tuple[np.ndarray, np.ndarray]:
    """``encode_conversation``, a rendering failure (the sandbox's refusals among them) refused as
    an InputError naming the record and the template's file."""
    try:
        return encode_conversation(template, tokenizer, conversation.messages, train_on)
    except Exception as err:  # noqa: BLE001 -- a template may raise anything; each is this record's refusal
        raise InputError(f"{conversation.where}: the chat template of {template.where} cannot render this "
                         f"conversation ({type(err).__name__}: {err})") from None


# --------------------------------------------------------------------------- the token file and its mask

_WORKER: dict = {}
BATCH_CONVERSATIONS = 256


def _init_worker(template: ChatTemplate, tokenizer_json: str, eos_id: int, train_on: str) -> None:
    _WORKER.update(template=ChatTemplate(template.source, template.where, template.special),
                   tokenizer=Tokenizer.from_str(tokenizer_json), eos_id=eos_id, train_on=train_on)


def _encode_batch(batch: List[Conversation]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's ids and mask, the end-of-document id (mask 0 unless --train-on all) after each
    conversation, and where in the ids each conversation starts."""
    ids, masks = [], []
    for conversation in batch:
        i, m = encode_or_refuse(_WORKER["template"], _WORKER["tokenizer"], conversation, _WORKER["train_on"])
        ids += [i, np.asarray([_WORKER["eos_id"]])]
        masks += [m, np.asarray([_WORKER["train_on"] == "all"], dtype=np.uint8)]
    starts = np.cumsum([0] + [len(i) + 1 for i in ids[:-2:2]])
    return np.concatenate(ids), np.concatenate(masks), starts


def _batches(items: Iterator[Conversation], size: int) -> Iterator[List[Conversation]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_conversations(items: Iterator[Conversation], template: ChatTemplate, tokenizer_json: str, eos_id: int,
                         train_on: str, workers: int) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, mask, conversation starts) of each batch of conversations, in input order, through ``workers`` processes
    (at most 2 * workers batches in flight, as trainer3d/data/prepare.py encodes text)."""
    args = (template, tokenizer_json, eos_id, train_on)
    batches = _batches(items, BATCH_CONVERSATIONS)
    if workers <= 1:
        _init_worker(*args)
        yield from map(_encode_batch, batches)
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=args) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_encode_batch, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def prepare_chat(items: Iterator[Conversation], out: Path, encoder, template: ChatTemplate, train_on: str,
                 workers: int = 1, vocab_size: Optional[int] = None) -> Tuple[TokenHeader, MaskHeader]:
    """Render and encode ``items`` into the token file ``out``, its document index (each
    conversation a document, trainer3d/data/doc_index.py: a template's own end-of-text token is
    no boundary) and its loss mask (trainer3d/data/loss_mask.py), published in that order;
    ``encoder`` is trainer3d/data/prepare.py's ``Encoder``."""
    index, mask = DocIndexWriter(out), None
    try:
        with TokenWriter(out, vocab_size or encoder.vocab_size, encoder.info, encoder.eos_id) as writer:
            mask = MaskWriter(out, train_on)
            for ids, m, starts in encode_conversations(items, template, encoder.tokenizer_json, encoder.eos_id,
                                                       train_on, workers):
                index.add(writer.n_tokens + starts)
                writer.write(ids)
                mask.write(m)
            if writer.n_tokens == 0:
                raise ValueError(f"{out}: the inputs hold no conversation")
        index.close(writer.header)
        return writer.header, mask.publish(writer.header.sha256)
    except BaseException:
        index.abort()
        if mask is not None:
            mask.abort()
        raise
