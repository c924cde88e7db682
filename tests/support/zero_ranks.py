"""What the ZeRO multi-rank tests run: a tiny model built by the real recipe, the optimizer
under test (inside each gloo rank), and a single-process torch reference (on the same rank, or
once in the test's process: tests/multirank/test_muon.py)."""

import copy
from typing import List, Tuple

import torch
import torch.nn.functional as F
import torch.optim._muon as torch_muon_module

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.model.init import canonical_name
from trainer3d.optim.schedule import param_groups
from trainer3d.parallel.parallelize import build_model_chunks, build_optimizer
from tests.support.harness import dims_for

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=16)
SEQ, MICRO, ACCUM = 8, 2, 2


def make_cfg(dp: int, stage: int, dtype: str = "fp32", bucket_mb: float = 0.01, zero_reduce: str = "auto",
             grad_clip: float = 1.0, accum: int = ACCUM) -> Config:
    cfg = Config()
    cfg.model = copy.deepcopy(MODEL)
    cfg.parallel.dp, cfg.parallel.zero_stage = dp, stage
    cfg.parallel.bucket_mb, cfg.parallel.zero_reduce = bucket_mb, zero_reduce
    cfg.train.dtype, cfg.train.seq_len, cfg.train.seed = dtype, SEQ, 7
    cfg.train.micro_batch_size, cfg.train.grad_accum_steps = MICRO, accum
    cfg.train.global_batch_size = MICRO * accum * dp
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 0.1, grad_clip
    # Adam moves an element whose gradient is near eps by about lr * g / eps: at eps=1e-8 a few
    # gradients of ~1e-9 (sums that nearly cancel, a few % apart from one summation order to
    # another) leave the layouts up to ~1e-5 apart after 3 steps; at 1e-6 their order-of-sums
    # noise stays ~1e-7, well under the tolerances, and a real error stands out (both sides,
    # the engine and torch's AdamW, use this eps).
    cfg.optim.eps = 1e-6
    return cfg


def build(cfg: Config):
    dims = dims_for(dp=cfg.parallel.dp)
    chunks = build_model_chunks(cfg, dims)
    return dims, chunks[0], build_optimizer(chunks, cfg, dims)


def global_batch(cfg: Config, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dp * accum, micro, seq) inputs and targets, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    n = cfg.parallel.dp * cfg.train.grad_accum_steps
    tokens = torch.randint(0, cfg.model.vocab_size, (n, MICRO, SEQ + 1), generator=g)
    return tokens[..., :-1], tokens[..., 1:]


def loss_of(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1))


def forward_backward(model, opt, cfg: Config, dp_rank: int, step: int) -> None:
    """This rank's micro-batches, as the trainer runs them."""
    x, y = global_batch(cfg, step)
    accum = cfg.train.grad_accum_steps
    for m in range(dp_rank * accum, (dp_rank + 1) * accum):
        (opt.scale_loss(loss_of(model, x[m], y[m])) / accum).backward()


def train_step(model, opt, cfg: Config, dp_rank: int, step: int, lr: float = 1e-2) -> torch.Tensor:
    opt.zero_grad()
    forward_backward(model, opt, cfg, dp_rank, step)
    opt.reduce_gradients()
    norm = opt.clip_grad_norm(cfg.optim.grad_clip)
    opt.step(lr)
    return norm


def reference_steps(cfg: Config, steps: int, lr: float = 1e-2) -> Tuple[dict, List[float]]:
    """One process, torch AdamW and clip_grad_norm_ on the whole global batch: final
    parameters by canonical name, and the gradient norm of every step."""
    ref_cfg = make_cfg(1, 0)
    ref_cfg.optim, ref_cfg.model = cfg.optim, cfg.model
    model = build_model_chunks(ref_cfg, _single_dims())[0]
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    opt = torch.optim.AdamW(param_groups(named, cfg.optim.weight_decay), lr=lr,
                            betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    n_micro = cfg.parallel.dp * cfg.train.grad_accum_steps
    norms = []
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(cfg, step)
        for m in range(n_micro):
            (loss_of(model, x[m], y[m]) / n_micro).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip).item())
        opt.step()
    return {n: p.detach().clone() for n, p in named}, norms


