"""The mixture-of-experts block (trainer3d/model/moe.py, experts.py) against references written
here: a loop over tokens with torch's own operators, and the balance formulas computed by hand."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.tolerance import assert_close_to_scale
from tests.unit.test_validate import make
from trainer3d.checkpoint.chunks import pieces
from trainer3d.config.schema import ModelConfig, MoEConfig
from trainer3d.config.validate import ConfigError, validate
from trainer3d.memory.meter import SavedActivationMeter
from trainer3d.model.experts import grouped_mm_usable, grouped_swiglu
from trainer3d.model.flops import matmul_params
from trainer3d.model.init import init_parameters, normal_region
from trainer3d.model.moe import MoE, moe_layer
from trainer3d.model.transformer import Transformer, count_parameters
from trainer3d.parallel.compile import compile_block

DIM, FFN = 16, 24


def config(**moe) -> ModelConfig:
    fields = {"num_experts": 4, "top_k": 2, "expert_ffn_dim": FFN, "aux_loss_coef": 0.0, **moe}
    return ModelConfig(dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32, vocab_size=61,
                       max_seq_len=16, moe=MoEConfig(**fields))


def block(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's scores, the top_k experts, each its own SwiGLU."""
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = token @ moe.router.weight.t()
        scores = logits.softmax(-1) if moe.router_kind == "softmax_topk" else logits.sigmoid()
        bias = moe.expert_bias if moe.expert_bias is not None else 0
        chosen = (scores + bias).topk(moe.top_k).indices
        gates = scores[chosen] / scores[chosen].sum()
        out = torch.zeros_like(token)
        for gate, e in zip(gates, chosen.tolist()):
            w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
            out = out + gate * ((F.silu(token @ w1) * (token @ w3)) @ w2)
        if moe.shared is not None:
            s = moe.shared
            out = out + F.linear(F.silu(s.w1(token)) * s.w3(token), s.w2.weight)
        rows.append(out)
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
@pytest.mark.parametrize("shared", [0, 1])
def test_block_matches_token_loop_in_values_and_gradients(router, shared):
    """The fp32 block against the token loop in float64, each tensor within 1e-5 of its largest
    element: fp32's rounding leaves the block 1e-7 to 7e-7 of that from the exact values (the
    grouped kernels' sums and an fp32 loop's alike), where a fixed 1e-6 against an fp32 loop
    failed on one 4.6e-2 router gradient of a tensor up to 4.2 (AVX-512 kernels' order of sums)."""
    moe = block(config(router=router, num_shared_experts=shared))
    x = torch.randn(5, 3, DIM, requires_grad=True)
    grad = torch.randn(5, 3, DIM)
    out = moe(x)
    out.backward(grad)
    got = [out.detach(), x.grad] + [p.grad for p in moe.parameters()]
    exact = copy.deepcopy(moe).double()
    x64 = x.detach().double().requires_grad_()
    ref = reference(exact, x64)
    ref.backward(grad.double())
    for g, r in zip(got, [ref.detach(), x64.grad] + [p.grad for p in exact.parameters()]):
        assert_close_to_scale(g.double(), r)


def test_grouped_matmul_and_expert_loop_agree():
    """FFN 24 fp32 rows are 96 bytes: the grouped kernel; 20 (80 bytes) would be too, 18 is not."""
    x = torch.randn(11, DIM, dtype=torch.float64)
    assert grouped_mm_usable(x.float(), DIM, FFN) and not grouped_mm_usable(x.float(), DIM, 18)
    assert not grouped_mm_usable(x, DIM, FFN)  # fp64: the loop over experts
    counts = torch.tensor([3, 0, 6, 2])
    w1, w3, w2 = (torch.randn(4, *s, dtype=torch.float64) for s in ((DIM, FFN), (DIM, FFN), (FFN, DIM)))
    leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
    loop = grouped_swiglu(*leaves, counts)
    loop.backward(torch.ones_like(loop))
    grads64 = [t.grad for t in leaves]
    leaves32 = [t.float().requires_grad_() for t in (x, w1, w3, w2)]
    grouped = grouped_swiglu(*leaves32, counts)
    grouped.backward(torch.ones_like(grouped))
    assert_close_to_scale(grouped.double(), loop)
    for g32, g64 in zip((t.grad for t in leaves32), grads64):
        assert_close_to_scale(g32.double(), g64)
    assert leaves32[1].grad[1].abs().max() == 0  # expert 1 had no tokens


def test_experts_save_input_and_both_projections_only():
    """Saved for backward: x, w1 x, w3 x and the counts (a hand count; weights are not activations)."""
    x = torch.randn(10, DIM, requires_grad=True)
    w = [torch.randn(4, *s, requires_grad=True) for s in ((DIM, FFN), (DIM, FFN), (FFN, DIM))]
    meter = SavedActivationMeter(w)
    with meter:
        out = grouped_swiglu(x, *w, torch.tensor([4, 0, 4, 2]))
    assert meter.live_bytes == 10 * DIM * 4 + 2 * 10 * FFN * 4 + 4 * 8
    del out


