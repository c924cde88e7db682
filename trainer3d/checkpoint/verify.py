"""Verifying a checkpoint's data before a load, shared by the ranks that read it.

Before any rank loads, every data file the load reads must match the digest its marker
records (trainer3d/checkpoint/digest.py). Rank 0 has checked the marker, the metadata and
the files' sizes (``store.is_complete(verify_data=False)``, trainer3d/checkpoint/choose.py);
hashing the data is the expensive part, so it is shared: each rank works out from its own
load plan (DCP's planner over this rank's state and the checkpoint's metadata) which files
it reads, the ranks exchange those sets, and each file is hashed once, by one of the ranks
that read it (balanced by bytes, so the slowest rank hashes about its share of the
checkpoint), all at the same time; the verdicts are gathered, so every rank refuses or
loads alike. A file no rank reads is not hashed: this load does not use it. The pages a
rank hashed are then in its page cache for the load.
"""

from typing import Dict, List, Optional, Sequence, Set

import torch.distributed as dist

from trainer3d.checkpoint.digest import file_problem
from trainer3d.checkpoint.reader import TensorOnlyLoadPlanner


def files_read(parts: Sequence[Dict[str, object]], metadata) -> Set[str]:
    """The data files ``dcp.load`` will read for this rank's load ``parts`` (its passes)."""
    names: Set[str] = set()
    for part in parts:
        if not part:
            continue
        planner = TensorOnlyLoadPlanner()
        planner.set_up_planner(dict(part), metadata, is_coordinator=False)
        for item in planner.create_local_plan().items:
            names.add(metadata.storage_data[item.storage_index].relative_path)
    return names


def assign(recorded: Dict[str, dict], readers: List[Set[str]]) -> Dict[str, int]:
    """Each recorded file read by some rank -> the rank that hashes it: of the ranks reading it,
    the one with the fewest bytes assigned so far, largest files first (deterministic)."""
    load = [0] * len(readers)
    out: Dict[str, int] = {}
    for name in sorted(recorded, key=lambda n: (-int(recorded[n].get("bytes") or 0), n)):
        ranks = [r for r, names in enumerate(readers) if name in names]
        if ranks:
            out[name] = min(ranks, key=lambda r: (load[r], r))
            load[out[name]] += int(recorded[name].get("bytes") or 0)
    return out


def shared_problem(path, recorded: Dict[str, dict], parts: Sequence[Dict[str, object]], metadata,
                   rank: int, world_size: int) -> Optional[str]:
    """Why the checkpoint at ``path`` may not be loaded (the first damaged file any rank found),
    or None; every rank calls it and gets the same answer."""
    reads = files_read(parts, metadata)
    readers: List[Set[str]] = [reads]
    if world_size > 1:
        readers = [set() for _ in range(world_size)]
        dist.all_gather_object(readers, reads)
    mine = sorted(name for name, r in assign(recorded, readers).items() if r == rank)
    problem = next((p for p in (file_problem(path, name, recorded[name]) for name in mine) if p), None)
    problems: List[Optional[str]] = [problem]
    if world_size > 1:
        problems = [None] * world_size
        dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)
