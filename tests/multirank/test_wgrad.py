"""bf16/fp16 weight gradients accumulated into the fp32 buffer by the linear layers' backward
(trainer3d/parallel/wgrad.py): the same fp32 gradients and losses as autograd's own path
(a low-precision ``.grad`` per micro-batch, added by the bucket hook), without that
allocation."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from tests.support.compiled import aot_graphs
from tests.support.runs import PARITY, _train_rank, configure, train_losses
from trainer3d.launch.local_ranks import run_ranks
from trainer3d.parallel.wgrad import MainGradSink, route_linear_layers


class _WeightSizedOutputs(TorchDispatchMode):
    """Counts operator outputs with ``numel`` elements (a fresh weight-sized tensor)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not schema.is_mutable and not any(r.alias_info for r in schema.returns):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.count += sum(isinstance(t, torch.Tensor) and t.numel() == self.numel for t in outs)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_accumulates_into_the_fp32_view_bit_identically_without_a_weight_sized_allocation(dtype):
    torch.manual_seed(0)
    plain = nn.Linear(48, 40, bias=False).to(dtype)
    routed = nn.Linear(48, 40, bias=False).to(dtype)
    routed.weight.data.copy_(plain.weight.data)
    assert route_linear_layers([routed]) == 1
    main_grad = torch.zeros(40, 48)
    sink = MainGradSink({routed.weight: main_grad})
    fired = []
    routed.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad))
    reference = torch.zeros(40, 48)
    for micro in range(3):
        x = torch.randn(2, 5, 48, dtype=dtype)
        x_plain, x_routed = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn(2, 5, 40, dtype=dtype)
        plain(x_plain).backward(g)
        reference.add_(plain.weight.grad)  # what the bucket hook does with autograd's .grad
        plain.weight.grad = None
        counter = _WeightSizedOutputs(routed.weight.numel())
        y = routed(x_routed)
        with counter:
            y.backward(g)
        # the first backward allocates the reused scratch buffer, no later one allocates
        assert counter.count == (micro == 0), f"micro-batch {micro}: a weight-sized tensor allocated"
        assert torch.equal(x_routed.grad, x_plain.grad)
        assert torch.equal(main_grad, reference), micro
    assert fired == [None, None, None]  # the bucket hook still fires once per micro-batch
    assert sink.scratch.numel() == routed.weight.numel()
    sink.detach()  # back to autograd's .grad
    routed(torch.randn(3, 48, dtype=dtype)).sum().backward()
    assert routed.weight.grad is not None and routed.weight.grad.dtype == dtype


def _train_sink_then_plain(rank: int, world_size: int, sink_cfg, plain_cfg, store: str) -> None:
    """Each rank trains twice in one process: with the sink, then with autograd's own weight
    gradients (the reference). One process for both runs: with ``train.compile`` the two share
    the compiled blocks, so the comparison isolates the gradient path from any difference
    between two compilations."""
    import torch.distributed as dist

    import trainer3d.parallel.zero.flat as zero
    _train_rank(rank, world_size, sink_cfg)  # ends by destroying the process group
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    zero.low_precision_sink = lambda *args: None
    _train_rank(rank, world_size, plain_cfg)
    return aot_graphs()


LAYOUTS = [
    # 4 layers for the 4 stages, at half the tiny model's width (tests/support/runs.py: TIED's)
    pytest.param(["train.dtype=bf16", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2",
                  "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2", "model.n_layers=4",
                  "model.dim=64", "model.ffn_dim=192", "model.tie_embeddings=true",
                  "train.activation_checkpointing=true"],
                 id="bf16-tp2-sp-pp2-interleaved-tied-recompute"),
    pytest.param(["train.dtype=fp16", "parallel.dp=2", "parallel.zero_stage=1", "optim.grad_clip=0.5",
                  "train.global_batch_size=8"], id="fp16-dp2-zero1-clip"),
    # compiled blocks: autograd's path, through AOTAutograd's graphs (aot_eager: the trace is the
    # subject, the same in both runs; inductor's code is test_compile.py's)
    pytest.param(["train.dtype=bf16", "train.compile=true", "train.compile_backend=aot_eager",
                  "train.activation_checkpointing=true"], id="bf16-compile-recompute"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", LAYOUTS)
def test_low_precision_losses_identical_to_autograds_weight_gradients(tmp_path, overrides):
    # Two micro-batches per rank (the second adds to the first's fp32 gradient) over 3 steps (the
    # later steps' losses follow the earlier steps' updates): a micro-batch is a round of every
    # collective on these ranks, and more of them test nothing more.
    common = [*PARITY, "parallel=single", "train.max_steps=3", "train.global_batch_size=4", "optim.warmup_steps=1",
              *overrides]
    sink_cfg, plain_cfg = (configure(tmp_path / name, common) for name in ("sink", "plain"))
    p = sink_cfg.parallel
    graphs = run_ranks(_train_sink_then_plain, p.tp * p.pp * p.dp, sink_cfg, plain_cfg, str(tmp_path / "store"),
                       timeout=900, pg_timeout_s=p.timeout_s)
    got = {name: train_losses(tmp_path / name) for name in ("sink", "plain")}
    assert got["sink"] == got["plain"], got
    # Compiled where asked, and once: the blocks share one code and shapes, so each rank's first
    # block's graph serves its other blocks and both runs (a forward set on each linear layer's
    # instance, which dynamo guards by identity, recompiled every block: 8 graphs here).
    assert graphs == [int(sink_cfg.train.compile)] * len(graphs), f"compiled graphs per rank: {graphs}"
    assert got["sink"][-1] < got["sink"][0]


def test_recomputed_and_input_only_backwards():
    """Under activation checkpointing the weight's gradient still lands in its view; a backward
    for the inputs alone (``torch.autograd.grad``, as the pipeline's shape inference runs)
    leaves the view alone, as autograd leaves ``.grad`` alone."""
    torch.manual_seed(1)
    layer = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    route_linear_layers([layer])
    main_grad = torch.zeros(8, 16)
    MainGradSink({layer.weight: main_grad})
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    torch.autograd.grad(layer(x).sum(), [x])
    assert not main_grad.any()
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    reference = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    reference.weight.data.copy_(layer.weight.data)
    reference(x.detach()).sum().backward()
    assert main_grad.any() and torch.equal(main_grad, reference.weight.grad.float())
