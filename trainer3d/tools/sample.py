"""Sample text from a model: a trainer3d checkpoint or a Hugging Face Llama directory.

    python tools/sample.py outputs/.../checkpoints/step_00000300 --prompt "def main(" --max-new-tokens 200
    python tools/sample.py exported/ --prompt "import os" --greedy
    python tools/sample.py exported/ --prompt "The" --temperature 0.8 --top-p 0.95 --seed 1

One process on the CPU. A checkpoint is read as tools/export_model.py reads it (checksums verified,
DCP with a restricted metadata reader); a Hugging Face directory is checked as ``model.init_from`` checks it
and read with safetensors. Tokens: ``--tokenizer``, else a tokenizer.json beside the weights,
else (a checkpoint) the tokenizer its training data records, through the ``tokenizers``
package; byte-level (bytes 0-255, end-of-document 256, as the built-in corpus and
tools/prepare_data.py without a tokenizer make them) only for a model whose data was
byte-level (a checkpoint's record) or whose vocabulary is exactly 257 (an export). A
tokenizer whose ids the model's vocabulary cannot hold, or a model with no tokenizer and a
vocabulary that is not byte-level, is refused in one line naming ``--tokenizer``: decoding
such ids as bytes prints noise. So is the data's tokenizer when it is not the one the
checkpoint recorded it was trained with (trainer3d/checkpoint/lineage.py). Generation stops at
an end-of-sequence id.
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import torch
from tokenizers import Tokenizer


from trainer3d.checkpoint.export import load_full_model, model_config_of
from trainer3d.checkpoint.lineage import tokenizer_problem
from trainer3d.checkpoint.store import MARKER, CheckpointError, read_marker
from trainer3d.data import BYTE_VOCAB, EOF_TOKEN
from trainer3d.hf.check import weight_problems
from trainer3d.hf.export import DataTokens, data_tokenizer
from trainer3d.hf.files import DirError, read_json
from trainer3d.hf.mapping import model_config
from trainer3d.hf.source import HFSource
from trainer3d.model.init import fill_parameters
from trainer3d.model.transformer import Transformer


class ByteTokenizer:
    def __init__(self):
        self.eos = EOF_TOKEN

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A tokenizer.json (Hugging Face ``tokenizers`` format)."""

    def __init__(self, path: Path):
        self.tokenizer = Tokenizer.from_file(str(path))
        self.size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids)


def load_model(path: Path, prog: str = "sample"):
    """(model, what its training data records about tokens: DataTokens, empty for a Hugging Face directory,
    the sliding attention window of a Hugging Face config.json or None); a refusal is one line
    starting with ``prog`` (the tool's name; trainer3d/tools/score.py loads models here too)."""
    if (path / MARKER).exists():
        try:
            tensors = load_full_model(path)  # refuses a checkpoint that fails its checksums
            config = read_marker(path)["config"]
        except CheckpointError as err:
            raise SystemExit(f"{prog}: {err}") from None
        model = Transformer(model_config_of(config))
        fill_parameters(model, lambda name, shape, shard: tensors[name])
        data = data_tokenizer(config)
        refused = tokenizer_problem(read_marker(path), data.tokenizer, path)
        if refused:  # the data path's tokenizer is not the one the model was trained with: never used
            data = DataTokens(None, False, data.eos_id, refused)
        return model, data, None
    try:
        hf_config = read_json(path / "config.json")
        cfg = model_config(hf_config)
    except (DirError, ValueError) as err:
        raise SystemExit(f"{prog}: {path} is neither a trainer3d checkpoint nor a Hugging Face Llama directory:\n{err}") from None
    problems = weight_problems(path, cfg)
    if problems:
        raise SystemExit(f"{prog}: " + "\n".join(problems))
    model = Transformer(cfg)
    fill_parameters(model, HFSource(path, cfg))
    return model, DataTokens(), hf_config.get("sliding_window")