def test_balance_loss_is_switch_formula_by_hand():
    """coef * E * sum_i f_i P_i (Switch Transformers eq. 4-6), f over the T * k routed slots."""
    cfg = config(aux_loss_coef=0.1)
    moe = block(cfg)
    x = torch.randn(6, 1, DIM)
    logits = x.view(6, DIM) @ moe.router.weight.detach().t()
    probs = logits.softmax(-1)
    chosen = probs.topk(2).indices
    counts = torch.zeros(4)
    for row in chosen.tolist():
        for e in row:
            counts[e] += 1
    by_hand = 4 * sum((counts[i] / 12) * probs[:, i].mean() for i in range(4))
    moe(x)
    torch.testing.assert_close(moe.last_aux_loss, by_hand)
    # Perfectly even routing and probabilities score 1.
    assert math.isclose(4 * sum((3 / 12) * 0.25 for _ in range(4)), 1.0)


def test_aux_and_z_losses_reach_the_router_gradient_only_through_backward():
    cfg = config(aux_loss_coef=0.3, z_loss_coef=0.05)
    moe = block(cfg)
    x = torch.randn(7, 2, DIM)
    grad = torch.randn(7, 2, DIM)
    out = moe(x)
    torch.testing.assert_close(out, reference(moe, x))  # the output carries no loss
    out.backward(grad)
    got = moe.router.weight.grad.clone()
    moe.zero_grad()
    weight = moe.router.weight
    logits = x.view(-1, DIM) @ weight.t()
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2).indices.reshape(-1), minlength=4).float()
    balance = 4 * ((counts / (14 * 2)) * probs.mean(0)).sum()
    z = logits.logsumexp(-1).square().mean()  # ST-MoE eq. 5
    (reference(moe, x) * grad).sum().add(0.3 * balance + 0.05 * z).backward()
    assert_close_to_scale(got, weight.grad)


def test_aux_grad_scale_scales_only_the_losses():
    cfg = config(aux_loss_coef=0.3)
    grads = []
    for scale in (1.0, 0.25):
        moe = block(cfg)
        moe.aux_grad_scale = scale
        x = torch.randn(4, 2, DIM, generator=torch.Generator().manual_seed(1))
        out = moe(x)
        out.backward(torch.zeros_like(out))  # the router's gradient is the aux loss's alone
        grads.append(moe.router.weight.grad)
    torch.testing.assert_close(grads[1], 0.25 * grads[0])


def test_capacity_drops_the_late_tokens_of_a_full_expert():
    """capacity_factor 0.5, 6 tokens, top-1, 2 experts: ceil(0.5 * 6 / 2) = 2 per expert."""
    cfg = config(num_experts=2, top_k=1, capacity_factor=0.5)
    moe = block(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 10.0  # expert 0 for x[0] > 0, expert 1 otherwise
    x = torch.randn(6, 1, DIM)
    x[:, 0, 0] = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0, -1.0])
    out = moe(x).view(6, DIM)
    ref = reference(moe, x).view(6, DIM)
    for t in (0, 1, 3, 5):  # expert 0 keeps tokens 0, 1; expert 1 tokens 3, 5
        torch.testing.assert_close(out[t], ref[t])
    assert out[2].abs().max() == 0 and out[4].abs().max() == 0


def test_aux_free_bias_moves_against_the_load_and_steers_the_choice():
    """DeepSeek-V3 sec. 2.1.2: b_i += gamma * sign(mean load - load_i); the bias chooses, the
    scores gate."""
    moe = block(config(router="sigmoid_topk", balance="aux_free", bias_update_rate=0.5))
    moe.update_bias(torch.tensor([10, 2, 4, 4]))
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.5, 0.5, 0.5, 0.5]))
    x = torch.randn(5, 1, DIM)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_counts_add_up_over_forwards_and_skip_evaluation():
    moe = block(config())
    moe(torch.randn(3, 2, DIM))
    moe(torch.randn(3, 2, DIM))
    with torch.no_grad():
        moe(torch.randn(3, 2, DIM))
    counts, aux = moe.take_counts()
    assert counts.sum() == 2 * 6 * 2 and moe.take_counts() == (None, None) and aux is None  # aux_loss_coef 0


def test_layer_choice_parameters_and_active_flops():
    cfg = config(first_dense_layers=1, every=2, num_shared_experts=1)
    cfg.n_layers = 5
    assert [moe_layer(cfg, i) for i in range(5)] == [False, True, False, True, False]
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)
    attn = DIM * 4 * (2 * 4 + 2 * 2)  # head_dim 4
    dense, router = 3 * DIM * 32, DIM * 4
    active = router + 3 * DIM * FFN * (2 + 1)  # top-2 and the shared expert
    assert matmul_params(cfg) == 5 * attn + 3 * dense + 2 * active + DIM * 61


