"""Parse documented tool commands with each tool's own argument parser, without running them.

    python tests/support/tool_args.py '[["tools/sample.py", ["ckpt/", "--greedy"]], ...]'

Each entry is a script path (run as ``python SCRIPT``) or ``-m MODULE``, and its arguments.
The script runs as ``__main__`` (its folder first on sys.path, as ``python SCRIPT`` puts it) up
to its first ``ArgumentParser.parse_args`` (or ``parse_known_args``): a parse that
succeeds stops it there (nothing is read or written); a refused flag, a missing positional or
a bad value ends it with argparse's own message. Prints one JSON object per entry:
``{"ok": bool, "error": str}``. One process for all entries: torch is imported once.
"""

import argparse
import contextlib
import io
import json
import sys

from run_scripts import run_as_main  # this folder, first on sys.path for a script run by its path


class Parsed(Exception):
    """Raised by the patched parse_args once the arguments were accepted."""


def _patch_argparse() -> None:
    known = argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        _, extras = known(self, args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")  # argparse's own wording
        raise Parsed

    def parse_known_args(self, args=None, namespace=None):
        known(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args


def check(target: str, args) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run_as_main(target, args)
    except Parsed:
        return {"ok": True, "error": ""}
    except SystemExit as exit_:
        return {"ok": False, "error": (err.getvalue().strip().splitlines() or [f"exit {exit_.code}"])[-1]}
    return {"ok": False, "error": "ended without parsing its arguments with argparse"}


def main() -> None:
    _patch_argparse()
    for target, args in json.loads(sys.argv[1]):
        print(json.dumps(check(target, args)), flush=True)


if __name__ == "__main__":
    main()
