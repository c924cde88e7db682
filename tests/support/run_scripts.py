"""Run scripts and modules to their end, one after another, in this one process.

    python tests/support/run_scripts.py '[["tools/sample.py", ["ckpt/", "--greedy"]], ["-m trainer3d.plan", ["--help"]]]'

Each entry is a script path (run as ``python SCRIPT`` runs it: as ``__main__``, its folder first
on sys.path) or ``-m MODULE``, and its arguments. Prints one JSON object per entry:
``{"code": exit status, "stdout": ..., "stderr": ...}``; an exception other than SystemExit is
exit status 1 with its traceback on stderr, as Python reports it. torch is imported once for all
the entries, not once per process (a second or more each on a loaded 2-core machine).

A test runs its entries with ``run_all`` (one fresh interpreter, one ``CompletedProcess`` per
entry); the entries run in their order, so one may read what an earlier one wrote.
"""

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
from typing import List, Optional, Sequence


def run_as_main(target: str, args) -> None:
    """Run ``target`` (a script's path, or ``-m MODULE``) with ``args`` as ``python`` runs it:
    as ``__main__``, ``sys.argv`` set, a script's folder first on ``sys.path`` (tool_args.py too);
    ``sys.path`` as it was after."""
    module = target[3:] if target.startswith("-m ") else None
    sys.argv = [module or target, *args]
    path = sys.path[:]  # a script may put its own folder first too (tools/prepare_data.py does)
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            return
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    finally:
        sys.path[:] = path


def run(target: str, args) -> dict:
    """``target`` run to its end with ``args`` in this process (``run_as_main``), its exit status,
    stdout and stderr; this process's ``sys.argv`` as it was after."""
    out, err, code, argv = io.StringIO(), io.StringIO(), 0, sys.argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_as_main(target, args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 (reported as the interpreter reports it)
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = argv
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def run_here(target: str, args: Sequence) -> subprocess.CompletedProcess:
    """``run`` as a ``CompletedProcess``, its exit status, and what the script itself printed, as
    ``subprocess.run([sys.executable, target, *args], capture_output=True, text=True)`` has
    them, without an interpreter of its own: the test's torch and engine serve the script, and a
    script's ``run_ranks`` forks its ranks from this process's forkserver
    (trainer3d/launch/local_ranks.py), which unpickles the script's rank functions by
    re-importing it as ``__mp_main__``. What the ranks print goes where the forkserver's output
    goes, not into the result (a rank's traceback still arrives through ``run_ranks``). For
    scripts that leave this process as they found it: no environment or torch settings of their
    own, and no thread that outlives a timeout the test gives it."""
    args = [str(a) for a in args]
    done = run(str(target), args)
    return subprocess.CompletedProcess([str(target), *args], done["code"], done["stdout"], done["stderr"])


def run_all(entries: Sequence, cwd=None, umask: Optional[int] = None,
            timeout: float = 600, env: Optional[dict] = None) -> List[subprocess.CompletedProcess]:
    """Run ``entries`` (``[target, args]`` pairs as above; ``args`` made strings) in one fresh
    interpreter started as ``python tests/support/run_scripts.py`` in ``cwd`` (with ``umask`` and
    the environment ``env`` where given): each entry's exit status, stdout and stderr as a
    ``CompletedProcess`` of its own."""
    entries = [[str(target), [str(a) for a in args]] for target, args in entries]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(entries)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
    done = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(done) == len(entries), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [subprocess.CompletedProcess([target, *args], d["code"], d["stdout"], d["stderr"])
            for (target, args), d in zip(entries, done)]


def main() -> None:
    for target, args in json.loads(sys.argv[1]):
        print(json.dumps(run(target, args)), flush=True)


if __name__ == "__main__":
    main()
