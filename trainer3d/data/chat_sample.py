"""The built-in conversations (``data=chat_sample``): supervised fine-tuning with no download.

``chat_sample.jsonl`` beside this module holds a few dozen short conversations written for
trainer3d (sums, words spelled backwards, numbers in words, greetings). They are rendered once
into ``data.cache_dir`` as ``trainer3d-prepare-data --chat`` renders any (trainer3d/data/chat.py),
with a byte-level tokenizer that knows three special tokens and a ChatML chat template:

    ids 0-255  the bytes (GPT-2's byte-to-character alphabet, no merges)
    256        <|endoftext|>  the end of a document (a conversation)
    257, 258   <|im_start|>, <|im_end|>  ChatML's turn markers

so the token file, its loss mask and the tokenizer directory (tokenizer.json,
tokenizer_config.json with the template) are what a user's own tokenizer would give.
"""

import hashlib
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from trainer3d.data.chat import Conversation, check_messages, load_chat_template, prepare_chat
from trainer3d.data.loss_mask import mask_header_path
from trainer3d.data.prepare import load_tokenizer
from trainer3d.data.tokens import TokenFileError, bin_path, read_header

SAMPLE = Path(__file__).with_name("chat_sample.jsonl")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML (each turn ``<|im_start|>role\\ncontent<|im_end|>\\n``), the format SmolLM2's instruct models use."""
SAMPLE_VERSION = 2
"""Part of the cache's name: a change in what is rendered (the document index beside the ids) makes it anew."""


def byte_alphabet() -> dict:
    """GPT-2's byte-to-character alphabet as {character: byte}: printable bytes stand for
    themselves, the others for 256 + their rank (what ``ByteLevel`` pre-tokenizers emit)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
             *range(ord("\u00ae"), ord("\u00ff") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {**{chr(b): b for b in shown}, **{chr(256 + k): b for k, b in enumerate(hidden)}}


def byte_chat_tokenizer(directory: Path) -> Path:
    """Write the byte-level ChatML tokenizer (tokenizer.json, tokenizer_config.json) into ``directory``."""
    tokenizer = Tokenizer(models.BPE(vocab=byte_alphabet(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": SPECIAL[0], "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return directory


def chat_sample(cache_dir: str) -> Path:
    """The built-in conversations as a token file with its document index and loss mask, made once in ``cache_dir``."""
    digest = hashlib.sha256(SAMPLE.read_bytes() + CHATML.encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() / f"chat-sample-v{SAMPLE_VERSION}-{digest}"
    path = bin_path(root / "chat.bin")
    if mask_header_path(path).exists():  # published last: the token file is there too
        try:
            read_header(path)
            return path
        except TokenFileError:  # a damaged cache: make it again
            pass
    print(f"trainer3d: rendering the built-in conversations into {path} (once)", flush=True)
    tokenizer_dir = byte_chat_tokenizer(root / "tokenizer")
    items = (Conversation(f"{SAMPLE}:{n}", check_messages(json.loads(line), f"{SAMPLE}:{n}"))
             for n, line in enumerate(SAMPLE.read_text().splitlines(), start=1) if line.strip())
    prepare_chat(items, path, load_tokenizer(str(tokenizer_dir)), load_chat_template(tokenizer_dir), "assistant")
    return path
