"""The transient bytes of Muon's step (trainer3d/parallel/zero/muon.py), allocation by
allocation, at the step's peak: the largest matrix's.

The dp gather (ZeRO-1) writes the owners' slices into the gradient buffer in place: nothing.
Each Muon parameter is then orthogonalised alone, everything freed before the next one:

- tensor parallelism, a sharded weight of E x N full fp32 elements (E experts of N = rows x
  cols, E = 1 for a 2-D weight): its tp pieces (4 E N bytes, held to the end) and their
  concatenation, the full matrix (4 E N);
- Newton-Schulz in ``ns_dtype`` (d bytes), matrix by matrix (trainer3d/optim/muon.py
  ``newton_schulz``): with m = min(rows, cols), an iteration's peak is the new X beside the old
  one, the Gram matrix A = X Xᵀ and bA + cA² (2 N + 2 m² elements; a new A or polynomial
  beside the previous iteration's is N + 3 m², no more); the results of the experts before
  it are held (N each) until ``torch.stack`` copies all E (2 E N at that moment).

So one parameter's peak is 8 E N (sharded only) + d max((E + 1) N + 2 m², 2 E N), and a rank's
the largest of the parameters it orthogonalises: all of its stages' under ZeRO-0, dp = 1 or
``optim.muon.layer_wise=false``; else its share (``ns_owners``, the engine's assignment). The
layer-wise broadcast of the results lands in the gradient buffer in place: nothing.
Measured op by op against the ranks' step: tests/multirank/test_muon_memory.py.
"""

from typing import List, Optional, Sequence, Tuple

from trainer3d.config.schema import Config
from trainer3d.memory.states import model_shapes
from trainer3d.parallel.zero.muon import ns_cost, ns_owners

MuonParam = Tuple[Tuple[int, ...], bool]
"""A Muon parameter as the accounting sees it: its logical (full) shape, and whether tp shards it."""

NS_BYTES = {"fp32": 4, "bf16": 2}


def parameter_step_bytes(full_shape: Sequence[int], tp_sharded: bool, ns_bytes: int) -> int:
    """The peak transient bytes of orthogonalising one Muon parameter of logical ``full_shape``."""
    rows, cols = full_shape[-2:]
    experts = 1
    for d in full_shape[:-2]:
        experts *= d
    n, m = rows * cols, min(rows, cols)
    gathered = 2 * 4 * experts * n if tp_sharded else 0
    return gathered + ns_bytes * max((experts + 1) * n + 2 * m * m, 2 * experts * n)


def layer_wise(cfg: Config) -> bool:
    """Whether each Muon parameter is orthogonalised by one owner of the dp x cp group
    (trainer3d/parallel/zero/muon.py): ZeRO-1 over more than one rank, ``optim.muon.layer_wise``."""
    p = cfg.parallel
    return cfg.optim.name == "muon" and cfg.optim.muon.layer_wise and p.zero_stage == 1 and p.dp * p.cp > 1


def rank_muon_params(cfg: Config, layers: int) -> List[MuonParam]:
    """The Muon parameters of a rank whose stages hold ``layers`` blocks (blocks 0 .. layers - 1's
    kinds: dense, or a mixture of experts)."""
    full, local = model_shapes(cfg.model, 1), model_shapes(cfg.model, cfg.parallel.tp)
    return [(tuple(f), tuple(f) != tuple(s)) for i in range(layers)
            for f, s in zip(full.layer(cfg.model, i), local.layer(cfg.model, i)) if len(f) >= 2]


def ns_shares(cfg: Config, params: List[MuonParam]) -> List[List[MuonParam]]:
    """The parameters each rank of the dp x cp group orthogonalises (one list, every rank's,
    where each rank orthogonalises all of them)."""
    if not layer_wise(cfg):
        return [params]
    steps, n = cfg.optim.muon.ns_steps, cfg.parallel.dp * cfg.parallel.cp
    owners = ns_owners([ns_cost(shape, sharded, steps) for shape, sharded in params], n)
    return [[q for q, o in zip(params, owners) if o == r] for r in range(n)]


def muon_step_bytes(cfg: Config, layers: int = 1, dp_rank: Optional[int] = None) -> int:
    """Muon's step transient on a rank whose stages hold ``layers`` blocks: the largest of the
    Muon parameters it orthogonalises (0 without blocks or for AdamW); ``dp_rank``: that rank of
    the dp x cp group's, None: the largest over the group's ranks."""
    if cfg.optim.name != "muon" or not layers:
        return 0
    d = NS_BYTES[cfg.optim.muon.ns_dtype]
    shares = ns_shares(cfg, rank_muon_params(cfg, layers))
    if dp_rank is not None and len(shares) > 1:
        shares = [shares[dp_rank]]
    sizes = [parameter_step_bytes(shape, sharded, d) for share in shares for shape, sharded in share]
    return max(sizes, default=0)
