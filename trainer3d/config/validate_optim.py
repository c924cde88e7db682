"""The rules of ``optim.name=muon`` (docs/optimizers.md), part of ``validate``
(trainer3d/config/validate.py).

Muon orthogonalises each hidden matrix's whole update, so it runs where the layout can hand it
whole matrices: the flat ZeRO 0/1 optimizer on the device (parallel/zero/muon.py gathers the tp
and dp pieces). What it does not run under is refused here, before launch, with the reason.
"""

from typing import List

from trainer3d.config.schema import Config


def optim_problems(cfg: Config) -> List[str]:
    o, p = cfg.optim, cfg.parallel
    if o.name != "muon":
        return []
    problems = []
    if p.zero_stage >= 2:
        problems.append(f"optim.name=muon with parallel.zero_stage={p.zero_stage}: FSDP2 shards every matrix "
                        "over dp and its step sees only the shard, while Newton-Schulz needs the whole matrix; "
                        "use parallel.zero_stage=1 (the momentum is sharded there too)")
    if p.offload_optimizer:
        problems.append("optim.name=muon with parallel.offload_optimizer=true: the host step is AdamW's kernel; "
                        "set parallel.offload_optimizer=false")
    if cfg.train.dtype == "fp16":
        problems.append("optim.name=muon with train.dtype=fp16: a skipped fp16 step would still move Muon's "
                        "momentum; use train.dtype=bf16 or fp32")
    return problems
