#!/usr/bin/env python
"""Throughput, MFU and memory of one GPU training the named models in bf16.

    python tools/bench/gpu.py [--models 125m,350m,1.3b] [--seq-len 2048] [--micro-batch 4]
                              [--compile both|on|off] [--recompute both|on|off] [--steps 10]
    python tools/bench/gpu.py --device cpu    # a smoke run of the tool itself on the tiny model

One rank (NCCL on the GPU, a mesh of size 1), the engine as the trainer builds it
(``build_model_chunks``, the stage-0 optimizer with fp32 master weights, gradient clipping),
each model (conf/model/) compiled and not (``train.compile``), with and without activation
checkpointing. Each variant runs ``--warmup`` untimed steps (compilation happens there) and
``--steps`` timed ones on random tokens; the table gives the median step's tokens/s, the MFU
against the device's data-sheet peak (trainer3d/model/flops.py; PaLM's FLOP count, as the
trainer's metrics), the peak allocated CUDA memory and, next to it, the model-state bytes
trainer3d/memory/states.py predicts (parameters, gradients, master weights, Adam moments): the rest
of the peak is activations and workspace.

On a machine without CUDA it exits with status 2 and says so, unless ``--device cpu`` (the
tiny model at seq 64 unless told otherwise; MFU against the CPU's measured matmul rate, and
the process's peak resident set instead of CUDA memory).
"""

import argparse
import datetime
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer3d.config.schema import Config, ModelConfig  # noqa: E402
from trainer3d.memory.states import engine_model_state_bytes, format_bytes, rank_parameter_shapes  # noqa: E402
from trainer3d.model.flops import flops_per_token  # noqa: E402
from trainer3d.parallel.finalize import GradFinalizer  # noqa: E402
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer  # noqa: E402
from trainer3d.observe.telemetry import peak_rss_bytes, resolve_peak_tflops  # noqa: E402
from trainer3d.parallel.topology import ParallelDims, Topology  # noqa: E402

CONF_MODELS = Path(__file__).resolve().parents[2] / "conf" / "model"
CHOICES = {"both": (False, True), "on": (True,), "off": (False,)}


def model_config(name: str) -> ModelConfig:
    """conf/model/<name>.yaml over the schema's defaults, as Hydra composes it."""
    path = CONF_MODELS / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"bench_gpu: --models {name}: no {path} (members: "
                         f"{', '.join(sorted(p.stem for p in CONF_MODELS.glob('*.yaml')))})")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))


def bench_config(args, model: str, compiled: bool, recompute: bool) -> Config:
    cfg = Config()
    cfg.model = model_config(model)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, args.seq_len)
    t = cfg.train
    t.dtype, t.seq_len, t.compile, t.activation_checkpointing = args.dtype, args.seq_len, compiled, recompute
    t.micro_batch_size, t.grad_accum_steps, t.global_batch_size = args.micro_batch, 1, args.micro_batch
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(cfg: Config, dims: ParallelDims, args) -> dict:
    """Median step time and peak memory of one variant (built, warmed up, timed, freed)."""
    device = dims.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, cfg.parallel.sequence_parallel)
    loss_fn = build_loss_fn(cfg, dims, chunks)
    g = torch.Generator().manual_seed(0)
    vocab, shape = cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len)
    times = []
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, vocab, shape, generator=g).to(device)
        targets = torch.randint(0, vocab, shape, generator=g).to(device)
        _sync(device)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(chunks[0](tokens), targets).backward()
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(1e-4)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    del chunks, optimizer
    return {"step_s": statistics.median(times), "peak_bytes": peak}


def run(args, dims: ParallelDims) -> list:
    peak_tflops = resolve_peak_tflops(None, dims.device, args.dtype)
    rows = []
    for model in args.models.split(","):
        for compiled in CHOICES[args.compile]:
            for recompute in CHOICES[args.recompute]:
                cfg = bench_config(args, model, compiled, recompute)
                state = engine_model_state_bytes(rank_parameter_shapes(cfg, 0), 1, 0, args.dtype).total
                try:
                    out = time_variant(cfg, dims, args)
                except torch.cuda.OutOfMemoryError:
                    out = None
                gc.collect()
                torch._dynamo.reset()
                if dims.device.type == "cuda":
                    torch.cuda.empty_cache()
                row = {"model": model, "compile": compiled, "recompute": recompute, "state_bytes": state}
                if out is not None:
                    tokens_s = cfg.train.micro_batch_size * cfg.train.seq_len / out["step_s"]
                    mfu = flops_per_token(cfg.model, cfg.train.seq_len) * tokens_s / (peak_tflops * 1e12)
                    row.update(out, tokens_per_s=tokens_s, mfu=mfu)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


HEADER = f"{'model':<6} {'compile':>7} {'recompute':>9} {'tokens/s':>10} {'MFU':>6} {'step ms':>8} " \
         f"{'peak mem':>10} {'model state':>11}"


def format_row(row: dict) -> str:
    head = f"{row['model']:<6} {'yes' if row['compile'] else 'no':>7} {'yes' if row['recompute'] else 'no':>9}"
    if "mfu" not in row:
        return f"{head} {'out of memory':>37} {format_bytes(row['state_bytes']):>11}"
    return (f"{head} {row['tokens_per_s']:>10,.0f} {row['mfu'] * 100:>5.1f}% {row['step_s'] * 1e3:>8.1f} "
            f"{format_bytes(row['peak_bytes']):>10} {format_bytes(row['state_bytes']):>11}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", default=None, help="comma-separated conf/model members (cpu: tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (cuda: 2048, cpu: 64)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (cuda: 4, cpu: 2)")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    parser.add_argument("--compile", choices=tuple(CHOICES), default="both")
    parser.add_argument("--recompute", choices=tuple(CHOICES), default="both")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU "
              "machine, or add --device cpu for a smoke run of the tool on the tiny model", file=sys.stderr)
        return 2
    args.models = args.models or ("125m,350m,1.3b" if gpu else "tiny")
    args.seq_len = args.seq_len or (2048 if gpu else 64)
    args.micro_batch = args.micro_batch or (4 if gpu else 2)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=600), device_id=device if gpu else None)
        try:
            dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), device)
            name = torch.cuda.get_device_name(device) if gpu else "CPU"
            print(f"{name}, torch {torch.__version__}, {args.dtype}, seq {args.seq_len}, micro-batch "
                  f"{args.micro_batch}, {args.steps} timed steps after {args.warmup}; "
                  f"peak {resolve_peak_tflops(None, device, args.dtype):.3g} TFLOP/s")
            print(HEADER, flush=True)
            run(args, dims)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
