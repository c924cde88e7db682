"""Where each rank sits in the 3D layout, and the process groups that follow from it.

``Topology`` is pure arithmetic (no processes, unit-tested for any world size).
``ParallelDims`` is the same layout at run time: the named DeviceMesh ("pp", "dp", "cp", "tp"),
this rank's coordinates and its groups. It is built once per rank and passed explicitly to
everything that communicates; there are no module-level groups.

Rank order is TP fastest, then CP (context parallelism, parallel/context/), then DP, then PP::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the ranks of a TP group are consecutive and stay inside a node, and a CP ring next to
them (TP talks every layer, CP every attention, DP once a step, PP once per micro-batch).
With 16 ranks, tp=2, dp=4, pp=2 (cp=1)::

    pp_rank 0:  dp 0: [g0 g1]  dp 1: [g2 g3]  dp 2: [g4 g5]  dp 3: [g6 g7]
    pp_rank 1:  dp 0: [g8 g9]  dp 1: [g10 g11] dp 2: [g12 g13] dp 3: [g14 g15]

    tp groups (8): [0,1] [2,3] ... [14,15]
    dp groups (4): [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
    pp groups (8): [0,8] [1,9] [2,10] ... [7,15]

Models with tied input/output embeddings and pp > 1 also get the embedding groups: the
first and the last stage of each (dp, tp) column, whose two copies of the embedding sum
their gradients (Megatron-LM's embedding group), and the same ends of every dp rank of a
tp column, for ZeRO-1, where each dp rank owns a different part of each copy. Above
(pp=2) the embedding groups are the pp groups [0,8] [1,9] ..., and the embedding-dp groups
[0,2,4,6,8,10,12,14] [1,3,5,7,9,11,13,15].

With cp > 1 the cp ranks of a replica split each sequence and see the same weights, so
gradients are reduced (and ZeRO shards its state) over dp x cp, the ``dp_cp`` group
(torchtitan's ``dp_shard_cp``). With 8 ranks, tp=2, cp=2, dp=2 (pp=1)::

    dp 0: cp 0: [g0 g1]  cp 1: [g2 g3]     dp 1: cp 0: [g4 g5]  cp 1: [g6 g7]

    cp groups (4): [0,2] [1,3] [4,6] [5,7]
    dp groups (4): [0,4] [1,5] [2,6] [3,7]
    dp_cp groups (2): [0,2,4,6] [1,3,5,7]
"""

import functools
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer3d.parallel.timeouts import group_timeout_s, seconds, set_timeout

DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest


class Coords(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    dp: int
    cp: int = 1

    def __post_init__(self):
        for name in DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @functools.lru_cache(maxsize=None)  # noqa: B019 - a few frozen layouts per process; read per micro-batch
    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return Coords(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)

    def rank(self, pp: int, dp: int, cp: int, tp: int) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_of(self, rank: int, dim: str) -> List[int]:
        """The ranks that share every coordinate with ``rank`` except ``dim``, in ``dim`` order."""
        c = self.coords(rank)._asdict()
        members = []
        for i in range(getattr(self, dim)):
            c[dim] = i
            members.append(self.rank(**c))
        return members

    def groups(self, dim: str) -> List[List[int]]:
        """Every group along ``dim``, each listed once, ordered by its first rank."""
        seen: Dict[int, List[int]] = {}
        for r in range(self.world_size):
            g = self.group_of(r, dim)
            seen.setdefault(g[0], g)
        return [seen[k] for k in sorted(seen)]

    def embedding_groups(self) -> List[List[int]]:
        """(first stage, last stage) of each (dp, cp, tp) column; none without a pipeline."""
        if self.pp == 1:
            return []
        return [[self.rank(0, d, c, t), self.rank(self.pp - 1, d, c, t)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def embedding_dp_groups(self) -> List[List[int]]:
        """The first and last stage's ranks of every dp and cp rank, one group per tp rank."""
        if self.pp == 1:
            return []
        return [[self.rank(s, d, c, t) for s in (0, self.pp - 1) for d in range(self.dp) for c in range(self.cp)]
                for t in range(self.tp)]

    def describe(self) -> str:
        """One line per rank: ``rank 5: pp 0 dp 2 tp 1`` (``cp 0`` before tp when cp > 1)."""
        lines = []
        for r in range(self.world_size):
            c = self.coords(r)
            cp = f" cp {c.cp}" if self.cp > 1 else ""
            lines.append(f"rank {r}: pp {c.pp} dp {c.dp}{cp} tp {c.tp}")
        return "\n".join(lines)


@dataclass
class ParallelDims:
    """This rank's view of the layout at run time. Build with ``ParallelDims.build``."""

    topo: Topology
    rank: int
    mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    device: torch.device
    embedding_group: Optional[dist.ProcessGroup] = None
    """This rank's (first stage, last stage) pair, when it holds a tied embedding copy and pp > 1."""
    embedding_dp_group: Optional[dist.ProcessGroup] = None
    """Both ends' ranks of every dp (and cp) rank of this tp column (ZeRO-1 sums owned parts over it)."""
    cp_group: Optional[dist.ProcessGroup] = None
    """The ranks splitting this rank's sequences (context parallelism); None when cp == 1."""
    dp_cp_group: Optional[dist.ProcessGroup] = None
    """The ranks gradients are averaged over, and ZeRO shards over: dp x cp (the dp group when cp == 1)."""

    @classmethod
    def build(cls, topo: Topology, device: torch.device, tied_embeddings: bool = False,
              timeout_s: Optional[float] = None) -> "ParallelDims":
        """Needs an initialised default process group whose world size is topo.world_size.
        ``tied_embeddings``: also create the embedding groups (pp > 1). ``timeout_s``: the
        groups' collective timeout (default: the default group's); trainer3d/parallel/timeouts.py
        switches it between start-up and the step later."""
        world = dist.get_world_size()
        if world != topo.world_size:
            raise RuntimeError(f"process group has {world} ranks, layout tp*cp*pp*dp needs {topo.world_size}")
        if timeout_s is None:
            timeout_s = group_timeout_s(dist.distributed_c10d._get_default_group(), device)
        # The mesh's groups start with torch's default timeout (30 min on gloo, 10 on NCCL),
        # whatever options are passed in some releases (2.9 drops backend_override's timeout),
        # so the run's is set on each group afterwards. No group is handed another's options
        # object: NCCL keeps it by reference, and one shared object would tie their timeouts.
        mesh = init_device_mesh(device.type, (topo.pp, topo.dp, topo.cp, topo.tp), mesh_dim_names=DIMS)
        set_timeout([mesh[name].get_group() for name in DIMS], timeout_s)
        dims = cls(topo=topo, rank=dist.get_rank(), mesh=mesh, tp_group=mesh["tp"].get_group(),
                   dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(), device=device)
        dims.dp_cp_group = dims.dp_group
        if topo.cp > 1:
            dims.cp_group = mesh["cp"].get_group()
            dims.dp_cp_group = mesh["dp", "cp"]._flatten("dp_cp").get_group()
            set_timeout([dims.dp_cp_group], timeout_s)
        if tied_embeddings and topo.pp > 1:
            dims.embedding_group = _my_group(topo.embedding_groups(), dims.rank, timeout_s)
            dims.embedding_dp_group = _my_group(topo.embedding_dp_groups(), dims.rank, timeout_s)
        return dims

    def groups(self) -> List[dist.ProcessGroup]:
        """Every group this rank's step communicates over, the default group included."""
        own = [self.tp_group, self.dp_group, self.pp_group, self.embedding_group, self.embedding_dp_group,
               *((self.cp_group, self.dp_cp_group) if self.cp > 1 else ())]
        return [dist.distributed_c10d._get_default_group()] + [g for g in own if g is not None]

    @property
    def coords(self) -> Coords:
        return self.topo.coords(self.rank)

    # This rank's coordinate along each dimension, and the layout's size of it.
    tp_rank = property(lambda self: self.coords.tp)
    dp_rank = property(lambda self: self.coords.dp)
    cp_rank = property(lambda self: self.coords.cp)
    pp_rank = property(lambda self: self.coords.pp)
    tp = property(lambda self: self.topo.tp)
    dp = property(lambda self: self.topo.dp)
    cp = property(lambda self: self.topo.cp)
    pp = property(lambda self: self.topo.pp)
    # The gradient-reduction (and ZeRO sharding) group's size and this rank's place in it:
    # dp x cp, cp fastest, the order of the flattened ("dp", "cp") mesh.
    dp_cp = property(lambda self: self.topo.dp * self.topo.cp)
    dp_cp_rank = property(lambda self: self.coords.dp * self.topo.cp + self.coords.cp)

    def dp_cp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of ``dp_cp_group`` (FSDP2 shards over it)."""
        return self.mesh["dp"] if self.cp == 1 else self.mesh["dp_cp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topo.pp - 1


def _my_group(groups: List[List[int]], rank: int, timeout_s: float) -> Optional[dist.ProcessGroup]:
    """Create every group (each rank must call new_group for all of them, in the same order)
    with the default group's backend and ``timeout_s``; return the one holding ``rank``."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, backend=dist.get_backend(), timeout=seconds(timeout_s))
        if rank in ranks:
            mine = group
    return mine