def choose_tokenizer(path: Path, given: Optional[Path], data: DataTokens, vocab_size: int):
    """The tokenizer to use: --tokenizer, tokenizer.json beside the model, the data's record, or
    byte level where the model's data was byte-level; refused (SystemExit, one line) where its
    ids do not fit the model's vocabulary."""
    for candidate in (given, path / "tokenizer.json", data.tokenizer):
        if candidate is not None:
            file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
            if file.is_file():
                tokenizer = FileTokenizer(file)
                if tokenizer.size > vocab_size:
                    raise SystemExit(f"sample: the tokenizer {file} has {tokenizer.size} ids but the model's "
                                     f"vocabulary is {vocab_size}: give the tokenizer its training data was made "
                                     "with (--tokenizer FILE)")
                return tokenizer
            if candidate is given:
                raise SystemExit(f"sample: --tokenizer {given}: no tokenizer.json there")
    if data.refused:
        raise SystemExit(f"sample: {data.refused}")
    if data.byte_level or (data.tokenizer is None and vocab_size == BYTE_VOCAB):
        if vocab_size < BYTE_VOCAB:
            raise SystemExit(f"sample: the vocabulary ({vocab_size}) is too small for byte-level tokens "
                             f"({BYTE_VOCAB}); give --tokenizer")
        return ByteTokenizer()
    raise SystemExit(f"sample: {path} has no tokenizer.json and its vocabulary ({vocab_size}) is not byte-level "
                     f"({BYTE_VOCAB}): give the tokenizer its training data was made with (--tokenizer FILE)")


def next_token(logits: torch.Tensor, greedy: bool, temperature: float, top_p: float,
               generator: torch.Generator) -> int:
    """Greedy, or nucleus sampling (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", sec. 3.1): sample from the smallest set of tokens whose probability
    reaches ``top_p``."""
    if greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # the mass of the tokens ahead of each one
    sorted_probs[before >= top_p] = 0.0
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])


@torch.no_grad()
def generate(model: Transformer, ids: List[int], max_new_tokens: int, eos: List[int], greedy: bool,
             temperature: float, top_p: float, seed: int) -> List[int]:
    """The new token ids (the whole context is recomputed each step: no cache, a small-model tool)."""
    generator = torch.Generator().manual_seed(seed)
    out: List[int] = []
    for _ in range(max_new_tokens):
        context = (ids + out)[-model.cfg.max_seq_len:]
        logits = model(torch.tensor([context]))[0, -1].float()
        token = next_token(logits, greedy, temperature, top_p, generator)
        out.append(token)
        if token in eos:
            break
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a published checkpoint dir (…/checkpoints/step_N) or a "
                                                 "Hugging Face Llama directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--greedy", action="store_true", help="always the most likely token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json or a directory holding one")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    args = parser.parse_args(argv)
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be > 0 and --top-p in (0, 1]; use --greedy for argmax decoding")
    model, data, window = load_model(args.model)
    model.eval()
    tokenizer = choose_tokenizer(args.model, args.tokenizer, data, model.cfg.vocab_size)
    eos = list(model.cfg.eos_token_ids) or ([tokenizer.eos] if isinstance(tokenizer, ByteTokenizer) else [])
    ids = tokenizer.encode(args.prompt)
    if not ids:
        parser.error("--prompt encodes to no tokens")
    if window is not None and len(ids) + args.max_new_tokens > window:
        # trainer3d attends over the whole context; a model trained with a shorter sliding window
        # (Mistral/Mixtral's config.json) would be sampled with attention it never had
        raise SystemExit(f"sample: {args.model}/config.json has sliding_window={window}, shorter than the prompt "
                         f"({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens}; trainer3d has no "
                         f"sliding-window attention: ask for at most {max(window - len(ids), 0)} new tokens")
    new = generate(model, ids, args.max_new_tokens, eos, args.greedy, args.temperature, args.top_p, args.seed)
    print(args.prompt + tokenizer.decode(new))
    if args.show_ids:
        print(" ".join(map(str, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
