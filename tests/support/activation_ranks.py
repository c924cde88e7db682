"""What the activation-memory tests run inside each gloo rank, and the layouts they run.

A layout's real model chunks, optimizer, loss function and pipeline are built by the
trainer's own recipe and driven by ``Trainer.forward_backward`` itself (the method, on a
stand-in holding just what it reads): one measured step under ``SavedActivationMeter``, which
counts every storage autograd saves for backward once while any reference to it is saved. It is
the layout's first step: torch's pipeline infers its stages' shapes there, with one
micro-batch's forward and backward of each chunk that release what they saved before the
schedule's first forward (torch/distributed/pipelining/stage.py ``_forward_metadata_inference``),
under the step's peak; every layout measured the same bytes, saved and received, as it did
after a warm-up step.

Each rank returns, per layout: its pipeline rank, the peak saved bytes over the measured
step, the bytes still saved after it (0: backward freed everything) and the most bytes its
pipeline stages' receive buffers held at once in it. tests/multirank/test_activation_memory.py
compares them with
``trainer3d.memory.peak``. After an engine change that moves activations (a new layout of
sequence parallelism, a chunked loss), re-run that test: a failing stage prints its
predicted terms next to the measured total; change the term in trainer3d/memory/activations.py
(and docs/memory.md) that no longer matches.
"""

import copy
from types import SimpleNamespace
from typing import List

import torch

from trainer3d.config.schema import Config, ModelConfig
from tests.support.harness import dims_for

# Small enough for 2 cores, with grouped-query attention and a vocabulary tp does not divide.
MODEL = ModelConfig(name="act", dim=64, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=61,
                    max_seq_len=32)
SEQ = 32


def layout_config(tp=1, pp=1, micro=2, accum=2, schedule="1f1b", virtual=1, sp=False, recompute=False,
                  dtype="fp32", kernel="flash", chunk=24) -> Config:
    cfg = Config()
    cfg.model = copy.deepcopy(MODEL)
    p, t = cfg.parallel, cfg.train
    p.tp, p.pp, p.dp, p.pp_schedule, p.pp_virtual_stages, p.sequence_parallel = tp, pp, 1, schedule, virtual, sp
    t.micro_batch_size, t.grad_accum_steps, t.global_batch_size = micro, accum, micro * accum
    t.seq_len, t.seed, t.dtype, t.activation_checkpointing = SEQ, 3, dtype, recompute
    t.loss_chunk_tokens = chunk  # 0: whole logits; 24: the chunked loss over 64 tokens in three chunks
    return cfg


def _batch(cfg: Config, first: bool, last: bool):
    """As trainer3d/data/loader.py reads them: without a pipeline inputs and targets are views of
    one (accum, micro, seq + 1) tensor; a pipeline's first stage reads only the inputs, its last
    only the targets, each its own (accum, micro, seq) tensor."""
    t = cfg.train
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.model.vocab_size, (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1), generator=g)
    if cfg.parallel.pp == 1:
        return rows[..., :-1], rows[..., 1:]
    return (rows[..., :-1].contiguous() if first else None), (rows[..., 1:].contiguous() if last else None)


def measure(rank: int, world: int, layouts: List[dict]) -> List[dict]:
    from trainer3d.config.schema_parallel import V_SCHEDULES
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer
    from trainer3d.memory.meter import SavedActivationMeter
    from trainer3d.parallel.pipeline.schedule import Pipeline
    from trainer3d.trainer import MicroBatchLoss, Trainer

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    out = []
    for layout in layouts:
        cfg = layout_config(**layout)
        dims = dims_for(tp=cfg.parallel.tp, pp=cfg.parallel.pp, v_shape=cfg.parallel.pp_schedule in V_SCHEDULES)
        chunks = build_model_chunks(cfg, dims)
        optimizer = build_optimizer(chunks, cfg, dims)
        micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps, optimizer)
        pipeline = Pipeline(chunks, micro_loss, cfg, dims) if dims.pp > 1 else None
        trainer = SimpleNamespace(pipeline=pipeline, chunks=chunks, micro_loss=micro_loss, segments=None)
        inputs, targets = _batch(cfg, dims.is_first_stage, dims.is_last_stage)
        with sdpa_kernel(kernels[layout.get("kernel", "flash")]):
            meter = SavedActivationMeter([p for chunk in chunks for p in chunk.parameters()])
            optimizer.zero_grad()
            if pipeline is not None:
                pipeline.receive.reset_peak()
            with meter:
                Trainer.forward_backward(trainer, inputs, targets)
        out.append({"pp_rank": dims.pp_rank, "tp_rank": dims.tp_rank, "peak": meter.peak_bytes,
                    "left": meter.live_bytes, "receive": pipeline.receive.peak_bytes if pipeline else 0})
    return out
