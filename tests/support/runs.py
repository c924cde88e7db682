"""Run the real entry point (``python -m trainer3d.train``), or its work on in-process ranks,
and read back the metrics.

Parity tests compare a layout's per-step losses with a single-process run of the same
config; the single-process reference for a given set of overrides is run once per test
session (on one in-process rank) and shared by the session's workers (pytest-xdist): the
first to need it runs it under a file lock in the session directory, the others read its
losses.

``train_in_ranks`` does what the entry point does for a local run — compose the config from
conf/ with the same overrides, ``model.init_from``, ``validate``, ``check_data``, then
``TrainTask`` on every rank — with the ranks forked from the harness's forkserver (torch and
the engine imported once per session) instead of fresh interpreters started by submitit.
The layouts' parity tests use it; the launcher itself keeps its own end-to-end tests.

How a parity run splits its global batch is decided here, once (``parity_micro_batches``): a
step's cost on CPU ranks follows its micro-batches (each is a round of collectives the ranks wait
on each other for), not its tokens, so a run that starts with ``PARITY`` and does not choose its
own split takes the 16 sequences in the fewest micro-batches per rank that still exercise what
it proves: 2 where pp = 1 (gradient accumulation across micro-batches, ZeRO-2/3's and offload's
included), one per stage in flight where pp > 1 (the schedule's pipe filled once; dualpipev's
two stages per rank: 2 pp), never more than PARITY's micro-batch of 2 gives. The 1-rank reference
takes 2 micro-batches of 8: fp32's loss of a global batch does not depend on its split beyond
reduction order (~1e-7), so one reference per model and data serves every layout. It is applied
in ``configure`` (every in-process run, references included) rather than in ``PARITY`` because
the split depends on the layout the test adds after it; ``run_train`` (the entry point's own
tests) takes PARITY as it reads.

Two fixed costs of a run that no parity check reads are left out of a PARITY run on in-process
ranks, also in ``configure`` (``PARITY_RUN_DEFAULTS``), unless its overrides set the knob: the
final checkpoint (a DCP save on every rank, about a tenth of a 20-step 8-rank run's CPU; the
checkpoints saved every ``checkpoint.every`` steps are untouched, and a test that reads the last
one says ``checkpoint.save_final=true``), and rank 0's measurement of the CPU's matmul rate that
the MFU column is divided by (trainer3d/observe/telemetry.py ``measured_peak_tflops``: ~0.2
s of CPU), which ``train.peak_tflops`` replaces by a given figure.
"""

import contextlib
import fcntl
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.schema import Config
from trainer3d.preflight.data_checks import check_data
from trainer3d.hf.check import apply_init_from
from trainer3d.rank.task import TrainTask
from trainer3d.launch.local_ranks import run_ranks
from trainer3d.config.validate import validate, world_size_of
from trainer3d.config.validate_pipeline import pipeline_micro_batch_problem


# Small enough for 2 cores: 20 steps of 16 sequences x 64 tokens, loss logged every step.
PARITY = ("train.max_steps=20", "train.log_every=1", "train.seq_len=64", "train.micro_batch_size=2",
          "train.global_batch_size=16", "train.grad_accum_steps=null", "optim.warmup_steps=5",
          "parallel.timeout_s=60")

# The model of parity cases that split it into at most two pipeline stages (and no virtual ones):
# conf/model/tiny.yaml with 2 layers instead of 4, one per stage at pp2. Every layer is a round of
# tensor-parallel collectives and a share of the ZeRO buckets per micro-batch: the ranks of a
# 20-step 8-rank tp2·pp2·dp2 run take ~40 % less CPU (tests/README.md), while a layout's fault
# shows in one layer as in four. Its own shared reference, as every model's (``reference_losses``).
TWO_LAYERS = ("model.n_layers=2",)

