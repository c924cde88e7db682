"""Per-document scores of a token file under a model: one JSON line a document, and the corpus perplexity.

    trainer3d-score outputs/.../checkpoints/step_00000300 --data data/val.bin --out scores.jsonl
    python -m trainer3d.tools.score exported/ --data data/val.bin --seq-len 512 --no-pack --out scores.jsonl

MODEL is a trainer3d checkpoint (read as tools/sample.py reads it: checksums verified, DCP
with a restricted metadata reader) or a Hugging Face Llama directory (config.json checked,
safetensors only); nothing in either executes. Documents are the token file's document index
(trainer3d/data/doc_index.py), a Megatron-LM dataset's own index (``--eos-id`` names its
end-of-document id), or, for a token file without an index, the end-of-document ids (said in
one line). Each line of ``--out`` is ``{"doc": i, "tokens": n, "nll": x}``: x = -sum log
p(x_t | x_<t of the same document) over the document's tokens after its first, its
end-of-document id included (trainer3d/tools/doc_scores.py); a document longer than
``--seq-len`` is scored with a sliding window and its line says so (``"window": seq_len``).
Packed (the default: many documents a window, document-masked) and ``--no-pack`` (each
document alone) give the same numbers. One process on the CPU, in fp32: a model whose
estimated memory exceeds what the machine has free is refused before it is read.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from trainer3d.checkpoint.export import model_config_of
from trainer3d.checkpoint.store import MARKER, CheckpointError, read_marker
from trainer3d.data import megatron
from trainer3d.data.doc_index import document_starts
from trainer3d.data.tokenfile import TokenFile
from trainer3d.data.tokens import TokenFileError
from trainer3d.hf.files import DirError, read_json
from trainer3d.hf.mapping import model_config
from trainer3d.model.documents import apply_document_mask
from trainer3d.model.transformer import count_parameters
from trainer3d.tools import output
from trainer3d.tools.doc_scores import Scorer, eos_starts
from trainer3d.tools.sample import load_model

GIB = 2 ** 30
FP32 = 4


def available_memory() -> Optional[int]:
    """Bytes the kernel says a new process can take without swapping (/proc/meminfo MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _config(path: Path):
    """The model's ModelConfig from its marker or config.json without reading weights (None if
    unreadable: loading then refuses it naming the file)."""
    try:
        if (path / MARKER).exists():
            return model_config_of(read_marker(path)["config"])
        return model_config(read_json(path / "config.json"))
    except (CheckpointError, DirError, ValueError, KeyError, TypeError):
        return None


def memory_problem(path: Path, seq_len: Optional[int], available: Optional[int]) -> Optional[str]:
    """Why the model at ``path`` would not fit in ``available`` bytes, or None: fp32 weights held
    twice while loading (the read tensors and the model), plus a window's logits three times and
    its dense document mask (seq^2 fp32, trainer3d/model/documents.py's CPU path)."""
    cfg = _config(path)
    if cfg is None or available is None:
        return None
    params, seq = count_parameters(cfg), seq_len or cfg.max_seq_len
    window = (3 * seq * cfg.vocab_size + seq * seq) * FP32
    need = 2 * params * FP32 + window
    if need <= available:
        return None
    return (f"score: {path} has {params:,} parameters: scoring it in fp32 needs about {need / GIB:.1f} GiB "
            f"(2 x {params:,} x 4 bytes while loading, {window / GIB:.1f} GiB for a window's logits and mask), and this "
            f"machine has {available / GIB:.1f} GiB available; run it on a machine with that much free memory "
            f"(trainer3d-score runs one process; a smaller --seq-len only shrinks the logits)")


def open_documents(data: Path, vocab_size: int, eos_id: Optional[int]):
    """(token file, document starts, a note when the starts come from end-of-document ids)."""
    if megatron.is_megatron(data) and eos_id is None:
        raise SystemExit(f"score: {data} is a Megatron-LM dataset, whose files do not record the end-of-document "
                         "id: give --eos-id (GPT-2's is 50256)")
    try:
        tokens = TokenFile.open(data, vocab_size=vocab_size, eos_id=eos_id)
        starts = document_starts(tokens)
    except (TokenFileError, OSError) as err:
        raise SystemExit(f"score: {err}") from None
    if tokens.header.max_id >= vocab_size:
        raise SystemExit(f"score: {tokens.path} holds ids up to {tokens.header.max_id}, outside the model's "
                         f"vocabulary of {vocab_size}: score it with the model its tokenizer was made for")
    note = None
    if starts is None:
        starts = eos_starts(tokens.tokens, tokens.header.eos_id)
        note = (f"score: {tokens.path} has no document index (made before trainer3d-prepare-data wrote one): "
                f"documents end at its end-of-document id {tokens.header.eos_id} (rebuild it for exact boundaries)")
    return tokens, starts, note


def tokenizer_refusal(model_path: Path, tokens: TokenFile) -> Optional[str]:
    """Why a checkpoint's scores on ``tokens`` would be meaningless: its training data was made by
    another tokenizer (the marker's data records, trainer3d/checkpoint/lineage.py)."""
    if not (model_path / MARKER).exists() or megatron.is_megatron(tokens.path):
        return None
    recorded = {r["tokenizer_sha256"]: r.get("tokenizer") for r in (read_marker(model_path).get("data") or {}).values()
                if isinstance(r, dict) and isinstance(r.get("tokenizer_sha256"), str)}
    if not recorded or tokens.header.tokenizer.sha256 in recorded:
        return None
    return (f"score: {tokens.path} was made with tokenizer {tokens.header.tokenizer.name}, but checkpoint "
            f"{model_path} was trained on data of {', '.join(map(str, recorded.values()))}: tokenise the text with "
            "that tokenizer (trainer3d-prepare-data --tokenizer ...)")


class Progress:
    """A line on stderr at each tenth of the documents scored."""

    def __init__(self, total: int):
        self.total, self.shown = total, 0

    def __call__(self, done: int) -> None:
        tenth = done * 10 // self.total
        if tenth > self.shown:
            self.shown = tenth
            print(f"score: {done}/{self.total} documents", file=sys.stderr, flush=True)


def _seq_len(args, model, window: Optional[int]) -> int:
    limit = min(model.cfg.max_seq_len, window or model.cfg.max_seq_len)
    seq_len = args.seq_len or limit
    if not 2 <= seq_len <= limit:
        why = "its config.json's sliding_window" if window and window < model.cfg.max_seq_len else "its max_seq_len"
        raise SystemExit(f"score: --seq-len {seq_len}: give 2 .. {limit}, the positions {args.model} attends over "
                         f"({why})")
    return seq_len


def write_scores(out: Path, starts: np.ndarray, n_tokens: int, nll: np.ndarray, seq_len: int) -> None:
    lengths = np.diff(np.append(starts, n_tokens))
    with output.new_file(out) as tmp, open(tmp, "w") as f:
        for i, (n, x) in enumerate(zip(lengths.tolist(), nll.tolist())):
            line = {"doc": i, "tokens": n, "nll": x}
            if n > seq_len:
                line["window"] = seq_len
            f.write(json.dumps(line) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a published checkpoint dir (…/checkpoints/step_N) or a "
                                                 "Hugging Face Llama directory")
    parser.add_argument("--data", type=Path, required=True, help="a token file (NAME.bin) or a Megatron-LM dataset")
    parser.add_argument("--out", type=Path, required=True, help="the JSON Lines of scores to write")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a window holds (default: the model's "
                                                                  "max_seq_len)")
    parser.add_argument("--no-pack", action="store_true", help="each document in a forward of its own")
    parser.add_argument("--eos-id", type=int, default=None, help="a Megatron-LM dataset's end-of-document id")
    args = parser.parse_args(argv)
    try:
        out = output.check(args.out, inputs=[args.model, args.data])
    except output.OutputError as err:
        print(f"score: {err}", file=sys.stderr)
        return 2
    refused = memory_problem(args.model, args.seq_len, available_memory())
    if refused:
        raise SystemExit(refused)
    model, _, window = load_model(args.model, prog="score")
    model.float().eval()
    seq_len = _seq_len(args, model, window)
    tokens, starts, note = open_documents(args.data, model.cfg.vocab_size, args.eos_id)
    refused = tokenizer_refusal(args.model, tokens)
    if refused:
        raise SystemExit(refused)
    if note:
        print(note, file=sys.stderr)
    segments = None if args.no_pack else apply_document_mask([model])
    scorer = Scorer(model, tokens.tokens, starts, seq_len, segments, Progress(len(starts)))
    nll = scorer.alone() if args.no_pack else scorer.packed()
    write_scores(out, starts, len(tokens.tokens), nll, seq_len)
    predicted = len(tokens.tokens) - len(starts)
    mean = float(nll.sum()) / max(predicted, 1)
    print(f"score: {len(starts)} documents, {predicted} tokens predicted, mean nll {mean:.4f}: corpus perplexity "
          f"{math.exp(mean):.4f} ({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
