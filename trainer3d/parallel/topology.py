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

Hybrid sharding (HSDP, ``dp_shard`` = S < dp, ZeRO-2/3): the dp x cp group splits into
dp / S replicas of S x cp neighbouring members each, its dp index ``replica * S + shard``;
FSDP2 shards over a replica's members and replicates over the replicas, on the 2-D mesh
("dp_replicate", "dp_shard") — ("dp_replicate", "dp_shard_cp") when cp > 1, torchtitan's
names. Rank order does not change: a shard group is S x cp x tp consecutive ranks, inside
a node where it fits. With 8 ranks, tp=2, dp=4, S=2 (pp=cp=1)::

    replica 0: [g0 g1] [g2 g3]     replica 1: [g4 g5] [g6 g7]

    shard groups (4): [0,2] [1,3] [4,6] [5,7]
    replicate groups (4): [0,4] [1,5] [2,6] [3,7]

Expert parallelism (``ep`` > 1, MoE models) carves the dp x cp group as Megatron-Core's
expert-data-parallel scheme does (megatron/core/parallel_state.py, the expert groups): an ep
group is ``ep`` neighbouring members of a dp x cp group (place ``dp_cp_rank`` in it, cp
fastest), each holding num_experts / ep of every MoE block's routed experts; the expert-dp
group joins the members at the same place of every ep group, which hold the same experts and
reduce (and ZeRO-shard) their gradients. With 8 ranks, tp=2, dp=4, ep=2 (pp=cp=1)::

    dp 0: [g0 g1]  dp 1: [g2 g3]  dp 2: [g4 g5]  dp 3: [g6 g7]

    ep groups (4): [0,2] [1,3] [4,6] [5,7]
    expert-dp groups (4): [0,4] [1,5] [2,6] [3,7]
