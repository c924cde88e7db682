"""A new GPU node's first check, one command: ``trainer3d-gpu-check`` (``python -m trainer3d.tools.gpu_check``).

    trainer3d-gpu-check                       # every check on the GPUs this node has
    trainer3d-gpu-check --list                # the checks, one a line
    trainer3d-gpu-check --only resume,mfu --out report.json

On whatever GPUs are visible, in at most about 8 minutes on one GPU (each check has a time
limit; ``--tier-timeout`` sets the longest, the tier's: 300 s on one GPU, 1800 s with more):

    tier     the GPU tier, ``pytest -m gpu tests/gpu`` in a subprocess: on a node of several GPUs
             all of it (the multi-GPU parity matrix's cases that fit the node), on one GPU the
             tests not marked ``slow`` (``--full-tier``: all); a checkout's tests/ is needed
    resume   a bf16 run of 20 steps saving at step 10 in the background, resumed from that save
             in a new run: the resumed steps' losses equal the uninterrupted run's (to 1e-3:
             CUDA's atomic sums in attention's backward; bit for bit where none run)
    mfu      a short bf16 + torch.compile run of the 1.3B model (one GPU, 2,048 tokens a
             sequence): tokens/s and MFU of its last steps
    planner  the planner's prediction of that run, from the GPU's preset and from the preset
             calibrated on this GPU (``python -m trainer3d.plan --calibrate``'s figures), and
             each one's error against the measured tokens/s

Prints a one-screen summary and writes a JSON report (``--out``); the runs, the tier's log and
the calibrated preset stay beside it in ``<out stem>-runs/``. Exit status: 0 when no
check failed, 1 when one did, 2 without a CUDA device (said in one line) or on bad arguments.
docs/gpu.md, "The first hour on a new cluster".
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence
from xml.etree import ElementTree

import torch

from trainer3d.checkpoint import store
from trainer3d.config.rows import read_metrics
from trainer3d.config.schema import Config
from trainer3d.plan.calibrate_gpu import calibrated_device, measure, preset_for
from trainer3d.plan.devices import PRESETS
from trainer3d.plan.evaluate import evaluate_layout, summary
from trainer3d.plan.probe import training_config
from trainer3d.plan.settings import PlanConfig
from trainer3d.tools import output
from trainer3d.tools.parity import PACKAGE_PARENT, read_losses, train_command

CHECKS = {
    "tier": "the GPU tier: pytest -m gpu tests/gpu (multi-GPU cases as the node's GPUs allow)",
    "resume": "bf16 20 steps with a background save at step 10, resumed: the same losses (1e-3)",
    "mfu": "bf16 + compile, 1.3B model, one GPU: tokens/s and MFU",
    "planner": "the planner's tokens/s for the mfu run (preset and calibrated) against the measured",
}
NO_CUDA = "trainer3d-gpu-check: no CUDA device visible (torch.cuda.is_available() is False); run it on a GPU node"
TINY = ("train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null",
        "train.log_every=1", "optim.warmup_steps=5", "parallel=single", "train.device=cuda")
MFU_RUN = ("model=1.3b", "train.seq_len=2048", "train.micro_batch_size=2", "train.global_batch_size=8",
           "train.grad_accum_steps=null", "train.dtype=bf16", "train.compile=true", "train.max_steps=12",
           "train.log_every=1", "train.eval_every=0", "checkpoint.save_final=false", "parallel=single",
           "train.device=cuda")
RESUME_REL_TOL = 1e-3
"""The resumed steps against the uninterrupted run's. The same arithmetic gives the same bits,
except where a CUDA kernel sums in a varying order (the memory-efficient and flash attention
backward accumulate with atomics: torch's reproducibility notes); a state restored wrongly (a
moment reset, a master weight lost) moves bf16 losses by far more."""
MFU_STEPS_READ = 5
"""The last steps the mfu check reads (the first ones compile)."""


@dataclass
class Result:
    """One check's outcome: ``status`` pass | fail | skip."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0
    figures: Dict[str, float] = field(default_factory=dict)


