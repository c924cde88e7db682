"""Check that two layouts train the same model: per-step losses side by side, PASS or FAIL.

    python tools/parity.py "parallel.tp=2 parallel.pp=2 parallel.dp=2"
    python tools/parity.py "parallel.tp=2 parallel.dp=4 parallel.zero_stage=1" "parallel.tp=4 parallel.dp=2" \
        --common "model=125m train.seq_len=256" --steps 30 --tol 1e-4

Run it on a new cluster, or before a long run on a new layout: layout A (first argument) and
layout B (second; default: one process, ``parallel=single``) are run one after the other
through ``python -m trainer3d.train`` for ``--steps`` steps, with the same seed, data and
global batch (``train.global_batch_size`` is kept, ``train.grad_accum_steps`` is derived for
each layout from its dp). Both configs are validated before either starts. In fp32 a correct
layout matches one process to about 1e-7 relative on CPU (floating-point reduction order);
the default tolerance is 1e-5. bf16/fp16 runs need a looser ``--tol`` (~1e-2).

Every other argument after ``--`` is passed to both runs (``launcher=slurm`` works too, with
``launcher.wait=true``). Exit status: 0 PASS, 1 FAIL (or a run failed), 2 a refused config.
The run directories are kept under ``--out`` (default: a new directory under ``parity/`` of the
current directory). An ``--out`` that already holds files (an earlier check's runs, which a
new check would resume and compare again) is refused unless ``--force``, which deletes it
first: a check reads only the runs it made itself, and ``--reuse-b``'s.

``--reuse-b DIR`` compares A with a finished run of layout B instead of running B again (the
``b`` directory of an earlier check: several layouts against one single-process reference).
DIR must have been made from the same overrides (its ``.hydra/overrides.yaml``, compared
entry for entry) and have logged ``--steps`` steps; otherwise the check is refused (exit 2).
"""

import argparse
import contextlib
import io
import os
import runpy
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from omegaconf import ListConfig, OmegaConf

from trainer3d.config.command_line import overrides_problem
from trainer3d.config.rows import read_metrics
from trainer3d.tools import output

# The directory holding the trainer3d package (a checkout, or site-packages): put first on the
# runs' PYTHONPATH, so ``python -m trainer3d.train`` is this trainer3d from any directory.
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)


def _env() -> Dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONUNBUFFERED="1",
                PYTHONPATH=PACKAGE_PARENT + (os.pathsep + path if path else ""))

# Logged every step, accumulation derived per layout; the rest comes from the user's config.
FIXED = ("train.log_every=1", "train.grad_accum_steps=null")


QUIET = ("hydra/job_logging=none", "hydra/hydra_logging=none")
"""A dry run's own overrides: Hydra leaves the logging of the process running it alone."""


def train_command(run_dir: Path, overrides: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides]


