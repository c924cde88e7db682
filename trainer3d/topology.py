"""Where each rank sits in the 3D layout, and the process groups that follow from it.

``Topology`` is pure arithmetic (no processes, unit-tested for any world size).
``ParallelDims`` is the same layout at run time: the named DeviceMesh ("pp", "dp", "tp"),
this rank's coordinates and its three groups. It is built once per rank and passed
explicitly to everything that communicates; there are no module-level groups.

Rank order is TP fastest, then DP, then PP::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ranks of a TP group are consecutive and stay inside a node (TP talks every layer,
DP once a step, PP once per micro-batch). With 16 ranks, tp=2, dp=4, pp=2::

    pp_rank 0:  dp 0: [g0 g1]  dp 1: [g2 g3]  dp 2: [g4 g5]  dp 3: [g6 g7]
    pp_rank 1:  dp 0: [g8 g9]  dp 1: [g10 g11] dp 2: [g12 g13] dp 3: [g14 g15]

    tp groups (8): [0,1] [2,3] ... [14,15]
    dp groups (4): [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
    pp groups (8): [0,8] [1,9] [2,10] ... [7,15]
"""

from dataclasses import dataclass
from typing import Dict, List, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "tp")  # slowest to fastest


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    dp: int

    def __post_init__(self):
        for name in DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coords(pp=pp_rank, dp=dp_rank, tp=tp_rank)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

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

    def describe(self) -> str:
        """One line per rank: ``rank 5: pp 0 dp 2 tp 1``."""
        return "\n".join(f"rank {r}: pp {c.pp} dp {c.dp} tp {c.tp}"
                         for r in range(self.world_size) for c in [self.coords(r)])


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

    @classmethod
    def build(cls, topo: Topology, device: torch.device) -> "ParallelDims":
        """Needs an initialised default process group whose world size is topo.world_size."""
        world = dist.get_world_size()
        if world != topo.world_size:
            raise RuntimeError(f"process group has {world} ranks, layout tp*pp*dp needs {topo.world_size}")
        # The mesh's sub-groups would otherwise get torch's default timeout (30 min on gloo),
        # not the one given to init_process_group: a stuck pipeline peer or dp replica would
        # hang the job that long. Give every dimension the default group's own options.
        options = dist.distributed_c10d._get_default_group()._get_backend(device).options
        override = {name: (dist.get_backend(), options) for name in DIMS}
        mesh = init_device_mesh(device.type, (topo.pp, topo.dp, topo.tp), mesh_dim_names=DIMS,
                                backend_override=override)
        return cls(topo=topo, rank=dist.get_rank(), mesh=mesh, tp_group=mesh["tp"].get_group(),
                   dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(), device=device)

    @property
    def coords(self) -> Coords:
        return self.topo.coords(self.rank)

    # This rank's coordinate along each dimension, and the layout's size of it.
    tp_rank = property(lambda self: self.coords.tp)
    dp_rank = property(lambda self: self.coords.dp)
    pp_rank = property(lambda self: self.coords.pp)
    tp = property(lambda self: self.topo.tp)
    dp = property(lambda self: self.topo.dp)
    pp = property(lambda self: self.topo.pp)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topo.pp - 1