# The model of the layouts with 8 pipeline stages (pp4 x 2 virtual stages: a layer per stage),
# tests/multirank/test_parity_matrix.py's and test_train_pp.py's, one shared reference: 8 layers at
# half the tiny model's width (tests/multirank/test_document_mask_parity.py's dim and ffn_dim). A
# stage's sends, receives and schedule are the same at any width; at the default lr the 8-layer
# model is chaotic under PARITY (loss spikes; dp=2 drifted 2.7e-3 from one process by step 20 at
# the full width, a reduction-order difference of 1e-7 amplified), so its runs use a gentler lr.
EIGHT_LAYERS = ("model.n_layers=8", "model.dim=64", "model.ffn_dim=192", "optim.lr=1e-3")

# The model of the tied-embedding cases (tests/multirank/test_parity_matrix.py's V schedules on pp2,
# test_offload.py's pp2 x dp2), one shared reference: 4 layers (pp2 x 2 virtual stages: a layer per
# stage) at EIGHT_LAYERS' width, the input embedding and the output head one Parameter. A gentler lr:
# at 3e-3 the tied model amplified 1e-7 into 5e-5 in any layout.
TIED = ("model.tie_embeddings=true", "model.dim=64", "model.ffn_dim=192", "optim.lr=1e-3")

REL_TOL = 1e-5
PARITY_GLOBAL_BATCH, PARITY_MICRO_BATCH = 16, 2
_SPLIT_KNOBS = ("train.micro_batch_size=", "train.grad_accum_steps=", "train.global_batch_size=")


def chooses_split(overrides: Sequence[str]) -> bool:
    """Whether ``overrides`` are a PARITY run that leaves its split to ``parity_micro_batches``:
    they start with PARITY and no later one sets the micro-batch, accumulation or global batch
    (a test that does sets it on purpose: a schedule's count, activation memory per micro-batch)."""
    rest = overrides[len(PARITY):]
    return tuple(overrides[:len(PARITY)]) == PARITY and not any(o.startswith(_SPLIT_KNOBS) for o in rest)


# What a PARITY run on in-process ranks leaves out unless it sets the knob itself (module docstring).
PARITY_RUN_DEFAULTS = {"checkpoint.save_final": False, "train.peak_tflops": 1.0}


def parity_run_defaults(overrides: Sequence[str]) -> dict:
    """``PARITY_RUN_DEFAULTS`` that ``overrides`` leave to ``configure``: none unless they start
    with PARITY, then those of the knobs no override sets (``checkpoint.save_final=true`` in a
    test that reads the final checkpoint)."""
    if tuple(overrides[:len(PARITY)]) != PARITY:
        return {}
    return {k: v for k, v in PARITY_RUN_DEFAULTS.items() if not any(o.startswith(f"{k}=") for o in overrides)}


def parity_micro_batches(pp: int, dp: int, schedule: str) -> int:
    """Micro-batches per rank per step of a PARITY run on ``pp`` x ``dp`` (module docstring)."""
    per_rank = PARITY_GLOBAL_BATCH // dp
    most = per_rank // PARITY_MICRO_BATCH
    if pp == 1:
        want = 2
    else:  # the pipe filled once, or the schedule's own floor where it is higher (validate_pipeline.py)
        want = next(n for n in range(pp, 2 * pp + 1) if pipeline_micro_batch_problem(schedule, pp, n) is None)
    fits = [n for n in range(want, most + 1) if per_rank % n == 0
            and pipeline_micro_batch_problem(schedule, pp, n) is None]
    return fits[0] if fits else most


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


