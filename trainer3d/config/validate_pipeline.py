"""The rules of ``parallel.pp*`` (docs/parallelism.md), part of ``validate``
(trainer3d/config/validate.py).

Which schedules take virtual stages, what torch's schedules refuse (a V's stages per rank, too
few micro-batches), the stages' layers; and the one micro x accum x dp set a refusal proposes,
which the batch rules share.
"""

from typing import List, Optional

from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import V_SCHEDULES


def pipeline_problems(cfg: Config) -> List[str]:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    problems: List[str] = []
    if p.pp_virtual_stages > 1 and p.pp_schedule in ("1f1b", "gpipe"):
        problems.append(f"parallel.pp_virtual_stages={p.pp_virtual_stages} needs parallel.pp_schedule="
                        "interleaved_1f1b, zb1p, zbv or dualpipev (or set pp_virtual_stages=1)")
    if p.pp > 1 and p.pp_schedule in V_SCHEDULES:
        if p.pp_virtual_stages != 2:
            problems.append(f"parallel.pp_schedule={p.pp_schedule} places exactly 2 stages per rank in a V; "
                            f"set parallel.pp_virtual_stages=2 (is {p.pp_virtual_stages})")
    stages = p.pp * p.pp_virtual_stages
    if m.n_layers < stages:
        problems.append(f"model.n_layers={m.n_layers} < pp({p.pp}) * pp_virtual_stages({p.pp_virtual_stages}) "
                        f"= {stages} stages; every stage needs a layer: lower parallel.pp")
    if p.pp_layers is not None:
        if len(p.pp_layers) != stages:
            problems.append(f"parallel.pp_layers has {len(p.pp_layers)} entries, needs one per stage "
                            f"(pp * pp_virtual_stages = {stages})")
        elif sum(p.pp_layers) != m.n_layers or min(p.pp_layers) < 1:
            problems.append(f"parallel.pp_layers={list(p.pp_layers)} must be >= 1 each and sum to "
                            f"model.n_layers={m.n_layers}")
    accum = t.grad_accum_steps
    if p.pp > 1 and accum is not None:
        problem = pipeline_micro_batch_problem(p.pp_schedule, p.pp, accum)
        if problem:
            problems.append(f"{problem}; one consistent set: {consistent_batch(cfg)}")
    return problems


def pipeline_micro_batch_problem(schedule: str, pp: int, n_micro: int) -> Optional[str]:
    """Why torch's ``schedule`` cannot run ``n_micro`` micro-batches on ``pp`` ranks, or None.

    Exactly what torch.distributed.pipelining 2.13 refuses (measured for pp 2 and 4,
    n_micro 1..9, virtual stages 1..3; every other combination matched one process):
    - 1f1b: Schedule1F1B raises for n_micro < stages (each stage needs one in flight);
    - gpipe: any n_micro >= 1;
    - interleaved_1f1b and zb1p: ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble run
      rounds = max(1, n_micro // pp) of equal size, so n_micro must be a multiple of the rounds
      (below pp is fine; pp=2: 5 is refused, 3 and 6 run). Independent of the virtual stages.
    - zbv: any n_micro >= 1 (ScheduleZBVZeroBubble plans max(2 pp - 1, n_micro) and drops the
      micro-batches beyond n_micro);
    - dualpipev: ScheduleDualPipeV raises for n_micro < 2 pp (its stages).
    The pipeline checks this again at run time (parallel/pipeline/schedule.py).
    """
    if pp <= 1:
        return None
    if schedule == "1f1b" and n_micro < pp:
        return (f"train.grad_accum_steps={n_micro} < parallel.pp={pp}: 1f1b needs at least one "
                f"micro-batch per stage in flight; set train.grad_accum_steps>={pp} "
                "(or parallel.pp_schedule=gpipe)")
    if schedule == "dualpipev" and n_micro < 2 * pp:
        return (f"train.grad_accum_steps={n_micro} < 2 * parallel.pp={2 * pp}: dualpipev needs at least one "
                f"micro-batch per stage (2 per rank); set train.grad_accum_steps>={2 * pp}")
    if schedule in ("interleaved_1f1b", "zb1p"):
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            fits = [n for n in range(1, 2 * n_micro + pp) if n % max(1, n // pp) == 0]
            below = max(n for n in fits if n < n_micro)
            above = min(n for n in fits if n > n_micro)
            return (f"train.grad_accum_steps={n_micro} does not fit {schedule} on parallel.pp={pp}: "
                    f"torch runs {rounds} rounds of equal size (grad_accum_steps // pp), and {n_micro} "
                    f"is not a multiple of {rounds}; set train.grad_accum_steps={below} or {above}")
    return None


def consistent_batch(cfg: Config) -> str:
    """One micro x accum x dp set the batch and pipeline rules all accept, as the overrides to
    give (a refusal proposes it whole instead of one knob at a time): the given global batch
    kept where some micro batch no larger than the given one divides it, else the nearest
    global batch above it at the given micro batch."""
    t, p = cfg.train, cfg.parallel
    micro = t.micro_batch_size or 1
    glob = t.global_batch_size or micro * (t.grad_accum_steps or 1) * p.dp

    def fits(accum: int) -> bool:
        return accum >= 1 and pipeline_micro_batch_problem(p.pp_schedule, p.pp, accum) is None

    pick = next(((m, glob // (m * p.dp)) for m in range(micro, 0, -1)
                 if glob % (m * p.dp) == 0 and fits(glob // (m * p.dp))), None)
    if pick is None:
        accum = max(1, -(-glob // (micro * p.dp)))
        while not fits(accum):
            accum += 1
        pick = (micro, accum)
    m, a = pick
    return f"train.micro_batch_size={m} train.grad_accum_steps={a} train.global_batch_size={m * a * p.dp}"
