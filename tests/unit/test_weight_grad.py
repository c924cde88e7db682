"""The zero-bubble weight step (parallel/pipeline/weight_grad.py) through the gradient path: one
process, no pipeline. A middle pipeline stage runs torch's input step (``stage_backward_input``)
and then ``backward_weight`` per micro-batch; its gradients must equal an ordinary backward's
(the reference), and the ZeRO buckets' post-accumulate hook must count every parameter once per
micro-batch, so that every bucket launches inside backward (parallel/zero/buckets.py)."""

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from trainer3d.config.schema import ModelConfig
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.pipeline.stages import keep_stage, stage_layer_ranges
from trainer3d.parallel.pipeline.weight_grad import backward_weight
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
