"""A rollback's checkpoint: the newest intact one at or before a step, agreed by the ranks.

``train.spike.policy=rollback`` (trainer3d/trainer.py) restores the state before the steps it
skips. Checkpoints published after that point hold updates from those steps: rank 0 sets
them aside as an explicit resume's abandoned branch is (``lineage.set_aside``: into
``<checkpoint root>/abandoned/<time>-from-step_N/``, kept for inspection, never resumed from,
never counted by ``checkpoint.keep``), so a run requeued after the rollback resumes from a
state that never trained on a skipped batch.
"""

from pathlib import Path
from typing import List, Optional

import torch.distributed as dist

from trainer3d.checkpoint import store
from trainer3d.checkpoint.choose import Choice
from trainer3d.checkpoint.lineage import set_aside
from trainer3d.checkpoint.store import checkpoint_root
from trainer3d.config.schema import Config

def rollback_choice(root: Path, at_most: int) -> Optional[Choice]:
    """The newest published checkpoint of ``root`` at step <= ``at_most`` that passes its marker,
    metadata and size checks (its data is hashed when the ranks load it)."""
    for step, path in reversed(store.published(root)):
        if step <= at_most and store.is_complete(path, verify_data=False)[0]:
            return Choice(step, path, store.read_marker(path), [])
    return None


def agree_on_rollback(cfg: Config, rank: int, at_most: int) -> Optional[Choice]:
    """Every rank: rank 0 picks the checkpoint (None: none at or before ``at_most``) and, when
    there is one, sets the newer ones aside before the others learn it."""
    choice: List[object] = [None]
    if rank == 0:
        root = checkpoint_root(cfg)
        choice[0] = rollback_choice(root, at_most)
        if choice[0] is not None:
            for path in set_aside(root, choice[0].path, choice[0].step, store.published(root)):
                print(f"trainer3d: checkpoint set aside (it trained on steps the rollback skips): {path}", flush=True)
    dist.broadcast_object_list(choice, src=0)
    return choice[0]