def test_expert_init_is_a_row_range_of_one_draw():
    """A range of experts (what an expert-parallel rank will hold) is the matching slice of the
    whole (E, rows, cols) draw, and the whole draw is randn of (E * rows, cols)."""
    full = normal_region(3, "layers.1.feed_forward.experts.w1", (4, 8, 12), ((0, 4), (0, 8), (0, 12)))
    part = normal_region(3, "layers.1.feed_forward.experts.w1", (4, 8, 12), ((1, 3), (0, 8), (0, 12)))
    torch.testing.assert_close(part, full[1:3], rtol=0, atol=0)
    cfg = config()
    model = Transformer(cfg)
    init_parameters(model, cfg, seed=0)
    w2 = model.layers["0"].feed_forward.experts.w2
    assert abs(w2.std().item() - cfg.init_std / math.sqrt(2 * cfg.n_layers)) < 2e-3


@pytest.mark.parametrize("overrides,fragment", [
    (["model.moe.num_experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 exceeds model.moe.num_experts=4"),
    (["model.moe.num_experts=4", "model.moe.first_dense_layers=4"], "model.moe.first_dense_layers=4 leaves no MoE"),
    (["model.moe.num_experts=4", "model.moe.router=top1"], "model.moe.router"),
    (["model.moe.num_experts=-1"], "model.moe.num_experts"),
    (["model.moe.num_experts=4", "parallel.zero_stage=3"], "does not run with parallel.zero_stage=3 yet"),
    (["model.moe.num_experts=4", "parallel.zero_stage=2", "parallel.offload_optimizer=true"],
     "does not run with parallel.zero_stage=2 yet"),
    (["model.moe.num_experts=4", "parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=zbv",
      "parallel.pp_virtual_stages=2", "model.tie_embeddings=false"], "does not run with parallel.pp_schedule=zbv yet"),
])
def test_bad_moe_config_names_the_knob(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    assert fragment in str(err.value)


def test_moe_on_data_parallel_is_accepted():
    validate(make(["model.moe.num_experts=4", "model.moe.num_shared_experts=1", "parallel.zero_stage=1"]))


@pytest.mark.parametrize("zero", [0, 1])
def test_moe_with_optimizer_offload_is_accepted(zero):
    """ZeRO 0/1 offload of an MoE model: tests/multirank/test_moe_offload.py holds it to one process."""
    cfg = validate(make(["model.moe.num_experts=4", f"parallel.zero_stage={zero}", "parallel.offload_optimizer=true"]))
    assert cfg.parallel.offload_optimizer


def test_moe_on_the_pipeline_with_aux_free_is_accepted():
    validate(make(["model.moe.num_experts=4", "model.moe.router=sigmoid_topk", "model.moe.balance=aux_free",
                   "parallel=tp2-pp2-dp2"]))


@pytest.mark.parametrize("start,end", [(0, 60), (7, 53), (20, 40), (3, 9), (21, 22), (25, 60)])
def test_checkpoint_pieces_of_a_3d_expert_weight_cover_a_flat_range(start, end):
    """A ZeRO-1 flat range of an (experts, rows, cols) weight, cut into boxes of the full
    tensor: each box holds exactly its flat elements, and together they hold the range."""
    full = torch.arange(60).view(3, 4, 5)
    covered = 0
    for piece in pieces((3, 4, 5), None, start, end):
        box = full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))].reshape(-1)
        assert box.tolist() == list(range(piece.flat_start, piece.flat_start + piece.numel))
        covered += piece.numel
    assert covered == end - start


def test_fp16_loss_scale_multiplies_the_aux_gradient():
    """The aux and z losses' gradient follows fp16's dynamic loss scale (a device tensor read in
    backward), as the language-model loss's does: times 8 with a scale of 8, unscaled by 1/8 after."""
    cfg = config(aux_loss_coef=0.3, z_loss_coef=0.05)
    grads = []
    for scale in (None, torch.tensor([8.0])):
        moe = block(cfg)
        moe.aux_grad_scale, moe.loss_scale = 0.5, scale
        x = torch.randn(4, 2, DIM, generator=torch.Generator().manual_seed(1))
        out = moe(x)
        out.backward(torch.zeros_like(out))  # the router's gradient is the aux and z losses' alone
        grads.append(moe.router.weight.grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], 8 * grads[0])


@pytest.mark.slow
def test_compiled_block_keeps_the_balance_losses_gradient():
    """train.compile compiles each block (parallel/compile.py): the router's gradient from the
    aux and z losses alone (zero output gradient) and with the output's are eager's. Its subject
    is the autograd graph across the block's graph break (model/moe.py ``_record_and_attach``),
    dynamo's and AOTAutograd's, which aot_eager builds as inductor does; inductor's lowering of
    a compiled block is tests/multirank/test_compile.py's."""
    cfg = config(aux_loss_coef=0.3, z_loss_coef=0.05)
    x = torch.randn(4, 2, DIM, generator=torch.Generator().manual_seed(1))
    for grad in (torch.zeros, torch.ones):
        eager, compiled = block(cfg), block(cfg)
        compile_block(compiled, "aot_eager")
        for moe in (eager, compiled):
            out = moe(x)
            out.backward(grad(out.shape))
        assert eager.router.weight.grad.abs().max() > 0
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