def _single_dims():
    """A 1-rank layout that needs no process group of its own (the model build reads only
    its device and pp/tp sizes)."""
    from trainer3d.parallel.topology import Topology

    class _Dims:
        topo = Topology(tp=1, pp=1, dp=1)
        tp = pp = dp = cp = 1
        tp_rank = pp_rank = dp_rank = cp_rank = 0
        device = torch.device("cpu")
    return _Dims()


def params_by_name(model, opt) -> dict:
    """Full fp32 copies by canonical name (FSDP's DTensors all-gathered: call on every rank),
    once ``opt``'s last step has reached them (ZeRO-1 gathers them on the way to the next forward)."""
    opt.wait_params()
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        out[canonical_name(n)] = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().clone()
    return out


def muon_cfg(cfg: Config, adjust_lr: str = "original", nesterov: bool = True, ns_dtype: str = "fp32") -> Config:
    """``cfg`` with ``optim.name=muon``, Muon's peak lr 5x AdamW's."""
    cfg.optim.name = "muon"
    cfg.optim.muon.lr, cfg.optim.muon.weight_decay = 5e-2, 0.05
    cfg.optim.muon.adjust_lr, cfg.optim.muon.nesterov, cfg.optim.muon.ns_dtype = adjust_lr, nesterov, ns_dtype
    return cfg


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """Newton-Schulz as the quintic's formula, X <- aX + (bA + cA^2)X with A = XX^T, in fp32
    (torch's ``_zeropower_via_newtonschulz`` takes the same arguments and iterates in bf16)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    wide = x.T if x.shape[0] > x.shape[1] else x
    wide = wide / wide.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = wide @ wide.T
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return wide.T if x.shape[0] > x.shape[1] else wide


def torch_muon(params, cfg: Config, lr: float):
    """``torch.optim.Muon`` with ``optim.muon``'s arguments; for ``ns_dtype=fp32`` its Newton-Schulz
    (a module function it looks up at each step) is ``fp32_newton_schulz``: the rest of the
    step — momentum, look-ahead, weight decay, scale — stays torch's."""
    m = cfg.optim.muon
    if m.ns_dtype == "fp32":
        # for the rest of the process (a rank's); reference_muon_steps puts torch's own back
        torch_muon_module._zeropower_via_newtonschulz = fp32_newton_schulz
    return torch.optim.Muon(params, lr=lr * m.lr / cfg.optim.lr, weight_decay=m.weight_decay, momentum=m.momentum,
                            nesterov=m.nesterov, ns_steps=m.ns_steps, eps=m.eps, adjust_lr_fn=m.adjust_lr)


def reference_muon_steps(cfg: Config, steps: int, lr: float = 1e-2) -> Tuple[dict, List[float], List[float]]:
    """One process, ``torch.optim.Muon`` on the blocks' matrices and ``torch.optim.AdamW`` on the
    rest, ``clip_grad_norm_`` over all, on the whole global batch: final parameters by canonical
    name, every step's gradient norm and loss."""
    ref_cfg = make_cfg(1, 0)
    ref_cfg.optim, ref_cfg.model = cfg.optim, cfg.model
    model = build_model_chunks(ref_cfg, _single_dims())[0]
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    hidden = [p for n, p in named if n.startswith("layers.") and p.ndim == 2]
    rest = [(n, p) for n, p in named if not (n.startswith("layers.") and p.ndim == 2)]
    torch_newton_schulz = torch_muon_module._zeropower_via_newtonschulz
    try:
        muon = torch_muon(hidden, cfg, lr)
        adamw = torch.optim.AdamW(param_groups(rest, cfg.optim.weight_decay), lr=lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
        n_micro = cfg.parallel.dp * cfg.train.grad_accum_steps
        norms, losses = [], []
        for step in range(steps):
            muon.zero_grad()
            adamw.zero_grad()
            x, y = global_batch(cfg, step)
            total = 0.0
            for i in range(n_micro):
                loss = loss_of(model, x[i], y[i]) / n_micro
                loss.backward()
                total += loss.item()
            losses.append(total)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip).item())
            muon.step()
            adamw.step()
    finally:  # torch's own again for the process's other tests (torch_muon replaced it)
        torch_muon_module._zeropower_via_newtonschulz = torch_newton_schulz
    return {n: p.detach().clone() for n, p in named}, norms, losses
