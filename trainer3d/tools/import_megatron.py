"""Make a token file from a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx, as Megatron-LM,
NeMo and GPT-NeoX preprocess corpora): trainer3d/data/megatron.py.

    python tools/import_megatron.py data/web_text_document --out data/web.bin --tokenizer ~/models/Llama-3.1-8B
    python tools/import_megatron.py data/web_text_document --out data/web.bin --vocab-size 50257 --eos-id 50256

The index is checked against both files before a token is read, every id against the
vocabulary, and each document is followed by the end-of-document id (unless it ends with
it), so documents stay apart. An --out that is (or lies beside as the header of) one of the
dataset's files is refused. Train on the result with ``data=tokens data.path=data/web.bin``.
"""

import argparse
import sys


from trainer3d.data import prepare
from trainer3d.data.megatron import import_megatron, paths
from trainer3d.data.tokens import TokenFileError, bin_path, header_path
from trainer3d.tools import output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="the dataset's path prefix (or its .bin or .idx)")
    parser.add_argument("--out", required=True, help="the token file to write (.bin, with its .json header)")
    parser.add_argument("--tokenizer", help="the tokenizer.json (or a directory holding one) that made the dataset: "
                                            "recorded in the header; gives --vocab-size and --eos-id")
    parser.add_argument("--vocab-size", type=int, help="the vocabulary (default: the tokenizer's)")
    parser.add_argument("--eos-id", type=int, help="the end-of-document id (default: the tokenizer's eos)")
    args = parser.parse_args(argv)
    info = None
    try:
        inputs = [*paths(args.prefix), *([args.tokenizer] if args.tokenizer else [])]
        for out in (bin_path(args.out), header_path(args.out)):  # the token file writes both, atomically
            output.check(out, inputs)
        if args.tokenizer:
            encoder = prepare.load_tokenizer(args.tokenizer)
            info = encoder.info
            args.vocab_size = args.vocab_size or encoder.vocab_size
            args.eos_id = encoder.eos_id if args.eos_id is None else args.eos_id
        if args.vocab_size is None or args.eos_id is None:
            parser.error("give --tokenizer, or --vocab-size and --eos-id (the ids the dataset was made with)")
        header = import_megatron(args.prefix, args.out, args.vocab_size, args.eos_id, info)
    except (TokenFileError, ValueError) as err:
        print(f"import_megatron: {err}", file=sys.stderr)
        return 2
    print(f"import_megatron: {header.n_tokens:,} tokens -> {args.out} (vocab {header.vocab_size}, eos {header.eos_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
