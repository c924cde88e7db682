"""Save, find and resume checkpoints: what the trainer calls.

    checkpointer = Checkpointer(cfg, dims, timeouts)
    choice = checkpointer.choose()               # train.resume: auto | never | <path>
    chunks = build_model_chunks(cfg, dims, initialise=choice is None)
    start_step = checkpointer.resume(optimizer, choice)
    ...
    checkpointer.save(step)                      # every checkpoint.every steps, at the end, on preemption

A save: every rank writes its pieces (trainer3d/checkpoint/state.py) with DCP into
``step_N.partial/``, hashing and reading back its files (trainer3d/checkpoint/writer.py); a
gather of those digests proves all of them finished; rank 0 writes the marker (step,
layout, config, digests) and renames the directory to ``step_N/`` (trainer3d/checkpoint/store.py),
then prunes to ``checkpoint.keep``; a second barrier keeps ranks from racing ahead of the
rename. A crash anywhere before the rename leaves the previous checkpoint the newest one.

A resume: rank 0 picks the checkpoint and checks it (trainer3d/checkpoint/choose.py: the
newest intact one for ``auto``, broken ones skipped and named; checksums; the same model)
and tells the others; every rank describes the pieces it holds in
its *current* layout and DCP reads exactly those regions, so the saved layout does not
matter. A layout change is reported.
"""

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer3d.checkpoint import store
from trainer3d.checkpoint.choose import choose
from trainer3d.checkpoint.precision import load_passes
from trainer3d.checkpoint.reader import CheckpointReader, TensorOnlyLoadPlanner
from trainer3d.checkpoint.state import PieceMaker, after_load, rank_state
from trainer3d.checkpoint.store import CheckpointError
from trainer3d.checkpoint.writer import CheckpointWriter
from trainer3d.config.schema import Config
from trainer3d.observe.loggers import scrub
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.parallel.tied import drop_tied_copies
from trainer3d.parallel.timeouts import GroupTimeouts
from trainer3d.parallel.topology import ParallelDims
from trainer3d.config.validate import layout_of


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / "checkpoints"


class Checkpointer:
    def __init__(self, cfg: Config, dims: ParallelDims, timeouts: Optional[GroupTimeouts] = None):
        self.cfg, self.dims = cfg, dims
        self.optimizer: Optional[ZeroOptimizer] = None
        """Set by ``resume``: the optimizer whose state (model included) is saved and loaded."""
        self.timeouts = timeouts
        """Saves and loads wait with the start-up timeout (a shared filesystem may be slow)."""
        self.root = checkpoint_root(cfg)
        self._make = None
        self.last_saved: Optional[int] = None
        self.known_bad: List[Path] = []
        """Checkpoints whose data failed verification when resuming (kept, never counted as good)."""

    @property
    def make(self) -> PieceMaker:
        if self._make is None:
            self._make = PieceMaker(self.dims)
        return self._make

    def _say(self, text: str) -> None:
        if self.dims.rank == 0:
            print(f"trainer3d: {text}", flush=True)

    # ------------------------------------------------------------------ save

    def due(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint.every
        return every > 0 and steps_done % every == 0

    def _io(self):
        return self.timeouts.io() if self.timeouts is not None else contextlib.nullcontext()

    def save(self, steps_done: int) -> Path:
        """Save the state after ``steps_done`` steps (resume starts at that step); every rank."""
        if self.last_saved == steps_done:
            return store.step_dir(self.root, steps_done)
        with self._io():
            return self._save(steps_done)

    def _save(self, steps_done: int) -> Path:
        started = time.perf_counter()
        partial, final = store.partial_dir(self.root, steps_done), store.step_dir(self.root, steps_done)
        if self.dims.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a crash: start clean
                shutil.rmtree(partial)
        dist.barrier()
        try:
            state = drop_tied_copies(rank_state(self.optimizer, self.dims, self.make), self.dims)
            writer = CheckpointWriter(str(partial))
            dcp.save(state, storage_writer=writer)
            files = [None] * self.dims.topo.world_size if self.dims.rank == 0 else None
            dist.gather_object(writer.digests, files, dst=0)  # also proves every rank's files are complete
            if self.dims.rank == 0:
                info = {"step": steps_done, "layout": layout_of(self.cfg), "dtype": self.cfg.train.dtype,
                        "config": scrub(dataclasses.asdict(self.cfg)), "saved_at": time.time(),
                        "files": {name: d for rank_files in files for name, d in rank_files.items()}}
                store.publish(partial, final, info)
                self.known_bad = [p for p in self.known_bad if p != final]  # re-saved: good again
                store.prune(self.root, self.cfg.checkpoint.keep, self.known_bad)
        except BaseException:  # DCP's CheckpointException is one: a failed save must not fill the disk
            if self.dims.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        dist.barrier()
        self.last_saved = steps_done
        self._say(f"checkpoint at step {steps_done} saved to {final} ({time.perf_counter() - started:.1f} s)")
        return final

    # ------------------------------------------------------------------ resume

    def _choose(self) -> Optional[Tuple[int, Path, dict]]:
        """Rank 0's choice of checkpoint, or None; raises CheckpointError for a bad explicit path
        or a checkpoint of another model."""
        choice = choose(self.cfg, self.root)
        if choice is None:
            return None
        for path, why in choice.skipped:
            self.known_bad.append(path)
            self._say(f"skipping checkpoint {path}: {why}")
        return choice.step, choice.path, choice.info

    def choose(self) -> Optional[Tuple[int, Path, dict]]:
        """The checkpoint this run resumes from (rank 0 picks, every rank learns it), or None.
        Called before the model is built: a resumed run has nothing to initialise."""
        with self._io():
            return self._agree_on_choice()

    def _agree_on_choice(self) -> Optional[Tuple[int, Path, dict]]:
        choice: List[object] = [None]
        if self.dims.rank == 0:
            try:
                choice[0] = self._choose()
            except CheckpointError as err:
                choice[0] = err
        dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], CheckpointError):
            raise choice[0]
        return choice[0]

    def resume(self, optimizer: ZeroOptimizer, choice: Optional[Tuple[int, Path, dict]]) -> int:
        """Load ``choice`` (from ``choose``) into this rank's model and optimizer; returns the
        step to start at (0 without a checkpoint)."""
        self.optimizer = optimizer
        if choice is None:
            return 0
        with self._io():
            return self._load(*choice)

    def _load(self, step: int, path: Path, info: dict) -> int:
        same_world = info.get("layout") == layout_of(self.cfg)
        state = rank_state(self.optimizer, self.dims, self.make, with_rng=same_world)
        passes, notes = load_passes(state, store.read_metadata(path).state_dict_metadata)
        for part in passes:  # the same number of passes on every rank (both, even where one is empty)
            dcp.load(part, storage_reader=CheckpointReader(str(path)), planner=TensorOnlyLoadPlanner())
        for note in notes:
            self._say(note)
        after_load(self.optimizer, state, self.dims, with_rng=same_world)
        self.last_saved = step
        self._say(f"resumed from {path} at step {step}")
        if info.get("layout") != layout_of(self.cfg):
            saved, now = info.get("layout", {}), layout_of(self.cfg)
            changes = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v)
            self._say(f"layout changed since the checkpoint: {changes} (state resharded on load)")
        return step

