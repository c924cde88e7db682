"""Dry run: the rank layout of a validated config, printed without starting a process."""

from trainer3d.config import Config
from trainer3d.model.transformer import count_parameters
from trainer3d.topology import Topology


def describe_plan(cfg: Config, max_ranks: int = 64) -> str:
    p, t = cfg.parallel, cfg.train
    topo = Topology(tp=p.tp, pp=p.pp, dp=p.dp)
    lines = [
        f"layout: tp={p.tp} x pp={p.pp} x dp={p.dp} = {topo.world_size} ranks, zero_stage={p.zero_stage}",
        f"model: {cfg.model.name}, {count_parameters(cfg.model):,} parameters",
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x grad_accum {t.grad_accum_steps} "
        f"x dp {p.dp} sequences of {t.seq_len} tokens",
        f"groups: {len(topo.groups('tp'))} tp of {p.tp}, {len(topo.groups('dp'))} dp of {p.dp}, "
        f"{len(topo.groups('pp'))} pp of {p.pp}",
    ]
    if p.pp > 1:
        from trainer3d.parallel.stages import describe_stages
        lines.append(describe_stages(cfg))
    shown = min(topo.world_size, max_ranks)
    lines += ["rank    pp  dp  tp"] + [f"{r:<7} {c.pp:>2}  {c.dp:>2}  {c.tp:>2}"
                                        for r in range(shown) for c in [topo.coords(r)]]
    if shown < topo.world_size:
        lines.append(f"... {topo.world_size - shown} more ranks")
    return "\n".join(lines)


def print_plan(cfg: Config) -> None:
    print(describe_plan(cfg))
