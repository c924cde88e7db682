#!/usr/bin/env python
"""Preempt a Slurm run again and again; prove it loses no step and say how long each restart took.

    python tools/bench/preemption_chaos.py [--signals 5] [--steps 60] [--every 4]

Needs a Slurm cluster (slurm/cluster.sh start: the dev cluster on this machine; SLURM_CONF
as ``slurm/cluster.sh env`` prints). It trains the same run twice, pp2 on two tasks:

- the reference, uninterrupted, on local ranks (``launcher=local``);
- the chaos run, as a Slurm job with checkpoints in the background every ``--every`` steps:
  once it has trained ``--gap`` steps since it last (re)started, ``scancel --signal=USR2``
  (what Slurm sends before a time limit or a preemption), ``--signals`` times in a row. Each
  time the ranks agree on a step boundary, wait for a save in flight, save, and the job
  requeues and resumes from that checkpoint (docs/checkpoints.md).

It prints, per signal, the step the ranks stopped after and the seconds from the signal to
the resumed run's first new metrics row (training again), then whether every step's loss
equals the reference's — the final loss identical, no step lost or repeated — and exits
non-zero where it does not.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer3d.rank.preemption import REQUEUE_ASKED  # noqa: E402  (the stop line's end, before the requeue)
from trainer3d.tools import output  # noqa: E402

MODEL = ("train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=16",
         "train.grad_accum_steps=null", "optim.warmup_steps=5", "train.log_every=1", "parallel.timeout_s=60",
         "parallel=single", "parallel.pp=2", "logger.mode=disabled")


def _train(run_dir: Path, *overrides: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *MODEL, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _rows(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _rank0_log(run_dir: Path, job: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob(f"{job}_0_log.*")))


def _queued(job: str) -> bool:
    """Whether Slurm still holds ``job`` (pending, running, requeued). A query that fails — a
    controller busy on a loaded machine — is asked again rather than read as "ended"."""
    for _ in range(10):
        proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        if proc.returncode == 0:
            return bool(proc.stdout.strip())
        if "Invalid job id" in proc.stderr:
            return False
        time.sleep(1)
    return True


def _diagnosis(run_dir: Path, job: str) -> str:
    """What a failed wait reports: Slurm's record of the job and the end of rank 0's log."""
    sacct = subprocess.run(["sacct", "-j", job, "-n", "-P", "-o", "JobID,State,ExitCode,Restarts"],
                           capture_output=True, text=True)
    return f"sacct: {(sacct.stdout or sacct.stderr).strip()}\nrank 0's log, its end:\n{_rank0_log(run_dir, job)[-3000:]}"


def _wait(what: str, ready, timeout: float, job: Optional[str] = None, run_dir: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        ended = job is not None and not _queued(job)
        if ended and ready():  # it happened just before the job ended
            return
        if time.monotonic() > deadline or ended:
            why = "the job ended first" if ended else f"not within {timeout:.0f} s"
            raise SystemExit(f"preemption_chaos: {what} did not happen ({why})"
                             + (f"\n{_diagnosis(run_dir, job)}" if job is not None and run_dir is not None else ""))
        time.sleep(0.1)


def chaos(run_dir: Path, signals: int, steps: int, every: int, gap: int) -> List[dict]:
    """Run the Slurm job and preempt it ``signals`` times; one record per signal."""
    proc = _train(run_dir, f"train.max_steps={steps}", f"checkpoint.every={every}", "launcher=slurm",
                  "launcher.wait=false", f"launcher.max_requeues={signals + 1}", timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"preemption_chaos: submitting failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    job = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    records = []
    for i in range(signals):
        start = records[-1]["stopped_after"] if records else 0
        _wait(f"step {start + gap}", lambda start=start: len(_rows(run_dir)) >= start + gap, 600, job, run_dir)
        sent = time.monotonic()
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        _wait(f"the stop after signal {i + 1}", lambda i=i: _rank0_log(run_dir, job).count(REQUEUE_ASKED) > i, 300,
              job, run_dir)
        stopped = int(_rank0_log(run_dir, job).split(REQUEUE_ASKED)[i].rsplit("stopped after step ", 1)[1].split()[0])
        _wait(f"the resume after signal {i + 1}", lambda i=i: _rank0_log(run_dir, job).count("resumed from") > i, 300,
              job, run_dir)
        resumed = time.monotonic()
        _wait(f"a step after resume {i + 1}",
              lambda stopped=stopped: (lambda rows: len(rows) > stopped and rows[-1]["step"] >= stopped)(_rows(run_dir)),
              300, job, run_dir)
        records.append({"signal": i + 1, "stopped_after": stopped, "to_resumed_s": resumed - sent,
                        "to_training_s": time.monotonic() - sent})
        print(f"signal {i + 1}: stopped after step {stopped}; resumed {resumed - sent:.1f} s after the signal, "
              f"training again (first new row) {records[-1]['to_training_s']:.1f} s after it", flush=True)
    _wait("the end of the job", lambda: not _queued(job), 1800)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--signals", type=int, default=5, help="preemptions in a row")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=4, help="checkpoint.every (saves in the background)")
    parser.add_argument("--gap", type=int, default=8, help="steps trained after each (re)start before the next signal")
    parser.add_argument("--dir", type=Path, default=None, help="where the two runs go (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.gap * args.signals + 2 > args.steps:
        parser.error(f"--steps {args.steps} leaves no room for {args.signals} signals {args.gap} steps apart")
    try:  # an earlier drill's runs would be resumed and compared again: refused unless empty
        base = output.check(args.dir, directory=True) if args.dir else Path(tempfile.mkdtemp(prefix="preemption-chaos-"))
    except output.OutputError as err:
        print(f"preemption_chaos: {err}", file=sys.stderr)
        return 2
    reference = _train(base / "reference", f"train.max_steps={args.steps}", "launcher=local")
    if reference.returncode != 0:
        raise SystemExit(f"preemption_chaos: the reference run failed:\n{reference.stderr[-3000:]}")
    records = chaos(base / "chaos", args.signals, args.steps, args.every, args.gap)
    got, want = _rows(base / "chaos"), _rows(base / "reference")
    lossless = [r["step"] for r in got] == list(range(args.steps)) and \
        [r["loss"] for r in got] == [r["loss"] for r in want]
    worst = max(r["to_training_s"] for r in records)
    print(f"{len(records)} preemptions; signal to training again: worst {worst:.1f} s, "
          f"mean {sum(r['to_training_s'] for r in records) / len(records):.1f} s (target <= 60 s)")
    print(f"final loss {got[-1]['loss']:.6f} vs uninterrupted {want[-1]['loss']:.6f}: "
          + ("every step identical, none lost or repeated" if lossless else "DIFFERENT: a step was lost or changed"))
    with output.new_file(base / "chaos" / "preemption_chaos.json") as tmp:
        tmp.write_text(json.dumps({"records": records, "lossless": lossless}))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
