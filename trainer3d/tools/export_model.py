"""Export a checkpoint's model (Hugging Face Llama by default): trainer3d/checkpoint/export.py.

    python tools/export_model.py outputs/.../checkpoints/step_00000300 exported/ [--dtype bf16]

The export is written into a fresh directory beside OUT_DIR and takes its place once whole
(trainer3d/tools/output.py): an OUT_DIR that already holds files is refused unless --force,
which replaces it whole; files of an earlier export are never mixed with this one's.
"""

import argparse
import sys
from pathlib import Path

from trainer3d.checkpoint.export import DTYPES, export
from trainer3d.tools import output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a published checkpoint dir (…/checkpoints/step_N)")
    parser.add_argument("out", type=Path, help="the directory to write (made; see --force)")
    parser.add_argument("--format", choices=("hf", "trainer3d"), default="hf",
                        help="hf: a Hugging Face Llama directory (default); trainer3d: this toolkit's names")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="weight dtype (default: as trained)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer directory or tokenizer.json to copy (default: the one the data records)")
    parser.add_argument("--force", action="store_true", help="replace an OUT_DIR that already holds files, whole")
    args = parser.parse_args(argv)
    try:
        out = output.check(args.out, [args.checkpoint, *([args.tokenizer] if args.tokenizer else [])],
                           directory=True, force=args.force)
        with output.new_dir(out) as tmp:
            files = export(args.checkpoint, tmp, args.format, args.dtype, int(args.max_shard_gb * 1e9),
                           args.tokenizer)
    except ValueError as err:  # OutputError included
        print(f"trainer3d: {err}", file=sys.stderr)
        return 2
    extra = [n for n in ("tokenizer.json", "tokenizer.model") if (out / n).exists()]
    print(f"exported {len(files)} file(s) to {out} ({args.format}): " + ", ".join(f.name for f in files)
          + (f"; tokenizer: {', '.join(extra)}" if extra else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
