"""Save, find and resume checkpoints: what the trainer calls.

    choice = agree_on_resume(cfg, dims, timeouts)   # train.resume: auto | never | <path>; a Choice or None
    chunks = build_model_chunks(cfg, dims, initialise=choice is None)
    optimizer = build_optimizer(chunks, cfg, dims)
    checkpointer = Checkpointer(cfg, dims, optimizer, timeouts)
    start_step = checkpointer.load(choice)         # 0 without a checkpoint
    ...
    checkpointer.poll()                            # every step boundary
    checkpointer.save(step)                        # every checkpoint.every steps, at the end, on preemption
    checkpointer.wait("the end of training")       # before the job ends (also on an error)

A save (trainer3d/checkpoint/saver.py): with ``checkpoint.async_save`` the loop stops only
to copy this rank's state into host buffers (trainer3d/checkpoint/staging.py); writing,
hashing, the read-back and the publication run in a background thread while training goes
on, and ``poll`` learns, the same step on every rank, that it is done. At most one save is
in flight: the next save, a preemption stop, the end of the run and an error wait for it.
Saves with nothing left to overlap (the final one, the one after a stop) are written in the
loop. Either way a checkpoint is published — its marker written and its directory renamed
into place by rank 0 — only after every rank's files were written and read back intact.

A resume: rank 0 picks the checkpoint and checks its marker, metadata and sizes
(trainer3d/checkpoint/choose.py: the newest intact one for ``auto``, broken ones skipped and
named; the same model) and tells the others; the ranks then hash its data, each file once
(trainer3d/checkpoint/verify.py) — a damaged one is skipped as well (``auto`` goes on to the
next older one) — and every rank describes the pieces it holds in its *current* layout, so
DCP reads exactly those regions whatever layout saved them. A layout change is reported.
"""

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer3d.checkpoint import store
from trainer3d.checkpoint.choose import RESUME_FIX, Choice, choose
from trainer3d.checkpoint import history
from trainer3d.checkpoint.lineage import marker_fields, origin_of, set_aside
from trainer3d.checkpoint.interval import AutoInterval, Measured
from trainer3d.checkpoint.precision import load_passes
from trainer3d.checkpoint.reader import CheckpointReader, TensorOnlyLoadPlanner
from trainer3d.checkpoint.saver import Background, SaveGroups, SaveJob, SaveReport, write
from trainer3d.checkpoint.staging import Staging
from trainer3d.checkpoint.state import PieceMaker, after_load, rank_state
from trainer3d.checkpoint.store import CheckpointError, checkpoint_root
from trainer3d.checkpoint.verify import shared_problem
from trainer3d.config.schema import Config
from trainer3d.config.validate import layout_of
from trainer3d.config.secrets import scrub
from trainer3d.data.identity import data_identity
from trainer3d.data.sampler import Origin
from trainer3d.parallel.tied import TIED, drop_tied_copies
from trainer3d.parallel.timeouts import GroupTimeouts, seconds
from trainer3d.parallel.topology import ParallelDims
from trainer3d.parallel.zero.optimizer import ZeroOptimizer


def _say(dims: ParallelDims, text: str) -> None:
    if dims.rank == 0:
        print(f"trainer3d: {text}", flush=True)


def _io(timeouts: Optional[GroupTimeouts]):
    """Loads wait with the start-up timeout (a shared filesystem may be slow)."""
    return timeouts.io() if timeouts is not None else contextlib.nullcontext()


def agree_on_resume(cfg: Config, dims: ParallelDims, timeouts: Optional[GroupTimeouts] = None,
                    exclude: List[Path] = ()) -> Optional[Choice]:
    """The checkpoint this run resumes from (rank 0 picks, every rank learns it), or None;
    CheckpointError for a bad explicit path or a checkpoint of another model. Called before
    the model is built: a resumed run has nothing to initialise."""
    choice: List[object] = [None]
    with _io(timeouts):
        if dims.rank == 0:
            try:
                choice[0] = choose(cfg, checkpoint_root(cfg), verify_data=False, exclude=exclude)
            except CheckpointError as err:
                choice[0] = err
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], CheckpointError):
        raise choice[0]
    for path, why in choice[0].skipped if choice[0] is not None else ():
        if path not in exclude:
            _say(dims, f"skipping checkpoint {path}: {why}")
    return choice[0]


