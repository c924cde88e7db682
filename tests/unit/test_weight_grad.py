"""The zero-bubble weight step (parallel/pipeline/weight_grad.py) through the gradient path: one
process, no pipeline. A middle pipeline stage runs torch's input step (``stage_backward_input``)
and then ``backward_weight`` per micro-batch; its gradients must equal an ordinary backward's
(the reference), and the ZeRO buckets' post-accumulate hook must count every parameter once per
micro-batch, so that every bucket launches inside backward (parallel/zero/buckets.py)."""

from collections import Counter

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from trainer3d.config.schema import ModelConfig
from trainer3d.model import functional
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.compile import compile_operators
from trainer3d.parallel.pipeline.stages import keep_stage, stage_layer_ranges
from trainer3d.parallel.pipeline.weight_grad import backward_weight
from trainer3d.parallel.recompute import checkpoint_layers
from trainer3d.parallel.wgrad import low_precision_sink, route_linear_layers
from trainer3d.parallel.zero.buckets import FlatBuffers, GradReducer

CFG = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16)
MICRO, SEQ, BATCH = 3, 8, 2


def middle_stage(dtype: torch.dtype) -> torch.nn.Module:
    """Stage 1 of 3: one block, hidden states in and out (no embedding, no head)."""
    model = Transformer(CFG)
    init_parameters(model, CFG, seed=0)
    return keep_stage(model, 1, stage_layer_ranges(CFG.n_layers, 3)).to(dtype)


def micro_batches(dtype):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(SEQ, BATCH, CFG.dim, generator=gen).to(dtype),
             torch.randn(SEQ, BATCH, CFG.dim, generator=gen).to(dtype)) for _ in range(MICRO)]


def run_split(stage, batches, weight_step, dtype):
    """Each micro-batch's input step then its weight step (``weight_step=None``: one ordinary
    backward instead, the reference), with the ZeRO buckets' hooks (and, in bf16, wgrad.py's
    sink) attached."""
    params = list(stage.parameters())
    buffers = FlatBuffers(params, bucket_numel=4096, pad_multiple=1, dtype=dtype)
    reducer = GradReducer(buffers, group=None, dp=1, dp_rank=0, micro_batches=MICRO, mode="all_reduce")
    sink = low_precision_sink(buffers.params, buffers.grad_view, dtype)
    route_linear_layers([stage])
    input_grads = []
    for x, dy in batches:
        x = x.clone().requires_grad_()
        out = stage(x)
        if weight_step is None:
            out.backward(dy)
            input_grads.append(x.grad)
            continue
        dx, groups = stage_backward_input([out], [dy], [x], stage.parameters())
        input_grads.append(dx[0])
        weight_step(stage.parameters(), groups)
    if sink is not None:
        sink.detach()
    return buffers, reducer, input_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_step_accumulates_once_through_the_bucket_hooks(dtype):
    batches = micro_batches(dtype)
    ref, _, _ = run_split(middle_stage(dtype), batches, None, dtype)
    buffers, reducer, _ = run_split(middle_stage(dtype), batches, backward_weight, dtype)
    assert reducer.counts == [MICRO] * len(buffers.params), "each parameter's hook once per micro-batch"
    assert reducer.launched_in_backward == len(buffers.buckets) >= 2, "every bucket launched inside backward"
    # The same operators on the same operands, in another order across micro-batches: fp32 sums
    # may differ in the last bit.
    torch.testing.assert_close(buffers.grad_buffer, ref.grad_buffer, rtol=1e-6, atol=1e-7)
    assert ref.grad_buffer.abs().sum() > 0
    for p in buffers.params:
        assert p.grad is None or p.grad.data_ptr() == buffers.grad_view(p).data_ptr(), "no stray .grad left"


def test_input_step_gives_the_reference_input_gradient():
    batches = micro_batches(torch.float32)
    _, _, want = run_split(middle_stage(torch.float32), batches, None, torch.float32)
    _, _, got = run_split(middle_stage(torch.float32), batches, backward_weight, torch.float32)
    for dx, ref in zip(got, want):
        torch.testing.assert_close(dx, ref, rtol=1e-6, atol=1e-7)


def test_torch_weight_step_bypasses_the_hooks():
    """Why weight_grad.py exists: torch's own W step (autograd.grad, then ``.grad +=``) never runs
    the AccumulateGrad nodes, so no bucket launches inside backward; in bf16 it fails outright
    on the linear layers that accumulate into their fp32 buffer themselves."""
    stage = middle_stage(torch.float32)
    _, reducer, _ = run_split(stage, micro_batches(torch.float32), stage_backward_weight, torch.float32)
    assert reducer.launched_in_backward == 0 and set(reducer.counts) == {0}
    with pytest.raises(RuntimeError):
        run_split(middle_stage(torch.bfloat16), micro_batches(torch.bfloat16), stage_backward_weight, torch.bfloat16)


