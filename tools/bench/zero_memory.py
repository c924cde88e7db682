"""Model-state memory per rank: the ZeRO paper's Table 1, and this engine's figure for a layout.

    python tools/bench/zero_memory.py                          # the paper's Table 1 (K=12, GB = 1e9 B)
    python tools/bench/zero_memory.py --model 7b --dp 8 --zero-stage 1 --dtype bf16 [--tp 2 --pp 4]

The second form takes conf/model/<name>.yaml and prints, for the pipeline stage with the
most parameters, the paper's figure and this engine's term by term (trainer3d/memory/states.py
states why they differ). The per-rank shapes are the ones the dry run uses
(``trainer3d.memory.states.rank_parameter_shapes``): the real stage split and tensor-parallel
layers applied to the model built on the meta device (no memory).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import model_preset  # noqa: E402
from trainer3d.config.schema import Config  # noqa: E402
from trainer3d.memory.states import (TABLE1_DP, TABLE1_MODELS, engine_model_state_bytes, format_gb,  # noqa: E402
                              paper_model_state_bytes, rank_parameter_shapes, table1)
from trainer3d.parallel.topology import Topology  # noqa: E402

def print_table1() -> None:
    print("ZeRO paper, Table 1: model-state GB per device (mixed-precision Adam, K=12)")
    header = f"{'DP':>5} | " + " | ".join(f"{name:>8} P_os  P_os+g  P_os+g+p" for name, _ in TABLE1_MODELS)
    print(header)
    rows = {(name, dp): (a, b, c) for name, dp, a, b, c in table1()}
    for dp in TABLE1_DP:
        cells = [" ".join(f"{format_gb(v):>7}" for v in rows[(name, dp)]) for name, _ in TABLE1_MODELS]
        print(f"{dp:>5} | " + " | ".join(f"{c:>29}" for c in cells))


def print_layout(args) -> None:
    cfg = Config(model=model_preset(args.model))
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = args.tp, args.pp, args.dp
    topo = Topology(tp=args.tp, pp=args.pp, dp=args.dp)
    per_stage = [rank_parameter_shapes(cfg, topo.rank(s, 0, 0, 0)) for s in range(args.pp)]
    counts = [sum(torch.Size(s).numel() for s in shapes) for shapes in per_stage]
    stage = max(range(args.pp), key=counts.__getitem__)
    psi = counts[stage]
    engine = engine_model_state_bytes(per_stage[stage], args.dp, args.zero_stage, args.dtype,
                                      int(args.bucket_mb * 2 ** 20) // 4)
    gib = 2 ** 30
    print(f"model {args.model}: tp={args.tp} pp={args.pp} dp={args.dp} zero_stage={args.zero_stage} "
          f"dtype={args.dtype}; largest stage {stage}: {psi:,} parameters per rank")
    print(f"  ZeRO paper (mixed precision, K=12): {paper_model_state_bytes(psi, args.dp, args.zero_stage) / gib:8.2f} GiB")
    print(f"  this engine:                        {engine.total / gib:8.2f} GiB")
    for term in ("params", "grads", "master", "optimizer", "gathered"):
        print(f"    {term:<10} {getattr(engine, term) / gib:8.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a conf/model member (tiny, 125m, ..., 175b); omit for Table 1")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    if args.model is None:
        print_table1()
    else:
        print_layout(args)


if __name__ == "__main__":
    main()
