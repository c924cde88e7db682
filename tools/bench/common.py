"""What the benchmarks in tools/ share: the model they time and its command-line knobs.

    parser = argparse.ArgumentParser(...)
    add_model_arguments(parser, steps=8)
    cfg = bench_config(parser.parse_args())   # --dim/--layers model, --seq-len, --micro-batch

The model is the project's Llama-style transformer at ``--dim`` with 8 heads in 4 kv-groups
(grouped-query attention splits at tp 2 and 4), a SwiGLU of 3 x dim and the byte-level
vocabulary (257, padded under tensor parallelism).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from omegaconf import OmegaConf  # noqa: E402

from trainer3d.config.schema import Config, ModelConfig  # noqa: E402

MODEL_PRESETS = Path(__file__).resolve().parents[2] / "conf" / "model"


def add_model_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int = 2) -> None:
    parser.add_argument("--dim", type=int, default=256, help="hidden size (8 heads, 4 kv-heads, FFN 3 x dim)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps before them")


def bench_config(args: argparse.Namespace) -> Config:
    """A Config of the benchmark's model and micro-batch (layout and accumulation: the caller's)."""
    cfg = Config()
    cfg.model = ModelConfig(name="bench", dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                            ffn_dim=3 * args.dim, vocab_size=257, max_seq_len=args.seq_len)
    cfg.train.seq_len, cfg.train.micro_batch_size = args.seq_len, args.micro_batch
    return cfg


def model_preset(name: str) -> ModelConfig:
    """The ModelConfig of conf/model/<name>.yaml (tiny, 125m, ..., 7b, ...)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                               OmegaConf.load(MODEL_PRESETS / f"{name}.yaml")))
