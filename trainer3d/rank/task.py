"""What submitit runs on every task (``TrainTask``), or a rank started in place.

Inside each task, submitit's ``TorchDistributedEnvironment`` exports MASTER_ADDR/PORT (the
port: trainer3d/rank/master_port.py), RANK and WORLD_SIZE, the rank starts its heartbeat
(trainer3d/rank/heartbeat.py) and watches the process that owns it (trainer3d/rank/owner.py),
then runs the rank's body (trainer3d/rank/body.py: the process group, the layout, the trainer);
after an agreed stop the rank requeues or exits (trainer3d/rank/preemption.py). The submitting
side is trainer3d/launch/.

This module imports no torch: submitit pickles ``TrainTask`` by reference, so the submitting
process imports it, and that process computes nothing with tensors on its way to the submission
(tests/unit/test_import_cost.py); the body is imported in the rank, by ``TrainTask.__call__``.
"""

import atexit
import contextlib
import dataclasses
import functools
import gc
import os
import sys
from typing import Optional

import submitit

from trainer3d.config.schema import Config
from trainer3d.observe.failure import rank_failures
from trainer3d.rank.heartbeat import Heartbeat, heartbeat_dir
from trainer3d.rank.master_port import job_port
from trainer3d.rank.owner import watch_owner
from trainer3d.rank.runlock import run_dirs
from trainer3d.rank.runlock import join as join_run_dir


@functools.lru_cache(maxsize=None)
def skip_exit_collection() -> None:
    """At this process's exit, no garbage collection over what is alive then (once per process).

    Python's finalization collects over every object still alive (``Py_FinalizeEx``): with
    torch and the engine imported, a cost in CPU to every rank and launcher
    (docs/performance.md). An exit handler runs ``gc.freeze()``, which moves them to the
    permanent generation that collections skip (https://docs.python.org/3/library/gc.html#gc.freeze).
    It changes nothing the other exit handlers do (wandb's finish, the CPU build's clean-up),
    and modules are still torn down after them, so what they hold is still closed and flushed."""
    atexit.register(gc.freeze)


@contextlib.contextmanager
def imports_frozen():
    """What runs inside (a large import: torch, the rank's body) runs with the cyclic garbage
    collector off; then ``gc.freeze()`` and the collector as it was.

    An import of torch and the engine makes hundreds of thousands of objects that live as long
    as the process. With the collector on, each allocation threshold reached during the import
    runs a collection over the young objects, and the generation-2 ones walk every object
    imported so far, again and again (https://docs.python.org/3/library/gc.html). Off, the
    import allocates the same objects; ``gc.freeze()`` then moves them to the permanent
    generation, which later collections skip (CPython's own advice for a process that builds a
    long-lived heap first: the gc module's documentation of ``freeze``). No collection runs
    before the freeze: the import's own cyclic garbage (well under a megabyte: functions, cells
    and tuples of torch's import) stays, frozen, rather than paying a full collection over the
    whole heap, the size of the import's, to free it. The rank's body (``rank_body``) and the
    submitting process's checks that import torch (trainer3d/train.py ``run``) use it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def rank_body():
    """The rank's body (trainer3d/rank/body.py ``run_rank``), imported inside ``imports_frozen``.

    The body's import is most of a fresh rank's start: torch, DCP, the loop; frozen, its objects
    are skipped by the loop's collections too. Where the body is imported already (the ranks the
    tests fork from a server that preloads it: trainer3d/launch/local_ranks.py), nothing is done."""
    if "trainer3d.rank.body" not in sys.modules:
        with imports_frozen():
            import trainer3d.rank.body  # noqa: F401  (here, not at the top: see the module's docstring)
    from trainer3d.rank.body import run_rank
    return run_rank


def in_distributed_env() -> bool:
    """True when this process is already one rank of an allocation (torchrun, or an srun step)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                 and "MASTER_ADDR" in os.environ):
        return True
    submitit_task = any(k.startswith("SUBMITIT_") for k in os.environ)
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1 and not submitit_task


def export_rank_env() -> None:
    """Set torch.distributed's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_*).

    A submitit task (local or Slurm): from submitit's TorchDistributedEnvironment, replacing
    what a parent job left. torchrun (or anyone who set RANK/WORLD_SIZE/MASTER_ADDR): kept.
    A task of a plain ``srun`` step (slurm/train.sbatch): the same TorchDistributedEnvironment
    over Slurm's variables (SLURM_PROCID, SLURM_NTASKS, ...) — submitit recognises a Slurm
    job only by SUBMITIT_EXECUTOR, which srun does not set, so it is set here.
    """
    if "SUBMITIT_EXECUTOR" not in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
            return
        if "SLURM_STEP_ID" not in os.environ or "SLURM_PROCID" not in os.environ:
            raise RuntimeError("launcher=inplace needs to run inside an srun step or under torchrun "
                               "(RANK, WORLD_SIZE, MASTER_ADDR unset); use launcher=local to start the ranks here")
        os.environ["SUBMITIT_EXECUTOR"] = "slurm"
    if os.environ["SUBMITIT_EXECUTOR"] == "slurm" and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(job_port(submitit.JobEnvironment().job_id))  # trainer3d/rank/master_port.py
    submitit.helpers.TorchDistributedEnvironment().export(overwrite=True)


class TrainTask:
    """What submitit runs on every task. Picklable: it holds the resolved config, how many
    times the job was requeued (the cap is launcher.max_requeues), and whether rank 0 must
    take the run dir's lock (no submitting process holds it: Slurm, in place)."""

    def __init__(self, cfg: Config, requeues: int = 0, lock_run_dir: bool = True):
        self.cfg = cfg
        self.requeues = requeues
        self.lock_run_dir = lock_run_dir

    def __call__(self):
        skip_exit_collection()
        export_rank_env()
        owner = watch_owner()  # a local job: stop when the submitting process or the controller is gone
        heartbeat = Heartbeat(heartbeat_dir(self.cfg.run_dir), int(os.environ.get("RANK", "0"))).start()
        try:
            with rank_failures([self.cfg.run_dir, self.cfg.checkpoint.dir or self.cfg.run_dir]):
                if not self.lock_run_dir:
                    join_run_dir(*run_dirs(self.cfg))  # run and checkpoint dirs stay locked while this rank lives
                # Here, not at the top: the body imports torch, which only a rank needs (see above).
                return rank_body()(self.cfg, heartbeat, self.lock_run_dir)
        finally:
            heartbeat.stop()
            if owner is not None:
                owner.stop()

    def checkpoint(self, *args, **kwargs) -> Optional[submitit.helpers.DelayedSubmission]:
        """submitit's requeue hook, run on rank 0 once every rank has stopped at the same step and
        saved (trainer3d/rank/preemption.py): the same task again (it resumes from the newest
        checkpoint, train.resume=auto), or None past launcher.max_requeues, which ends the job."""
        cap = self.cfg.launcher.max_requeues
        if self.requeues >= cap:
            print(f"trainer3d: not requeuing: launcher.max_requeues={cap} requeue(s) done already",
                  file=sys.stderr, flush=True)
            return None
        print(f"trainer3d: requeuing (requeue {self.requeues + 1} of at most {cap})", file=sys.stderr, flush=True)
        # The next attempt continues this one (``never`` would be refused beside its own checkpoints).
        cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, resume="auto"))
        return submitit.helpers.DelayedSubmission(TrainTask(cfg, self.requeues + 1, self.lock_run_dir))