class Checkpointer:
    def __init__(self, cfg: Config, dims: ParallelDims, optimizer: ZeroOptimizer,
                 timeouts: Optional[GroupTimeouts] = None):
        self.cfg, self.dims, self.timeouts = cfg, dims, timeouts
        self.optimizer = optimizer
        """Its state (the model's included) is what is saved and loaded."""
        self.buffers: Dict[str, torch.Tensor] = {}
        """Model buffers saved and loaded beside it, by 1-rank name (aux_free's routing biases:
        ``moe_buffers``, parallel/expert/balance.py); set before the first load."""
        self.root = checkpoint_root(cfg)
        self.groups = SaveGroups.build(seconds(cfg.parallel.init_timeout_s), seconds(cfg.parallel.timeout_s))
        self.background = Background(self.groups, dims.rank, self._say, dims.device)
        self.staging = Staging(dims.device)
        self.pieces = PieceMaker()
        """Wraps the live state for a save or a load (trainer3d/checkpoint/state.py)."""
        self.staged_pieces = PieceMaker(reuse=True)
        """Wraps the staging buffers, made once and refilled by every background save."""
        self.last_saved: Optional[int] = None
        self.origin = Origin()
        """The data position the run started from (a resumed checkpoint's samples consumed)."""
        self.resumed_from: Optional[Path] = None
        self.data = data_identity(cfg) if dims.rank == 0 else {}
        """The data's identity, recorded in every marker (rank 0 writes it)."""
        self.known_bad: List[Path] = []
        """Checkpoints whose data failed verification when resuming (kept, never counted as good)."""
        self.news: List[SaveReport] = []
        """What saves cost since the trainer last took ``news`` (a background save twice:
        its stall when it starts, its write time when it is done)."""
        self.auto = AutoInterval(self._mtbf_hours()) if cfg.checkpoint.every == "auto" else None
        """``checkpoint.every=auto``'s interval (trainer3d/checkpoint/interval.py), else None."""
        self._stall_s = 0.0
        self.marker_extras: Dict[str, Callable[[], object]] = {}
        """More of the run's state for the marker, JSON the same on every rank, by its key (the
        spike watch's window: trainer3d/observe/spikes.py); read back from ``loaded_info``."""
        self.loaded_info: dict = {}
        """The marker of the checkpoint last loaded (resume or rollback; {} without one)."""

    def _say(self, text: str) -> None:
        _say(self.dims, text)

    def _mtbf_hours(self) -> float:
        """checkpoint.mtbf_hours, or (auto) rank 0's estimate from the run's history, said with its
        reason; ``retune`` broadcasts rank 0's value, so every rank plans alike."""
        given = self.cfg.checkpoint.mtbf_hours
        if given != "auto":
            return float(given)
        hours, why = history.estimate(history.read(self.cfg.run_dir))
        self._say(f"checkpoint.mtbf_hours=auto: {hours:.2f} h between interruptions expected; {why}")
        return hours

    # ------------------------------------------------------------------ save

    def due(self, steps_done: int) -> bool:
        if self.auto is not None:
            return self.auto.due(steps_done)
        every = self.cfg.checkpoint.every
        return every > 0 and steps_done % every == 0

    def save(self, steps_done: int, background: Optional[bool] = None) -> None:
        """Save the state after ``steps_done`` steps (resume starts at that step); every rank.
        ``background`` (default ``checkpoint.async_save``): return once the state is staged."""
        started = time.perf_counter()
        if self.last_saved == steps_done:  # saved (or being saved) already: only its end is waited for
            self.wait("the end of training")
            return
        self.wait(f"the checkpoint of step {steps_done}")
        if self.auto is not None:
            self.auto.count_from(steps_done)
        background = self.cfg.checkpoint.async_save if background is None else background
        job = self._job(steps_done, staged=background)
        report = SaveReport(steps_done, job.final, stall_s=0.0)
        if background:
            self.background.start(job, report)
        else:
            write(job, self.groups.write, self.dims.rank)
        self.last_saved = steps_done
        report.stall_s = time.perf_counter() - started
        if background:
            self.news.append(dataclasses.replace(report, write_s=None))
            return
        report.write_s = report.stall_s
        self._saved(report)

    def _job(self, steps_done: int, staged: bool) -> SaveJob:
        if staged:
            state = rank_state(self.optimizer, self.dims, self.staged_pieces, stage=self._stage,
                               buffers=self.buffers)
            self.staging.done()
        else:
            state = rank_state(self.optimizer, self.dims, self.pieces, buffers=self.buffers)
        info = {"step": steps_done, "layout": layout_of(self.cfg), "dtype": self.cfg.train.dtype,
                "config": scrub(dataclasses.asdict(self.cfg)), "saved_at": time.time(),
                **marker_fields(self.cfg, steps_done, self.origin, self.resumed_from, self.data),
                **{key: read() for key, read in self.marker_extras.items()}}
        return SaveJob(steps_done, drop_tied_copies(state, self.dims), self.root, info, self.cfg.checkpoint.keep,
                       list(self.known_bad))

    def _stage(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.dims.pp_rank > 0 and key.endswith("." + TIED):
            return tensor  # dropped from the state (drop_tied_copies): no copy
        return self.staging(key, tensor)

    def poll(self) -> None:
        """At every step boundary, on every rank: notice a background save that finished."""
        report = self.background.poll()
        if report is not None:
            self._saved(report, stall_s=0.0)

    def wait(self, why: str, timeout_s: Optional[float] = None) -> None:
        """Wait for the background save in flight (if any): its error is raised here.
        ``timeout_s``: after an error elsewhere, give up on it after that long."""
        report = self.background.wait(why, timeout_s)
        if report is not None:
            self._saved(report, stall_s=0.0)

    def _saved(self, report: SaveReport, stall_s: Optional[float] = None) -> None:
        self.known_bad = [p for p in self.known_bad if p != report.path]  # re-saved: good again
        self.news.append(report if stall_s is None else dataclasses.replace(report, stall_s=stall_s))
        where = "in the background, " if stall_s is not None else ""
        self._say(f"checkpoint at step {report.step} saved to {report.path} ({where}{report.write_s:.1f} s; "
                  f"training stopped {report.stall_s:.2f} s for it)")

    def take_news(self) -> List[SaveReport]:
        news, self.news = self.news, []
        return news

    def retune(self, news: List[SaveReport], step_s: float, steps_done: int) -> Optional[str]:
        """``checkpoint.every=auto``, every rank with the same ``news`` (the same step): after a save
        is done, recompute the interval from rank 0's measurements (broadcast, so every rank saves
        at the same step); the line that says why, else None."""
        if self.auto is None:
            return None
        for report in news:
            if report.write_s is None or report.stall_s:  # a background save's stall comes when it starts
                self._stall_s = report.stall_s
        done = [r for r in news if r.write_s is not None]
        if not done:
            return None
        figures = torch.tensor([step_s, self._stall_s, done[-1].write_s, self.auto.mtbf_s], dtype=torch.float64,
                               device=self.dims.device)
        dist.broadcast(figures, src=0)
        *measured, self.auto.mtbf_s = figures.tolist()  # rank 0's estimate (checkpoint.mtbf_hours=auto)
        return self.auto.retune(Measured(*measured), self.last_saved, steps_done)  # counted from the newest save

    # ------------------------------------------------------------------ resume

    def load(self, choice: Optional[Choice]) -> int:
        """Load ``choice`` (from ``agree_on_resume``) into this rank's model and optimizer, after
        the ranks verified its data (``auto`` goes on to older ones past a damaged one);
        returns the step to start at (0 without a checkpoint)."""
        with _io(self.timeouts):
            while choice is not None:
                same_world = choice.info.get("layout") == layout_of(self.cfg)
                state = rank_state(self.optimizer, self.dims, self.pieces, with_rng=same_world, buffers=self.buffers)
                metadata = store.read_metadata(choice.path)
                passes, notes = load_passes(state, metadata.state_dict_metadata)
                problem = shared_problem(choice.path, choice.info["files"], passes, metadata, self.dims.rank,
                                         self.dims.topo.world_size)
                if problem is None:
                    return self._load(choice, state, passes, notes, same_world)
                self.known_bad.append(choice.path)
                self._say(f"skipping checkpoint {choice.path}: {problem}")
                if self.cfg.train.resume != "auto":
                    raise CheckpointError(f"train.resume={choice.path} is not a usable checkpoint ({problem}); "
                                          f"{RESUME_FIX}")
                choice = agree_on_resume(self.cfg, self.dims, exclude=self.known_bad)
        return 0

    def _abandon_newer(self, choice: Choice) -> None:
        """An explicit resume starts a branch: the checkpoint dir's checkpoints it abandons are
        moved aside (trainer3d/checkpoint/lineage.py), so ``auto`` never resumes them; rank 0."""
        if self.dims.rank == 0:
            moved = set_aside(self.root, choice.path, choice.step, store.published(self.root))
            if moved:
                self._say(f"train.resume={choice.path} abandons {len(moved)} newer checkpoint(s) of {self.root}: "
                          f"moved to {moved[0].parent} (kept; train.resume=auto never takes them)")
        dist.barrier()

    def _load(self, choice: Choice, state: dict, passes: List[dict], notes: List[str], same_world: bool) -> int:
        for part in passes:  # the same number of passes on every rank (both, even where one is empty)
            dcp.load(part, storage_reader=CheckpointReader(str(choice.path)), planner=TensorOnlyLoadPlanner())
        for note in notes:
            self._say(note)
        after_load(self.optimizer, state, self.dims, with_rng=same_world)
        self.last_saved = choice.step
        self.loaded_info = choice.info
        self.origin = origin_of(choice.info, self.cfg.train.global_batch_size)
        self.resumed_from = choice.path
        if self.auto is not None:
            self.auto.count_from(choice.step)
        self._say(f"resumed from {choice.path} at step {choice.step}")
        saved_batch = choice.info.get("global_batch_size")
        if type(saved_batch) is int and saved_batch != self.cfg.train.global_batch_size:
            self._say(f"train.global_batch_size {saved_batch} -> {self.cfg.train.global_batch_size}: the data "
                      f"continues after the {self.origin.samples} samples the checkpoint consumed")
        if self.cfg.train.resume != "auto":
            self._abandon_newer(choice)
        if not same_world:
            saved, now = choice.info.get("layout", {}), layout_of(self.cfg)
            changes = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in {**saved, **now}
                                if saved.get(k) != now.get(k))
            self._say(f"layout changed since the checkpoint: {changes} (state resharded on load)")
        return choice.step
