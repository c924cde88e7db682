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

So one parameter's peak is 8 E N (sharded only) + d max((E + 1) N + 2 m², 2 E N).
Measured op by op against the ranks' step: tests/multirank/test_muon_memory.py.
"""

from typing import List, Sequence

from trainer3d.config.schema import Config
from trainer3d.memory.states import model_shapes

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


def muon_step_bytes(cfg: Config, has_blocks: bool = True) -> int:
    """Muon's step transient on a rank whose stages hold blocks (every block holds the same
    matrices): the largest of its Muon parameters' (0 without blocks or for AdamW)."""
    if cfg.optim.name != "muon" or not has_blocks:
        return 0
    full = model_shapes(cfg.model, 1).block
    local = model_shapes(cfg.model, cfg.parallel.tp).block
    d = NS_BYTES[cfg.optim.muon.ns_dtype]
    sizes: List[int] = [parameter_step_bytes(f, tuple(f) != tuple(s), d) for f, s in zip(full, local) if len(f) >= 2]
    return max(sizes, default=0)