"""

import functools
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer3d.config.schema_parallel import V_SCHEDULES
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
    dp_shard: Optional[int] = None
    """HSDP: FSDP2 shards over this many neighbouring dp ranks (None: all of dp)."""
    ep: int = 1
    """Expert parallelism: MoE experts split over this many neighbouring dp x cp ranks."""
    v_shape: bool = False
    """Two pipeline stages per rank placed in a V (``V_SCHEDULES``): the last stage is on pp rank 0."""

    def __post_init__(self):
        for name in DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard is not None and (self.dp_shard < 1 or self.dp % self.dp_shard):
            raise ValueError(f"dp_shard={self.dp_shard} must divide dp={self.dp}")
        if self.ep < 1 or (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp}")

    @classmethod
    def of(cls, parallel) -> "Topology":
        """The layout of a ``parallel.*`` config section (trainer3d/config/schema_parallel.py);
        dp_shard only counts for FSDP2 (zero_stage 2/3), which validation enforces."""
        hsdp = parallel.zero_stage >= 2 and parallel.dp_shard not in (None, parallel.dp)
        return cls(tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, cp=parallel.cp,
                   dp_shard=parallel.dp_shard if hsdp else None, ep=parallel.ep,
                   v_shape=parallel.pp_schedule in V_SCHEDULES)

    @property
    def last_pp_rank(self) -> int:
        """The pp rank of the last stage (head and loss): pp - 1, or 0 in a V."""
        return 0 if self.v_shape else self.pp - 1

    @property
    def shard(self) -> int:
        """dp ranks per FSDP2 shard group (S); dp without HSDP."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.shard < self.dp

    def shard_groups(self) -> List[List[int]]:
        """HSDP's shard groups: the S x cp neighbours of each (pp, replica, tp); the dp_cp groups without HSDP."""
        return [[self.rank(pp, r * self.shard + s, c, t) for s in range(self.shard) for c in range(self.cp)]
                for pp in range(self.pp) for r in range(self.dp // self.shard) for t in range(self.tp)]

    def replicate_groups(self) -> List[List[int]]:
        """HSDP's replicate groups: one member of each replica, at the same place in it."""
        return [[self.rank(pp, r * self.shard + s, c, t) for r in range(self.dp // self.shard)]
                for pp in range(self.pp) for s in range(self.shard) for c in range(self.cp) for t in range(self.tp)]

    def _dp_cp_member(self, pp: int, i: int, tp: int) -> int:
        """The rank at place ``i`` (cp fastest) of the dp x cp group of (pp, tp)."""
        return self.rank(pp, i // self.cp, i % self.cp, tp)

    def expert_groups(self) -> List[List[int]]:
        """The ep groups: ``ep`` neighbouring members of each dp x cp group."""
        return [[self._dp_cp_member(pp, g * self.ep + e, t) for e in range(self.ep)]
                for pp in range(self.pp) for g in range(self.dp * self.cp // self.ep) for t in range(self.tp)]

    def expert_dp_groups(self) -> List[List[int]]:
        """The expert-dp groups: the member at one place of every ep group (the same experts)."""
        return [[self._dp_cp_member(pp, g * self.ep + e, t) for g in range(self.dp * self.cp // self.ep)]
                for pp in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

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
        """(first stage, last stage) of each (dp, cp, tp) column; none without a pipeline, nor in
        a V, whose two ends share one rank and one Parameter (trainer3d/parallel/tied.py)."""
        if self.pp == 1 or self.v_shape:
            return []
        return [[self.rank(0, d, c, t), self.rank(self.pp - 1, d, c, t)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def embedding_dp_groups(self) -> List[List[int]]:
        """The first and last stage's ranks of every dp and cp rank, one group per tp rank."""
        if not self.embedding_groups():
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
    hsdp_mesh: Optional[DeviceMesh] = None
    """HSDP's 2-D (replicate, shard) mesh over dp x cp; None without HSDP."""
    ep_group: Optional[dist.ProcessGroup] = None
    """The ranks this rank's MoE tokens are dispatched over (parallel/expert/); None when ep == 1."""
    expert_dp_group: Optional[dist.ProcessGroup] = None
    """The ranks holding this rank's experts, over which their gradients are reduced; None when ep == 1."""

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
        if topo.hsdp:
            flat = dims.dp_cp_mesh()
            shard_name = "dp_shard" if topo.cp == 1 else "dp_shard_cp"
            dims.hsdp_mesh = flat._unflatten(0, (topo.dp // topo.shard, topo.shard * topo.cp),
                                             ("dp_replicate", shard_name))
            set_timeout([dims.hsdp_mesh[name].get_group() for name in ("dp_replicate", shard_name)], timeout_s)
        if topo.ep > 1:
            dims.ep_group = _my_group(topo.expert_groups(), dims.rank, timeout_s)
            dims.expert_dp_group = _my_group(topo.expert_dp_groups(), dims.rank, timeout_s)
        if tied_embeddings and topo.embedding_groups():
            dims.embedding_group = _my_group(topo.embedding_groups(), dims.rank, timeout_s)
            dims.embedding_dp_group = _my_group(topo.embedding_dp_groups(), dims.rank, timeout_s)
        return dims

    def groups(self) -> List[dist.ProcessGroup]:
        """Every group this rank's step communicates over, the default group included."""
        own = [self.tp_group, self.dp_group, self.pp_group, self.embedding_group, self.embedding_dp_group,
               *((self.cp_group, self.dp_cp_group) if self.cp > 1 else ()), self.ep_group, self.expert_dp_group]
        if self.hsdp_mesh is not None:
            own += [self.hsdp_mesh.get_group(0), self.hsdp_mesh.get_group(1)]
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
    # Expert parallelism: dp_cp_rank = expert_dp_rank * ep + ep_rank.
    ep = property(lambda self: self.topo.ep)
    ep_rank = property(lambda self: self.dp_cp_rank % self.topo.ep)
    expert_dp = property(lambda self: self.topo.dp * self.topo.cp // self.topo.ep)
    expert_dp_rank = property(lambda self: self.dp_cp_rank // self.topo.ep)

    # FSDP2's shard group (dp_shard x cp under HSDP, else dp x cp) and this rank's place in it:
    # dp_cp_rank = replica * zero_shards + zero_shard_rank.
    zero_shards = property(lambda self: self.topo.shard * self.topo.cp)
    zero_shard_rank = property(lambda self: self.dp_cp_rank % (self.topo.shard * self.topo.cp))
    dp_replicate_rank = property(lambda self: self.dp_cp_rank // (self.topo.shard * self.topo.cp))

    def dp_cp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of ``dp_cp_group``."""
        return self.mesh["dp"] if self.cp == 1 else self.mesh["dp_cp"]

    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards over: the 1-D dp x cp mesh, or HSDP's 2-D (replicate, shard) mesh."""
        return self.hsdp_mesh if self.hsdp_mesh is not None else self.dp_cp_mesh()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topo.last_pp_rank


def _my_group(groups: List[List[int]], rank: int, timeout_s: float) -> Optional[dist.ProcessGroup]:
    """Create every group (each rank must call new_group for all of them, in the same order)
    with the default group's backend and ``timeout_s``; return the one holding ``rank``."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, backend=dist.get_backend(), timeout=seconds(timeout_s))
        if rank in ranks:
            mine = group
    return mine