def dry_run(run_dir: Path, overrides: Sequence[str]) -> Tuple[int, str, str]:
    """``python -m trainer3d.train hydra.run.dir=<run_dir> <overrides> dry_run=true`` run to its
    end in this process as ``python -m`` runs it (``runpy``): its exit status, stdout and stderr.
    One process plans both layouts, so torch, which a dry run imports to build the model on the
    meta device, is imported once, not by an interpreter per layout."""
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    # Hydra configures no logging for it (conf/plan.yaml's choice for the planner): this process's
    # handlers and levels stay as they are; runpy puts the module's path first
    sys.argv = train_command(run_dir, [*overrides, "dry_run=true", *QUIET])[2:]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module("trainer3d.train", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if isinstance(exit_.code, str):
            err.write(exit_.code + "\n")
    except Exception:  # noqa: BLE001 - reported as the interpreter would: exit status 1, the traceback
        err.write(traceback.format_exc())
        code = 1
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def check_configs(layouts: Dict[str, Sequence[str]], runs: Dict[str, Path]) -> Dict[str, Optional[str]]:
    """Each layout's dry-run plan's first line, or None after printing why it is refused."""
    plans: Dict[str, Optional[str]] = {}
    for name, overrides in layouts.items():
        code, out, err = dry_run(runs[name], overrides)
        if code != 0:
            print(f"layout {name} is refused:\n{err.strip() or out.strip()}", file=sys.stderr)
            plans[name] = None
        else:
            plans[name] = out.splitlines()[0] if out else ""
    return plans


def run_layout(name: str, overrides: Sequence[str], run_dir: Path) -> Optional[float]:
    """Run one layout, echoing its progress lines; returns the wall time, None if it failed."""
    started = time.perf_counter()
    with open(run_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(train_command(run_dir, overrides), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=_env())
        for line in proc.stdout:
            log.write(line)
            if line.startswith("step "):
                print(f"  {name} | {line.rstrip()}", flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = run_dir.with_suffix(".log").read_text().splitlines()[-30:]
        print(f"layout {name} failed (exit {proc.returncode}); the end of its output "
              f"({run_dir.with_suffix('.log')}):\n" + "\n".join(tail), file=sys.stderr)
        return None
    return time.perf_counter() - started


def reuse_problem(run_dir: Path, overrides: Sequence[str], steps: int) -> Optional[str]:
    """Why the finished run in ``run_dir`` cannot stand for a run of ``overrides``, or None."""
    made_with = run_dir / ".hydra" / "overrides.yaml"
    if not made_with.is_file() or not (run_dir / "metrics.jsonl").is_file():
        return f"{run_dir} is not a finished run (no .hydra/overrides.yaml or metrics.jsonl)"
    try:
        made = OmegaConf.load(made_with)
        logged = len(read_losses(run_dir))
    except Exception as err:  # noqa: BLE001 - any unreadable file is refused, named
        return f"{run_dir} cannot be read ({type(err).__name__}: {err})"
    if not isinstance(made, ListConfig) or list(made) != list(overrides):
        return (f"{run_dir} was made with {' '.join(map(str, made))}; layout B here is {' '.join(overrides)}: "
                "run it again (drop --reuse-b) or pass the same overrides")
    if logged != steps:
        return f"{run_dir} logged {logged} of its {steps} steps (it did not finish): run B again (drop --reuse-b)"
    return None


def read_losses(run_dir: Path) -> List[float]:
    rows, _ = read_metrics(run_dir / "metrics.jsonl")  # a torn last line is no step
    return [row["loss"] for row in sorted(rows, key=lambda row: row["step"])]


def compare(a: List[float], b: List[float], tol: float) -> str:
    """The side-by-side table and the verdict line (ends with PASS or FAIL)."""
    lines = [f"{'step':>5}  {'loss A':>14}  {'loss B':>14}  {'rel diff':>9}"]
    worst, worst_step, first_bad = 0.0, 0, None
    for step, (x, y) in enumerate(zip(a, b)):
        rel = abs(x - y) / abs(y) if y else abs(x - y)
        if rel != rel:  # nan
            rel = float("inf")
        if rel > worst:
            worst, worst_step = rel, step
        if rel > tol and first_bad is None:
            first_bad = step
        lines.append(f"{step:>5}  {x:>14.8f}  {y:>14.8f}  {rel:>9.1e}" + ("  <-- over tolerance" if rel > tol else ""))
    if len(a) != len(b):
        lines.append(f"step counts differ: A logged {len(a)}, B logged {len(b)}")
    ok = first_bad is None and len(a) == len(b) and len(a) > 0
    verdict = (f"max relative difference {worst:.1e} at step {worst_step} (tolerance {tol:.0e}): "
               + ("PASS" if ok else "FAIL" + (f" (first over tolerance at step {first_bad})"
                                              if first_bad is not None else "")))
    return "\n".join(lines + [verdict])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("layout_a", help='overrides of layout A, e.g. "parallel.tp=2 parallel.dp=2"')
    parser.add_argument("layout_b", nargs="?", default="parallel=single",
                        help="overrides of layout B (default: one process, parallel=single)")
    parser.add_argument("--common", default="", help="overrides for both runs (model, data, batch, ...)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tol", type=float, default=1e-5, help="relative per-step loss tolerance")
    parser.add_argument("--out", type=Path, default=None, help="where the two runs go (kept)")
    parser.add_argument("--reuse-b", type=Path, default=None, metavar="DIR",
                        help="a finished run of layout B (same overrides, --steps steps) to compare with, not rerun")
    parser.add_argument("--force", action="store_true", help="delete an --out that already holds files first")
    args, passthrough = parser.parse_known_args(argv)
    passthrough = [x for x in passthrough if x != "--"]
    try:
        out = output.check(args.out or Path("parity") / time.strftime("%Y-%m-%d_%H-%M-%S"),
                           [args.reuse_b] if args.reuse_b else [], directory=True, force=args.force)
    except output.OutputError as err:
        print(f"parity: {err}", file=sys.stderr)
        return 2
    with output.new_dir(out):  # empty, in place of any earlier check's runs (--force)
        pass
    common = [*shlex.split(args.common), *passthrough, f"train.max_steps={args.steps}", *FIXED]
    layouts = {"A": [*common, *shlex.split(args.layout_a)], "B": [*common, *shlex.split(args.layout_b)]}

    runs = {"A": out / "a", "B": args.reuse_b or out / "b"}
    if args.reuse_b:
        problem = reuse_problem(args.reuse_b, layouts["B"], args.steps)
        if problem:
            print(f"--reuse-b is refused: {problem}", file=sys.stderr)
            return 2
    to_run = {name: overrides for name, overrides in layouts.items() if not (name == "B" and args.reuse_b)}
    for name, overrides in to_run.items():  # the entry point's own check, before any dry run starts
        problem = overrides_problem("config", overrides)
        if problem:
            print(f"trainer3d: config error: layout {name}: {problem}", file=sys.stderr)
            return 2
    plans = check_configs(to_run, runs)
    if None in plans.values():
        return 2
    for name in layouts:
        plan = plans.get(name, f"reused: {args.reuse_b}")
        print(f"layout {name}: {args.layout_a if name == 'A' else args.layout_b}\n          {plan}")
    print(f"common:   {' '.join(common)}\nruns in:  {out}")
    for name, overrides in to_run.items():
        print(f"running layout {name} ...", flush=True)
        wall = run_layout(name, overrides, runs[name])
        if wall is None:
            return 1
        print(f"layout {name}: {args.steps} steps in {wall:.1f} s")
    report = compare(read_losses(runs["A"]), read_losses(runs["B"]), args.tol)
    with output.new_file(out / "parity.txt") as tmp:
        tmp.write_text(report + "\n")
    print(report)
    return 0 if report.endswith("PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