def summarise(results: Sequence[Result], gpu: str) -> tuple:
    """(the one-screen summary text, the JSON report) of a set of results."""
    lines = [f"trainer3d GPU check on {gpu}", ""]
    for r in results:
        lines.append(f"  {r.status.upper():4s}  {r.name:8s} {r.seconds:6.0f} s  {r.detail}")
    failed = [r.name for r in results if r.status == "fail"]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all checks passed" + (
        f" ({sum(r.status == 'skip' for r in results)} skipped)" if any(r.status == "skip" for r in results) else "")
    lines += ["", verdict]
    report = {"gpu": gpu, "ok": not failed, "checks": [asdict(r) for r in results]}
    return "\n".join(lines), report


def _env() -> Dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE=os.environ.get("WANDB_MODE", "offline"),
                PYTHONPATH=PACKAGE_PARENT + (os.pathsep + path if path else ""))


def _train(run_dir: Path, overrides: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_command(run_dir, overrides), capture_output=True, text=True, timeout=timeout,
                          env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"python -m trainer3d.train {' '.join(overrides)} exited {proc.returncode}: "
                           + (proc.stderr.strip().splitlines() or ["(no output)"])[-1])
    return proc


def _rows(run_dir: Path) -> List[dict]:
    return read_metrics(run_dir / "metrics.jsonl")[0]  # a torn last line is no step


def check_tier(work: Path, timeout: float, marks: str) -> Result:
    tests = Path(PACKAGE_PARENT) / "tests" / "gpu"
    if not tests.is_dir():
        return Result("tier", "skip", f"no {tests}: the tier is in a checkout of the repository, not the install")
    junit = work / "tier.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", marks, "-q", "-n", "0", "-p", "no:cacheprovider",
           f"--junitxml={junit}", str(tests)]
    with open(work / "tier.log", "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=PACKAGE_PARENT,
                                  env=_env())
        except subprocess.TimeoutExpired:
            return Result("tier", "fail", f"timed out after {timeout:.0f} s (--tier-timeout; log {work / 'tier.log'})")
    if not junit.is_file():
        return Result("tier", "fail", f"pytest exited {proc.returncode} with no report (log {work / 'tier.log'})")
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    return Result("tier", "fail" if bad or proc.returncode not in (0, 5) else "pass",
                  f"{passed} passed, {bad} failed, {counts['skipped']} skipped (log {work / 'tier.log'})",
                  figures={"passed": passed, "failed": bad, "skipped": counts["skipped"]})


def check_resume(work: Path, timeout: float) -> Result:
    base = [*TINY, "train.dtype=bf16", "train.max_steps=20", "checkpoint.every=10", "checkpoint.async_save=true"]
    _train(work / "whole", base, timeout / 2)
    step_10 = store.step_dir(work / "whole" / "checkpoints", 10)
    if not step_10.is_dir():
        return Result("resume", "fail", f"no step-10 checkpoint: {step_10}")
    _train(work / "resumed", [*base, f"train.resume={step_10}"], timeout / 2)
    whole, resumed = read_losses(work / "whole"), read_losses(work / "resumed")
    if len(resumed) != 10:
        return Result("resume", "fail", f"the resumed run logged {len(resumed)} steps, not steps 10-19")
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, whole[10:]))
    ok = worst <= RESUME_REL_TOL
    return Result("resume", "pass" if ok else "fail",
                  ("steps 10-19 bit-identical after the resume" if worst == 0 else
                   f"steps 10-19 within {worst:.1e} of the uninterrupted run") if ok else
                  f"resumed losses differ by up to {worst:.1e}: {resumed[:3]} vs {whole[10:13]} ...",
                  figures={"steps_compared": len(resumed), "worst_relative_difference": worst})


def check_mfu(work: Path, timeout: float) -> Result:
    _train(work / "mfu", MFU_RUN, timeout)
    last = _rows(work / "mfu")[-MFU_STEPS_READ:]
    tokens = statistics.median(r["tokens_per_s_per_rank"] for r in last)
    mfu = statistics.median(r.get("mfu", float("nan")) for r in last)
    return Result("mfu", "pass", f"{tokens:,.0f} tokens/s, MFU {mfu:.1%} (median of the last {len(last)} steps)",
                  figures={"tokens_per_s_per_gpu": tokens, "mfu": mfu})


def planner_errors(measured: float, predicted: Dict[str, float]) -> Dict[str, float]:
    """Each prediction's relative error against the measured tokens/s (+: over-predicted)."""
    return {name: value / measured - 1 for name, value in predicted.items()}


