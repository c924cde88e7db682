"""Run the real entry point (``python -m trainer3d.train``) and read back its metrics.

Parity tests compare a layout's per-step losses with a single-process run of the same
config; the single-process reference for a given set of overrides is run once per test
session and shared.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

# Small enough for 2 cores: 20 steps of 16 sequences x 64 tokens, loss logged every step.
PARITY = ("train.max_steps=20", "train.log_every=1", "train.seq_len=64", "train.micro_batch_size=2",
          "train.global_batch_size=16", "train.grad_accum_steps=null", "optim.warmup_steps=5",
          "parallel.timeout_s=60")

REL_TOL = 1e-5

_REFERENCE_CACHE: Dict[Tuple[str, ...], List[dict]] = {}


class RunFailed(AssertionError):
    pass


def run_train(run_dir: Path, overrides: Sequence[str], timeout: float = 600,
              expect_ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if expect_ok and proc.returncode != 0:
        raise RunFailed(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                        f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path, overrides: Sequence[str], timeout: float = 600) -> List[float]:
    run_train(run_dir, overrides, timeout)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows))), "metrics rows must be one per step, in order"
    return [r["loss"] for r in rows]


def reference_losses(tmp_root: Path, overrides: Sequence[str]) -> List[float]:
    """Losses of the 1-rank run of ``overrides`` (cached for the session)."""
    key = tuple(overrides)
    if key not in _REFERENCE_CACHE:
        run_dir = Path(tmp_root) / f"reference-{len(_REFERENCE_CACHE)}"
        _REFERENCE_CACHE[key] = losses(run_dir, [*overrides, "parallel=single"])
    return _REFERENCE_CACHE[key]


def assert_parity(got: List[float], ref: List[float], rel_tol: float = REL_TOL) -> float:
    """Every step's loss within ``rel_tol`` of the reference; returns the worst relative diff."""
    assert len(got) == len(ref) >= 20, (len(got), len(ref))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    table = "\n".join(f"  step {i:2d}: {a:.8f} vs {b:.8f}" for i, (a, b) in enumerate(zip(got, ref)))
    assert worst <= rel_tol, f"max relative loss difference {worst:.2e} > {rel_tol:.0e}\n{table}"
    assert ref[-1] < ref[0], "the reference loss should fall"
    return worst