def configure(run_dir: Path, overrides: Sequence[str]) -> Config:
    """The validated config ``python -m trainer3d.train hydra.run.dir=<run_dir> <overrides>``
    would launch (data checked too)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name="config", overrides=[*overrides, f"run_dir={run_dir}",
                                                        f"launcher.folder={Path(run_dir) / 'submitit'}"])
    if chooses_split(overrides):
        p = dcfg.parallel
        dcfg.train.micro_batch_size = PARITY_GLOBAL_BATCH // (p.dp * parity_micro_batches(p.pp, p.dp, p.pp_schedule))
    for knob, value in parity_run_defaults(overrides).items():
        OmegaConf.update(dcfg, knob, value)
    cfg = OmegaConf.to_object(dcfg)
    if cfg.model.init_from:
        cfg = apply_init_from(cfg, [o.split("=", 1)[0][len("model."):] for o in overrides if o.startswith("model.")])
    cfg = validate(cfg)
    assert check_data(cfg) == [], check_data(cfg)
    return cfg


def _train_rank(rank: int, world_size: int, cfg: Config) -> str:
    """One rank of a local job (what submitit's task runs), its stdout returned."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        TrainTask(cfg, lock_run_dir=False)()
    return out.getvalue()


def train_in_ranks(run_dir: Path, overrides: Sequence[str], timeout: float = 900) -> str:
    """Train ``overrides`` on tp x pp x dp in-process gloo ranks; rank 0's stdout."""
    cfg = configure(run_dir, overrides)
    p = cfg.parallel
    return run_ranks(_train_rank, world_size_of(cfg), cfg, timeout=timeout, pg_timeout_s=p.timeout_s)[0]


def read_metrics(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path, overrides: Sequence[str], timeout: float = 600) -> List[float]:
    run_train(run_dir, overrides, timeout)
    return train_losses(run_dir)


def train_losses(run_dir: Path) -> List[float]:
    """The per-step losses of a finished run's metrics.jsonl (checked: one row per step)."""
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows))), "metrics rows must be one per step, in order"
    return [r["loss"] for r in rows]


def losses_in_ranks(run_dir: Path, overrides: Sequence[str], timeout: float = 900) -> List[float]:
    """``losses`` of the same run on in-process ranks (``train_in_ranks``)."""
    train_in_ranks(run_dir, overrides, timeout)
    return train_losses(run_dir)


@contextlib.contextmanager
def once_per_session(tmp_root: Path, name: str) -> Iterator[bool]:
    """Under a file lock in the session directory every worker shares: yields True where
    ``name`` is still to be made (the block makes it), False where it was made already; a
    block that raises leaves it unmade."""
    done = Path(tmp_root) / f"{name}.done"
    with open(Path(tmp_root) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker making it makes the others wait, then reuse it
        todo = not done.exists()
        yield todo
        if todo:
            done.touch()


def reference_dir(tmp_root: Path, overrides: Sequence[str]) -> Path:
    """The run directory of ``reference_losses``'s 1-rank run (its metrics.jsonl, once it ran)."""
    return Path(tmp_root) / f"reference-{hashlib.sha256(chr(0).join(overrides).encode()).hexdigest()[:16]}"


def reference_losses(tmp_root: Path, overrides: Sequence[str]) -> List[float]:
    """Losses of the 1-rank run of ``overrides`` (on an in-process rank), run once per session
    (``tmp_root`` is the session directory every worker shares)."""
    key = hashlib.sha256("\0".join(overrides).encode()).hexdigest()[:16]
    saved = Path(tmp_root) / f"reference-{key}.json"
    with once_per_session(tmp_root, f"reference-{key}") as todo:
        if todo:
            run = reference_dir(tmp_root, overrides)
            saved.write_text(json.dumps(losses_in_ranks(run, [*overrides, "parallel=single"])))
    return json.loads(saved.read_text())


def assert_parity(got: List[float], ref: List[float], rel_tol: float = REL_TOL) -> float:
    """Every step's loss within ``rel_tol`` of the reference; returns the worst relative diff."""
    assert len(got) == len(ref) >= 20, (len(got), len(ref))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    table = "\n".join(f"  step {i:2d}: {a:.8f} vs {b:.8f}" for i, (a, b) in enumerate(zip(got, ref)))
    assert worst <= rel_tol, f"max relative loss difference {worst:.2e} > {rel_tol:.0e}\n{table}"
    assert ref[-1] < ref[0], "the reference loss should fall"
    return worst