def plan_of(cfg, gpu: str):
    """The planner's config of a training config run on one GPU of preset ``gpu``."""
    plan = PlanConfig(**{f.name: getattr(cfg, f.name) for f in fields(Config)})
    plan.cluster.gpu, plan.cluster.nodes, plan.cluster.gpus_per_node, plan.cluster.attention = gpu, 1, 1, "flash"
    plan.plan.evaluate = True
    return plan


def check_planner(work: Path, measured: Optional[float]) -> Result:
    if measured is None:
        return Result("planner", "skip", "needs the mfu check's measurement")
    props = torch.cuda.get_device_properties(0)
    key = preset_for(props.name, props.total_memory / 2 ** 30)
    if key is None:
        return Result("planner", "skip", f"no planner preset for {props.name} (trainer3d/plan/devices.py)")
    calibrated = calibrated_device(PRESETS[key], measure(PRESETS[key]))
    cfg = plan_of(training_config([o for o in MFU_RUN if not o.startswith(("train.device", "train.compile"))]), key)
    predicted = {name: summary(cfg, device, evaluate_layout(cfg, device))["tokens_per_s_per_gpu"]
                 for name, device in ((key, PRESETS[key]), ("calibrated", calibrated))}
    errors = planner_errors(measured, predicted)
    calibration = work / "calibration.json"  # what cluster.gpu=calibrated cluster.calibration=<it> reads
    calibration.write_text(json.dumps(asdict(calibrated), indent=1) + "\n")
    return Result("planner", "pass", ", ".join(f"{n}: {predicted[n]:,.0f} tokens/s ({e:+.1%})" for n, e in errors.items())
                  + f"; preset calibrated: {calibration}",
                  figures={**{f"predicted_{n}": v for n, v in predicted.items()},
                           **{f"error_{n}": e for n, e in errors.items()}})


def run_checks(names: Sequence[str], work: Path, tier_timeout: float, tier_marks: str) -> List[Result]:
    results: List[Result] = []
    measured: List[Optional[float]] = [None]

    def mfu(w: Path) -> Result:
        result = check_mfu(w, 240)
        measured[0] = result.figures["tokens_per_s_per_gpu"]
        return result
    runs: Dict[str, Callable[[Path], Result]] = {
        "tier": lambda w: check_tier(w, tier_timeout, tier_marks), "resume": lambda w: check_resume(w, 120),
        "mfu": mfu, "planner": lambda w: check_planner(w, measured[0])}
    for name in names:
        started = time.perf_counter()
        print(f"running {name}: {CHECKS[name]} ...", flush=True)
        try:
            result = runs[name](work)
        except Exception as err:  # noqa: BLE001 - a check that breaks is reported, the others still run
            result = Result(name, "fail", f"{type(err).__name__}: {err}")
        result.seconds = time.perf_counter() - started
        results.append(result)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer3d-gpu-check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--list", action="store_true", help="print the checks, one a line, and exit")
    parser.add_argument("--only", default=",".join(CHECKS), help="checks to run, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="the JSON report")
    parser.add_argument("--tier-timeout", type=float, default=0,
                        help="seconds for the tier's pytest (default: 300 on one GPU, 1800 with more)")
    parser.add_argument("--force", action="store_true",
                        help="delete the runs of an earlier check (beside --out) first, instead of refusing")
    parser.add_argument("--full-tier", action="store_true",
                        help="the whole tier on one GPU too (default there: its tests not marked slow)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{name:8s} {what}" for name, what in CHECKS.items()))
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a check; the checks: {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    gpu = f"{gpus} x {torch.cuda.get_device_name(0)}"
    full = args.full_tier or gpus > 1  # one GPU: the quick part fits the 8 minutes; a node of several runs it all
    tier_timeout = args.tier_timeout or (300 if not full else 1800)  # the multi-GPU matrix starts 8-rank runs
    work = args.out.parent / f"{args.out.stem}-runs"  # kept: the runs and the tier's log, for a failure's reader
    try:  # an earlier check's runs would be resumed, not run: this check reads only what it made
        output.check(args.out)
        output.check(work, directory=True, force=args.force)
    except output.OutputError as err:
        print(f"trainer3d-gpu-check: {err}", file=sys.stderr)
        return 2
    with output.new_dir(work):
        pass
    results = run_checks(names, work, tier_timeout, "gpu" if full else "gpu and not slow")
    text, report = summarise(results, gpu)
    with output.new_file(args.out) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{text}\nreport: {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
