#!/usr/bin/env python
"""Predicted peak memory vs what one GPU really allocates, for one-rank training steps.

    python tools/bench/gpu_memory_check.py                     # 125m, 350m, 1.3b x micro-batch 1, 4 x recompute off/on
    python tools/bench/gpu_memory_check.py --models 125m --micro 2 --seq 1024 --dtype bf16

Each point builds the model by the trainer's own recipe on one rank (ZeRO stage 0, the
engine's flat buffers), runs two steps (forward_backward -> reduce -> clip -> AdamW step, as
``Trainer.train_step`` does), resets the allocator's peak before the second and compares
``torch.cuda.max_memory_allocated`` with ``trainer3d.memory.peak.rank_memory`` (model states
+ saved activations + buffers + the largest transient). The issue's target is within 10%.

Without a GPU (``--device cpu``) the same points run on the CPU and the comparison is the
saved-activation peak (the meter of trainer3d/memory/meter.py) against the
accounting's activation term: a check that the tool's path works, not of the GPU figure.
"""

import argparse
import datetime
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from trainer3d.config.schema import Config, ModelConfig  # noqa: E402
from trainer3d.model.documents import segments_of  # noqa: E402
from trainer3d.parallel.finalize import GradFinalizer  # noqa: E402
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer  # noqa: E402
from trainer3d.memory.meter import SavedActivationMeter  # noqa: E402
from trainer3d.memory.peak import rank_memory  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402
from trainer3d.trainer import MicroBatchLoss, Trainer  # noqa: E402
from trainer3d.config.validate import validate  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
GiB = 2 ** 30


def point_config(model: str, micro: int, seq: int, dtype: str, recompute: bool, device: str) -> Config:
    cfg = Config()
    cfg.model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{model}.yaml")))
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq)
    t = cfg.train
    t.micro_batch_size, t.grad_accum_steps, t.global_batch_size = micro, 2, None
    t.seq_len, t.dtype, t.activation_checkpointing, t.device = seq, dtype, recompute, device
    cfg.parallel = type(cfg.parallel)()  # one rank, ZeRO stage 0
    return validate(cfg)


def run_point(cfg: Config, dims: ParallelDims) -> int:
    """Peak bytes of the second step: allocator peak on CUDA, saved activations on CPU."""
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, cfg.parallel.sequence_parallel)
    micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps, optimizer)
    trainer = SimpleNamespace(pipeline=None, chunks=chunks, micro_loss=micro_loss, segments=segments_of(chunks))
    t = cfg.train
    rows = torch.randint(0, cfg.model.vocab_size, (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1),
                         device=dims.device)
    inputs, targets = rows[..., :-1], rows[..., 1:]
    meter = SavedActivationMeter([p for c in chunks for p in c.parameters()])
    for step in range(2):
        if step == 1 and dims.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        optimizer.zero_grad()
        if step == 1:
            with meter:
                Trainer.forward_backward(trainer, inputs, targets)
        else:
            Trainer.forward_backward(trainer, inputs, targets)
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(1e-4)
    if dims.device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return meter.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="125m,350m,1.3b")
    parser.add_argument("--micro", default="1,4")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    device = torch.device(args.device)
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), device)
    what = "max_memory_allocated" if device.type == "cuda" else "saved activations (CPU: the tool's path only)"
    print(f"| model | micro | recompute | predicted GiB | measured GiB ({what}) | error |\n|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for micro in (int(m) for m in args.micro.split(",")):
            for recompute in (False, True):
                cfg = point_config(model, micro, args.seq, args.dtype, recompute, args.device)
                mem = rank_memory(cfg, 0)
                predicted = mem.total if device.type == "cuda" else mem.activation_bytes
                measured = run_point(cfg, dims)
                print(f"| {model} | {micro} | {recompute} | {predicted / GiB:.2f} | {measured / GiB:.2f} | "
                      f"{(predicted - measured) / measured:+.1%} |", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
