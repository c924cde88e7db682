"""``train.compile=true``: torch.compile each transformer block, as torchtitan does
(torchtitan/models/llama3/infra/parallelize.py, ``apply_compile``); under a zero-bubble
pipeline schedule, the model's elementwise operators instead.

Per block rather than the whole model: every block has the same code and shapes, so
dynamo traces one and reuses it for the rest, and compile time does not grow with depth;
the pieces between blocks (embedding, head, the loss, the pipeline's sends) stay eager.
It runs after tensor parallelism and activation checkpointing have been applied to the
blocks and before the pipeline schedule and the optimizer see them (FSDP wraps compiled
blocks). Dynamo traces tensor parallelism's collectives into the block's graph as functional
collectives that name the tp group (``_c10d_functional.all_gather_into_tensor(x, 2, "17")``:
one graph per block, no break), so the ranks of one tp group build the same graph and the ranks
of the other tp groups each their own; context parallelism's exchange stays eager
(``torch.compiler.disable``, parallel/context/apply.py) and the block compiles around it.

What a rank pays, once: dynamo's trace, AOTAutograd's joint graph and partition, and inductor's
lowering and code, every rank for itself. The C++ of a kernel is compiled once per host and cache
directory: inductor takes a file lock per kernel source and skips a build whose library exists
(torch/_inductor/codecache.py, ``CppCodeCache.load_async``), so ranks building the same kernel
wait for the first one's build and load it. A rank that finds its whole graph in inductor's FX
graph cache skips the lowering and code only (docs/performance.md has the figures), so ranks
are not made to wait on each other's compiles.

``Module.compile`` compiles in place: the block stays the same module, so parameter names
(``layers.7.attention.wq.weight``), the checkpoint keys and the optimizer's view of the
parameters do not change (``torch.compile(block)`` would wrap it and insert ``_orig_mod.``).

Zero-bubble schedules (zb1p, zbv, dualpipev) split each backward into an input step (I) and a
weight step (W) over the same graph (parallel/pipeline/weight_grad.py). A compiled block's
backward is one autograd node (AOTAutograd's ``CompiledFunction``) that computes the input and
the weight gradients together: I would run it whole and W whole again, and the I step's
``retain_graph`` is refused outright by compiled backwards with donated buffers
(pytorch/pytorch#161904). There ``compile_operators`` keeps every autograd node eager and
compiles what runs inside them: RMSNorm's, RoPE's and SwiGLU's elementwise work
(model/functional.py's operators, forward and backward), each composition compiled on its own
by inductor. Each of those Functions' backward asks the engine which gradients its pass needs,
so I computes input halves and W weight halves only, the linear layers' matmuls split by
autograd as in eager, and what backward saves is what the eager model saves (the memory
accounting holds unchanged). What it gives up against whole-block compile is fusion across the
operators (a residual add into the next norm, the reshapes around attention).

``train.compile_backend`` chooses torch.compile's backend for both (torchtitan's
``compile.backend``). inductor, the default, generates the kernels; aot_eager hands
AOTAutograd's forward and backward graphs, split by the min-cut partitioner inductor uses but
without inductor's decompositions, to eager ATen instead (torch/_dynamo/backends/debugging.py):
the same trace, graph breaks, compiled autograd nodes and donated buffers, without the
lowering and the C++ builds above: a fault that shows under inductor and not under aot_eager is
in inductor's code, and what compile does to the training (where graphs break, which hooks
fire, what recomputation replays) shows under either.
"""

from typing import List

import torch
from torch import nn

from trainer3d.parallel.context.apply import ContextAttention
from trainer3d.parallel.pipeline.timeline import ZERO_BUBBLE
from trainer3d.parallel.recompute import is_recomputed, own_forward, recompute


def compile_blocks(chunks: List[nn.Module], backend: str = "inductor") -> int:
    """Compile every transformer block of ``chunks`` in place with torch.compile's ``backend``;
    returns how many."""
    count = 0
    for chunk in chunks:
        for block in chunk.layers.values():
            compile_block(block, backend)
            count += 1
    return count


def compile_block(block: nn.Module, backend: str = "inductor") -> None:
    """Compile one block (or any module of the model) in place, its eager parts left eager."""
    leave_eager(block)
    if is_recomputed(block) and _runs_eager_part(block):
        _compile_inside_recomputation(block, backend)
    else:
        block.compile(backend=backend)


def leave_eager(module: nn.Module) -> None:
    """Wrap with ``torch.compiler.disable`` what the modules of ``module`` name in their
    ``EAGER_PARTS``: attributes holding the functions they call that dynamo must not trace (the
    experts' grouped kernel, model/experts.py; the MoE's accounting, model/moe.py; document
    masking's Python state, model/documents.py; expert parallelism's exchange,
    parallel/expert/dispatch.py). Wrapped here, as a block is compiled, not as the model is
    built: ``torch.compiler.disable`` imports torch._dynamo, seconds of CPU that a run without
    train.compile never uses (tests/unit/test_import_cost.py)."""
    for part in module.modules():
        for name in getattr(part, "EAGER_PARTS", ()):
            setattr(part, name, torch.compiler.disable(getattr(part, name)))


def _runs_eager_part(block: nn.Module) -> bool:
    """Whether ``block`` holds context parallelism's attention, which dynamo must leave eager."""
    return any(isinstance(m, ContextAttention) for m in block.modules())


def _compile_inside_recomputation(block: nn.Module, backend: str) -> None:
    """A recomputed block (parallel/recompute.py) with an eager part: dynamo traces
    ``checkpoint`` as one higher-order operator whose body may not break its graph, so compiling
    the whole block falls back to running all of it eagerly (no graph at all:
    tests/multirank/test_context_parity.py counts them). The block's own forward is compiled
    instead and handed to ``recompute`` as the function it recomputes: it runs inside the eager
    checkpoint, breaking its graph around the eager part; the checkpoint keeps the block's input
    only and replays the compiled forward in backward."""
    recompute(block, torch.compile(own_forward(block), backend=backend))


def compile_operators(chunks: List[nn.Module], backend: str = "inductor") -> int:
    """Make every module of ``chunks`` with elementwise operators (``compile_operators`` in
    model/transformer.py: the norms, attention's RoPE, SwiGLU) run them compiled by ``backend``
    (model/functional.py); returns how many."""
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "compile_operators"):
                module.compile_operators = backend
                count += 1
    return count


def apply_compile(chunks: List[nn.Module], pp: int, schedule: str, backend: str = "inductor") -> int:
    """``train.compile``: the operators under a zero-bubble schedule (module docstring), else
    every block, with ``train.compile_backend``; returns how many modules were compiled or set."""
    if pp > 1 and schedule in ZERO_BUBBLE:
        return compile_operators(chunks, backend)
    return compile_blocks(chunks, backend)
