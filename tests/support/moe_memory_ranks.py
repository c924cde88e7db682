"""What the mixture-of-experts memory tests run inside each gloo rank: an MoE model built by the
real recipe (dense and MoE blocks mixed), its optimizer and loss, driven by
``Trainer.forward_backward`` itself through one measured step. No warm-up step comes first:
without a pipeline there are no shapes to infer on a first step (tests/support/activation_ranks.py
has one for that), and a first step's saved tensors are a later step's; the optimizer's step after
it makes its states (a warm-up step before it measured the same bytes, on every layout).

Each rank returns, per layout: its tp and dp ranks, the model-state bytes it holds after the
step (trainer3d/observe/telemetry.py ``model_state_bytes``: parameters, gradients and every
tensor the optimizer declares), split into the device's and, with ``parallel.offload_optimizer``,
the host's (the tensors each offloaded optimizer's ``HostAdamW`` allocated), and the peak bytes autograd saved for backward in the measured
step (``SavedActivationMeter``), with what was left saved after it.
tests/multirank/test_moe_memory.py holds them to trainer3d/memory/ (states.py, moe.py, peak.py).
"""

import copy
from types import SimpleNamespace
from typing import List

import torch

from trainer3d.config.schema import Config, ModelConfig
from tests.support.harness import dims_for

# A dense block before an MoE one (first_dense_layers=1, every=2: block 1), one
# shared expert, and widths that are multiples of 4 so the CPU grouped matmul runs
# (model/experts.py); a vocabulary tp does not divide.
MODEL = ModelConfig(name="moe-mem", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=61,
                    max_seq_len=16)
MODEL.moe.num_experts, MODEL.moe.top_k, MODEL.moe.expert_ffn_dim = 4, 2, 24
MODEL.moe.num_shared_experts, MODEL.moe.first_dense_layers, MODEL.moe.every = 1, 1, 2
MODEL.moe.z_loss_coef = 1e-3
SEQ = 16


def moe_config(tp=1, dp=1, sp=False, zero=1, dtype="fp32", micro=2, accum=2, router="softmax_topk", ep=1,
               top_k=2, offload=False) -> Config:
    cfg = Config()
    cfg.model = copy.deepcopy(MODEL)
    cfg.model.moe.router, cfg.model.moe.top_k = router, top_k
    p, t = cfg.parallel, cfg.train
    p.tp, p.dp, p.sequence_parallel, p.zero_stage, p.bucket_mb, p.ep = tp, dp, sp, zero, 0.01, ep
    p.offload_optimizer = offload
    t.micro_batch_size, t.grad_accum_steps, t.global_batch_size = micro, accum, micro * accum * dp
    t.seq_len, t.seed, t.dtype, t.loss_chunk_tokens = SEQ, 3, dtype, 0
    return cfg


def host_bytes(optimizer) -> int:
    """Bytes of the host tensors of an offloaded optimizer (both halves of an expert-parallel
    one: parallel/expert/optimizer.py ``parts``); 0 without offload."""
    from trainer3d.observe.telemetry import storage_bytes
    from trainer3d.parallel.zero.offload import OffloadedOptimizer

    parts = [o for o in getattr(optimizer, "parts", (optimizer,)) if isinstance(o, OffloadedOptimizer)]
    return storage_bytes([t for o in parts for t in o.adam.host_tensors()])


def measure(rank: int, world: int, layouts: List[dict]) -> List[dict]:
    from trainer3d.memory.meter import SavedActivationMeter
    from trainer3d.observe.telemetry import model_state_bytes
    from trainer3d.parallel.expert.tokens import apply_moe_layout
    from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer
    from trainer3d.trainer import MicroBatchLoss, Trainer

    out = []
    for layout in layouts:
        cfg = moe_config(**layout)
        dims = dims_for(tp=cfg.parallel.tp, dp=cfg.parallel.dp, ep=cfg.parallel.ep)
        chunks = build_model_chunks(cfg, dims)
        apply_moe_layout(chunks, cfg, dims)
        optimizer = build_optimizer(chunks, cfg, dims)
        micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps, optimizer)
        trainer = SimpleNamespace(pipeline=None, chunks=chunks, micro_loss=micro_loss, segments=None)
        t = cfg.train
        g = torch.Generator().manual_seed(dims.dp_rank)
        rows = torch.randint(0, cfg.model.vocab_size, (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1),
                             generator=g)
        inputs, targets = rows[..., :-1], rows[..., 1:]
        meter = SavedActivationMeter([p for chunk in chunks for p in chunk.parameters()])
        optimizer.zero_grad()
        with meter:
            Trainer.forward_backward(trainer, inputs, targets)
        optimizer.reduce_gradients()
        optimizer.step(1e-3)
        host = host_bytes(optimizer)
        out.append({"tp_rank": dims.tp_rank, "dp_rank": dims.dp_rank,
                    "states": model_state_bytes(chunks, optimizer) - host, "host": host,
                    "peak": meter.peak_bytes, "left": meter.live_bytes})
    return out
