"""Run the engine itself on a layout and read back its step times.

``--calibrate`` runs it at a negligible model size, where a step is nothing but the host's
and the collectives' fixed costs (calibrate.py fits them); tools/bench/plan_accuracy.py runs it at
a real size and compares with the prediction. Each run is the entry point's ranks, ``python -m
trainer3d.train`` with Hydra overrides (gloo, wandb off), started here as torchrun starts them
(``launcher=inplace``; tests/integration/test_torchrun.py): each rank runs the module as ``python
-m`` does, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (every rank on this
node, as under the local launcher, whose ranks trainer3d/rank/threads.py sizes the same way from
it), ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment, and the store served by this process
as torchrun's agent serves it; its step times are read from metrics.jsonl. The step is what is
measured: the local launcher's submitting process (its pre-launch checks, the job it follows)
and submitit's controller, which no step runs through, are left out, and the ranks fork from
--calibrate's forkserver (calibrate_ranks.py), which has imported torch and the entry point once
for all of them, instead of each being an interpreter that imports them.
"""

import os
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.parent_death import die_with_parent
from trainer3d.config.rows import read_metrics
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate, world_size_of
from trainer3d.plan.calibrate_ranks import end_ranks, forkserver, wait_ranks

ROOT = Path(__file__).resolve().parents[2]


def training_config(overrides: Sequence[str]) -> Config:
    """The validated config ``python -m trainer3d.train <overrides>`` would run."""
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        dcfg = compose("config", [*overrides, "run_dir=.", "launcher.folder=."])
    return validate(OmegaConf.to_object(dcfg))


def _rank(argv: List[str], env: Dict[str, str], log: str) -> None:
    """One rank, in a process forked for it: ``env`` for its environment, its output to ``log``,
    and ``python -m trainer3d.train <argv>`` run as that command runs it (``runpy``, from ROOT)."""
    # Killed when its forkserver (calibrate_ranks.py's), which exits with this process, exits
    # first: a killed --calibrate leaves no rank.
    die_with_parent(signal.SIGKILL)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.argv = ["-m", *argv]  # runpy puts the module's path first, as ``python -m`` does
    runpy.run_module("trainer3d.train", run_name="__main__", alter_sys=True)


def measured_step_s(overrides: Sequence[str], steps: int, warmup: int, run_dir: Path,
                    env: Optional[Mapping[str, str]] = None) -> List[float]:
    """``step_time_s`` of every step after the first ``warmup`` of a ``steps``-step run
    (``env``: variables set for the run's ranks beside this process's)."""
    args = [f"hydra.run.dir={run_dir}", *overrides, "launcher=inplace", f"train.max_steps={steps}",
            "train.log_every=1", "checkpoint.save_final=false"]
    cfg = training_config(overrides)
    world = world_size_of(cfg)
    # The run's own bounds: the start-up timeout, then one collective timeout a step (a rank stuck
    # outside any collective is not caught by them: killed at this deadline).
    limit_s = cfg.parallel.init_timeout_s + steps * cfg.parallel.timeout_s
    deadline = time.monotonic() + limit_s
    # The ranks' store, served here as torchrun's agent serves it: its port is this process's from
    # the start, so no other socket can take it before rank 0 would bind it (trainer3d/rank/master_port.py).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SUBMITIT_", "TORCHELASTIC_"))}
    common = {**inherited, "WANDB_MODE": "disabled", **(env or {}), "WORLD_SIZE": str(world),
              "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
              "TORCHELASTIC_USE_AGENT_STORE": "True"}
    ctx = forkserver()
    with tempfile.TemporaryDirectory() as logs:
        procs = [ctx.Process(target=_rank, daemon=True, args=(
            args, {**common, "RANK": str(r), "LOCAL_RANK": str(r)}, os.path.join(logs, f"rank{r}.log")))
            for r in range(world)]
        try:
            for p in procs:
                p.start()
            failed = wait_ranks(procs, deadline, f"{limit_s:g} s (parallel.init_timeout_s + a parallel.timeout_s "
                                                 f"for each of {steps} steps)")
        finally:  # an interrupt, the deadline or a failed rank: none is left running
            end_ranks(procs)
        if failed is not None:
            tail = Path(logs, f"rank{failed}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"python -m trainer3d.train {' '.join(args)}: rank {failed} of {world} exited "
                               f"{procs[failed].exitcode}:\n{tail}")
    del store
    rows, _ = read_metrics(Path(run_dir) / "metrics.jsonl")
    return [r["step_time_s"] for r in rows[warmup:]]
