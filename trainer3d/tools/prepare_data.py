"""Build a token file from text files, directories and JSON Lines, for ``data=tokens data.path=<out.bin>``.

    python tools/prepare_data.py --out data/corpus.bin my_texts/ notes.md          # byte level (vocab 257)
    python tools/prepare_data.py --out data/web.bin --tokenizer path/to/hf_model_dir web.jsonl.zst --workers 8
    python tools/prepare_data.py --out data/code.bin --train-tokenizer 8192 src/     # train a BPE first
    python -m trainer3d.train data=tokens data.path=data/web.bin model.vocab_size=<its vocab_size>
    python tools/prepare_data.py --chat --tokenizer path/to/instruct_model_dir --out data/sft.bin chats.jsonl

Inputs: files and directories (walked recursively for --suffixes), plain or compressed
(.gz, .zst); a text file is one document, a line of a .jsonl file one document (its text
under --text-key). The tokenizer's end-of-document id follows every document, and where each
document starts is written beside the ids (<out>.docs and <out>.docs.json, for data.document_mask). Without
--tokenizer the tokens are byte-level, as the built-in corpus (``model=tiny`` trains on it
as is); --tokenizer takes a tokenizer.json or a directory holding one (a Hugging Face
model directory); --chat reads conversations instead (JSON Lines of {"messages": [{"role",
"content"}, ...]}), renders each with the tokenizer's own chat template in Jinja2's sandbox and
writes a loss mask beside the ids (<out>.mask: 1 on the assistant's tokens; --train-on all keeps
every token) for data.loss_mask=true (trainer3d/data/chat.py); --train-tokenizer VOCAB trains a byte-level BPE on the inputs first and
saves it beside the token file (<out>.tokenizer.json). Input files are read in sorted
order, so the output is reproducible. The input streams through --workers processes:
memory stays bounded whatever the input size.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Optional


from trainer3d.data import chat, prepare
from trainer3d.data.doc_index import index_header_path, index_path
from trainer3d.data.documents import (JSONL_SUFFIXES, TRAINED_TOKENIZER_SUFFIX, InputError, Progress, collect,
                                      documents, kind_suffix)
from trainer3d.data.loss_mask import mask_header_path, mask_path
from trainer3d.data.tokens import TokenFileError, bin_path, header_path
from trainer3d.tools import output


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


class ProgressBar:
    """One line on stderr: rewritten in place in a terminal, a new line every 10% otherwise."""

    def __init__(self, progress: Progress, label: str, stream=sys.stderr):
        self.progress, self.label, self.stream = progress, label, stream
        self.live = stream.isatty()
        self.started = self._shown = time.perf_counter()
        self._tenth = -1

    def __call__(self, n_tokens: Optional[int] = None) -> None:
        now, done, total = time.perf_counter(), self.progress.read, max(1, self.progress.total)
        tenth = int(10 * done / total)
        if (self.live and now - self._shown < 0.5) or (not self.live and tenth == self._tenth):
            return
        self._shown, self._tenth = now, tenth
        rate = done / max(now - self.started, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0
        filled = int(30 * done / total)
        line = (f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {100 * done / total:3.0f}% "
                f"{format_bytes(done)}/{format_bytes(total)}" + ("" if n_tokens is None else f" | {n_tokens:,} tokens")
                + f" | eta {eta:.0f}s")
        self.stream.write(("\r\x1b[2K" + line) if self.live else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="text or .jsonl files (maybe .gz/.zst) or directories")
    parser.add_argument("--out", required=True, help="output token file (.bin; a .json header is written beside it)")
    parser.add_argument("--tokenizer", help="tokenizer.json, or a directory holding one (default: byte level)")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                        help="train a byte-level BPE with VOCAB ids on the inputs first (saved as <out>.tokenizer.json)")
    parser.add_argument("--eos-token", help="end-of-document token (default: the tokenizer's eos_token, "
                                            "or one of <|endoftext|>, </s>, <|end_of_text|>, <eos>)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary recorded in the header (default: the "
                                                       "tokenizer's); ids at or above it are refused")
    parser.add_argument("--text-key", default="text", help="key of the text in JSON Lines records (default: text)")
    parser.add_argument("--chat", action="store_true",
                        help="the inputs are conversations (JSON Lines of {\"messages\": [{\"role\", \"content\"}, ...]}): "
                             "rendered with --tokenizer's chat template, with a loss mask written beside the ids")
    parser.add_argument("--train-on", choices=chat.TRAIN_ON, default="assistant",
                        help="with --chat: the tokens the loss mask keeps (default: %(default)s; all: every token)")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (default: 1)")
    parser.add_argument("--suffixes", default=".txt,.md,.py,.rst,.json," + ",".join(JSONL_SUFFIXES),
                        help="file suffixes taken from directories, before any .gz/.zst; an empty entry takes "
                             "files without one (README, LICENSE): e.g. --suffixes .txt,.md, (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.tokenizer and args.train_tokenizer:
        parser.error("give --tokenizer or --train-tokenizer, not both")
    if args.chat and not args.tokenizer:
        parser.error("--chat renders with a tokenizer's own chat template: give --tokenizer a directory holding "
                     "tokenizer.json and its chat template (tokenizer_config.json or chat_template.jinja)")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


def build_encoder(args, files):
    if args.train_tokenizer:
        out = bin_path(args.out).with_suffix(TRAINED_TOKENIZER_SUFFIX)
        out.parent.mkdir(parents=True, exist_ok=True)
        progress = Progress(files)
        bar = ProgressBar(progress, "training tokenizer")
        texts = prepare.texts_of(documents(files, args.text_key, progress))
        prepare.train_tokenizer((bar() or t for t in texts), args.train_tokenizer, out)
        bar.close()
        print(f"prepare_data: trained a byte-level BPE of {args.train_tokenizer} ids -> {out}")
        return prepare.load_tokenizer(str(out), args.eos_token or prepare.TRAINED_EOS)
    if args.tokenizer:
        return prepare.load_tokenizer(args.tokenizer, args.eos_token)
    return prepare.BYTE_ENCODER


def check_outputs(args) -> None:
    """Every file this command writes (the token file, its header, a trained tokenizer) is none
    of the inputs and lies in none of the input directories (trainer3d/tools/output.py)."""
    inputs = [*args.inputs, *([args.tokenizer] if args.tokenizer else [])]
    written = [bin_path(args.out), header_path(args.out), index_path(args.out), index_header_path(args.out)]
    if args.train_tokenizer:
        written.append(bin_path(args.out).with_suffix(TRAINED_TOKENIZER_SUFFIX))
    if args.chat:
        written += [mask_path(args.out), mask_header_path(args.out)]
    for out in written:
        output.check(out, inputs)


def prepare_chat(args, files, encoder, progress):
    """--chat: the conversations of ``files`` -> the token file and its loss mask; the token header."""
    not_jsonl = [str(f) for f in files if kind_suffix(f) not in JSONL_SUFFIXES]
    if not_jsonl:
        raise InputError(f"--chat reads JSON Lines ({', '.join(JSONL_SUFFIXES)}, maybe .gz/.zst); not one: "
                         f"{', '.join(not_jsonl[:3])}")
    tokenizer_dir = Path(args.tokenizer).expanduser()
    template = chat.load_chat_template(tokenizer_dir if tokenizer_dir.is_dir() else tokenizer_dir.parent)
    header, mask = chat.prepare_chat(chat.conversations(files, progress), Path(args.out), encoder, template,
                                     args.train_on, args.workers, args.vocab_size)
    print(f"prepare_data: loss mask {mask_path(args.out)}: {mask.kept:,} of {mask.n_tokens:,} tokens trained on "
          f"(--train-on {args.train_on}; chat template of {template.where})")
    return header


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_outputs(args)
        out = bin_path(args.out)
        outputs = [out, header_path(out), index_path(out), index_header_path(out),
                   out.with_suffix(TRAINED_TOKENIZER_SUFFIX), mask_path(out), mask_header_path(out)]
        files = collect(args.inputs, set(args.suffixes.split(",")), outputs)
        if not files:
            raise InputError("no input files found (check the paths and --suffixes)")
        encoder = build_encoder(args, files)
        progress = Progress(files)
        bar = ProgressBar(progress, "encoding")
        started = time.perf_counter()
        if args.chat:
            header = prepare_chat(args, files, encoder, progress)
        else:
            header = prepare.prepare(documents(files, args.text_key, progress), Path(args.out), encoder,
                                     args.workers, args.vocab_size, on_tokens=bar)
        bar.close()
    except (InputError, TokenFileError, ValueError) as err:
        print(f"prepare_data: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # e.g. an unreadable input or a full disk: the file and the reason, no traceback
        print(f"prepare_data: {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    print(f"prepare_data: {len(files)} files, {format_bytes(progress.total)} -> {header.n_tokens:,} tokens "
          f"(vocab {header.vocab_size}, {header.dtype}, max id {header.max_id}, tokenizer {header.tokenizer.name}) "
          f"in {bin_path(args.out)}; {seconds:.1f} s with {args.workers} worker(s): "
          f"{header.n_tokens / seconds:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
