"""``train.compile=true``: torch.compile each transformer block, as torchtitan does
(torchtitan/models/llama3/infra/parallelize.py, ``apply_compile``).

Per block rather than the whole model: every block has the same code and shapes, so
dynamo traces one and reuses it for the rest, and compile time does not grow with depth;
the pieces between blocks (embedding, head, the loss, the pipeline's sends) stay eager.
It runs after tensor parallelism and activation checkpointing have been applied to the
blocks and before the pipeline schedule and the optimizer see them (FSDP wraps compiled
blocks). Tensor parallelism's collectives are autograd Functions over c10d process groups,
which dynamo does not trace: they split a block's graph and run eagerly between its
compiled pieces.

``Module.compile`` compiles in place: the block stays the same module, so parameter names
(``layers.7.attention.wq.weight``), the checkpoint keys and the optimizer's view of the
parameters do not change (``torch.compile(block)`` would wrap it and insert ``_orig_mod.``).
"""

from typing import List

from torch import nn


def compile_blocks(chunks: List[nn.Module]) -> int:
    """Compile every transformer block of ``chunks`` in place; returns how many."""
    count = 0
    for chunk in chunks:
        for block in chunk.layers.values():
            block.compile()
            count += 1
    return count
