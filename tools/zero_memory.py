"""Model-state memory per rank: the ZeRO paper's Table 1, and this engine's figure for a layout.

    python tools/zero_memory.py                          # the paper's Table 1 (K=12, GB = 1e9 B)
    python tools/zero_memory.py --model 7b --dp 8 --zero-stage 1 --dtype bf16 [--tp 2 --pp 4]

The second form builds the model on the meta device (no memory) from conf/model/<name>.yaml
and prints, for the pipeline stage with the most parameters, the paper's figure and this
engine's term by term (trainer3d/memory.py states why they differ). With tp/pp > 1 the
per-rank shapes are an estimate of the split: layers as even as possible over stages
(earlier stages take the remainder), embedding on the first, final norm and head on the
last; column-parallel weights (wq, wk, wv, w1, w3, head, embedding rows) split on dim 0,
row-parallel ones (wo, w2) on dim 1, norms replicated, the vocabulary padded to tp.
"""

import argparse
import sys
from pathlib import Path
from typing import List, Tuple

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.config import ModelConfig  # noqa: E402
from trainer3d.memory import (TABLE1_DP, TABLE1_MODELS, engine_model_state_bytes, format_gb,  # noqa: E402
                              paper_model_state_bytes, table1)
from trainer3d.model.transformer import Transformer  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"
COLUMN = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight", "tok_embeddings.weight")
ROW = ("wo.weight", "w2.weight")


def print_table1() -> None:
    print("ZeRO paper, Table 1: model-state GB per device (mixed-precision Adam, K=12)")
    header = f"{'DP':>5} | " + " | ".join(f"{name:>8} P_os  P_os+g  P_os+g+p" for name, _ in TABLE1_MODELS)
    print(header)
    rows = {(name, dp): (a, b, c) for name, dp, a, b, c in table1()}
    for dp in TABLE1_DP:
        cells = [" ".join(f"{format_gb(v):>7}" for v in rows[(name, dp)]) for name, _ in TABLE1_MODELS]
        print(f"{dp:>5} | " + " | ".join(f"{c:>29}" for c in cells))


def load_model_config(name: str) -> ModelConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{name}.yaml")))


def stage_layers(n_layers: int, pp: int) -> List[range]:
    base, extra = divmod(n_layers, pp)
    sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def rank_shapes(cfg: ModelConfig, tp: int, pp: int, pp_rank: int) -> List[Tuple[int, ...]]:
    """Parameter shapes on one rank of pipeline stage ``pp_rank`` (estimate; see module doc)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    keep = {str(i) for i in stage_layers(cfg.n_layers, pp)[pp_rank]}
    shapes = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers" and parts[1] not in keep:
            continue
        if parts[0] == "tok_embeddings" and pp_rank != 0 and not (cfg.tie_embeddings and pp_rank == pp - 1):
            continue  # a tied embedding is also the last stage's head
        if parts[0] in ("norm", "output") and pp_rank != pp - 1:
            continue
        shape = list(p.shape)
        if name.endswith(COLUMN):
            shape[0] = -(-shape[0] // tp)
        elif name.endswith(ROW):
            shape[1] //= tp
        shapes.append(tuple(shape))
    return shapes


def print_layout(args) -> None:
    cfg = load_model_config(args.model)
    per_stage = [rank_shapes(cfg, args.tp, args.pp, s) for s in range(args.pp)]
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