def record_backward_halves(monkeypatch, phase):
    """(phase, operator, gradients asked) of every backward operator call of model/functional.py's
    Functions: RMSNorm's (need_x, need_weight), SwiGLU's (need_prod: w2's weight half,
    need_inputs), RoPE's backward (sign -1). Each call goes on to the real operator."""
    calls = []

    def spy(name, real):
        def call(*args, compiled=False):
            # not while dynamo traces a whole block: it would graph-break on the side effect
            if not torch.compiler.is_compiling() and (name != "rotary" or args[3] == -1):
                calls.append((phase[0], name, tuple(args[-2:]) if name != "rotary" else (), compiled))
            return real(*args, compiled=compiled)
        return call

    for name in ("rms_norm_backward", "swiglu_backward", "rotary"):
        monkeypatch.setattr(functional, name, spy(name, getattr(functional, name)))
    return calls


def count_compiled_nodes(stage, phase) -> Counter:
    """Runs of AOTAutograd's compiled backward nodes in each phase, by a pre-hook on every
    ``CompiledFunctionBackward`` node of each forward's graph."""
    runs = Counter()

    def hook_graph(module, args, out):
        seen, todo = set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if "CompiledFunction" in node.name():
                node.register_prehook(lambda grads: runs.update([phase[0]]))
            todo.extend(fn for fn, _ in node.next_functions)

    stage.register_forward_hook(hook_graph)
    return runs


def saved_bytes(stage, x) -> int:
    """Bytes the stage's forward saves for backward, as ``saved_tensors_hooks`` sees them."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x.clone().requires_grad_())
    return total


@pytest.mark.parametrize("compiled", [pytest.param(None, id="eager"),
                                      pytest.param("inductor", id="compiled-operators", marks=pytest.mark.slow)])  # inductor: ~1 min
def test_input_and_weight_steps_each_compute_their_half_once(compiled, monkeypatch):
    """Under a zero-bubble schedule (parallel/compile.py's ``compile_operators`` with
    ``train.compile``), I computes the input half of each operator's backward and W the weight half,
    once per micro-batch each, and W runs no compiled node. Whole-block compile fails it: its one
    compiled node per block runs in W again. The gradients are an ordinary eager backward's, and
    compiled operators save what the eager block saves."""
    batches = micro_batches(torch.float32)
    ref, _, ref_dx = run_split(middle_stage(torch.float32), batches, None, torch.float32)
    stage = middle_stage(torch.float32)
    if compiled:
        assert compile_operators([stage], compiled) == 4  # the block's two norms, attention (RoPE), SwiGLU
    phase = ["I"]
    calls = record_backward_halves(monkeypatch, phase)
    compiled_runs = count_compiled_nodes(stage, phase)

    def weight_step(weights, groups):
        phase[0] = "W"
        backward_weight(weights, groups)
        phase[0] = "I"

    buffers, _, dx = run_split(stage, batches, weight_step, torch.float32)
    # by hand, per micro-batch: two norms, one SwiGLU, RoPE on q and k
    want = Counter({("I", "rms_norm_backward", (True, False), compiled): 2 * MICRO,
                    ("W", "rms_norm_backward", (False, True), compiled): 2 * MICRO,
                    ("I", "swiglu_backward", (False, True), compiled): MICRO,
                    ("W", "swiglu_backward", (True, False), compiled): MICRO,
                    ("I", "rotary", (), compiled): 2 * MICRO})
    assert compiled_runs["W"] == 0, f"W re-ran a compiled backward: {compiled_runs}"
    assert Counter(calls) == want
    torch.testing.assert_close(buffers.grad_buffer, ref.grad_buffer, rtol=1e-5, atol=1e-7)
    for got, want_dx in zip(dx, ref_dx):
        torch.testing.assert_close(got, want_dx, rtol=1e-5, atol=1e-7)
    assert saved_bytes(stage, batches[0][0]) == saved_bytes(middle_stage(torch.float32), batches[0][0])


def test_weight_step_recomputes_a_checkpointed_block_once():
    """Under ``train.activation_checkpointing`` (parallel/recompute.py) a zero-bubble micro-batch
    runs its block's forward three times: the forward itself, the recomputation in I and one in W
    for all of W's parameter groups (weight_grad.py: one ``GraphExecGroup``); torch's checkpoint
    alone recomputes it in every group's call (one per projection or norm whose path meets the
    stage input's). Each step's recomputation replays the forward on the micro-batch's own input:
    the gradients are those of an ordinary backward without recomputation."""
    batches = micro_batches(torch.float32)
    ref, _, ref_dx = run_split(middle_stage(torch.float32), batches, None, torch.float32)
    stage = middle_stage(torch.float32)
    assert checkpoint_layers([stage]) == 1
    phase, runs = ["F"], Counter()
    block = next(iter(stage.layers.values()))
    block.attention.register_forward_pre_hook(lambda *_: runs.update([phase[0]]))
    block_call = stage.forward

    def forward(x):
        phase[0] = "F"
        out = block_call(x)
        phase[0] = "I"
        return out

    def weight_step(weights, groups):
        assert len(groups) > 1  # W makes one backward call per group
        phase[0] = "W"
        backward_weight(weights, groups)

    stage.forward = forward
    buffers, _, dx = run_split(stage, batches, weight_step, torch.float32)
    assert runs == Counter({"F": MICRO, "I": MICRO, "W": MICRO}), runs
    torch.testing.assert_close(buffers.grad_buffer, ref.grad_buffer, rtol=1e-6, atol=1e-7)
    for got, want_dx in zip(dx, ref_dx):
        torch.testing.assert_close(got, want_dx, rtol=1e-6, atol=1e-7)
