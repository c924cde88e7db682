"""MoE under expert parallelism compiled trains the one-process model.

A 2-layer MoE (4 experts, all active, a shared expert, aux and z losses weighted strongly
enough that a wrong scale of their gradient shows in the loss) for 20 steps of 8 sequences x
32 tokens, on Trainer ranks, against the eager single process of the same config: per-step
losses within relative 1e-5, and every step's routed counts adding up to tokens x top_k per
layer (a hand count: a token counted twice, or once too few, would not).
Every expert takes every token (top_k = num_experts), as in test_moe_parity.py, so no
near-tie of the router's scores can go another way in a layout (docs/moe.md).

The layouts this file no longer trains are proven by runs of the parity model: pp2 1F1B by
test_moe_offload.py's pp2 x dp2 ep2 (its counts checked by hand there too); cp with the ring and
recomputation, and cp x dp, by test_moe_ep_parity.py's cp2 x dp2 ep4 with recomputation
(all_gather's exchange is attention's alone: tests/multirank/test_context_parity.py); one
compiled process by the compiled dp2 ep2 here and tests/unit/test_moe.py's compiled block, held
to eager's gradients.
"""

import json
from pathlib import Path

import pytest

from tests.support.compiled import aot_graphs, inductor_graphs
from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer

STEPS, BATCH, SEQ, EXPERTS = 20, 8, 32, 4


def _train(rank, world, run_dir, cp=1, dp=1, attention="ring", recompute=False, compile_=False, pp=1, ep=1):
    cfg = Config(run_dir=run_dir)
    p = cfg.parallel
    p.cp, p.dp, p.pp, p.ep, p.cp_attention, p.timeout_s = cp, dp, pp, ep, attention, 60
    t = cfg.train
    # micro-batches of 4: two per step on one rank (one per dp rank), each a round of the
    # layout's collectives; the tokens a step trains are the same at any split
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 4, BATCH, None, SEQ
    t.max_steps, t.log_every, t.activation_checkpointing, t.compile = STEPS, 1, recompute, compile_
    t.compile_backend = "aot_eager"  # the subject is what dynamo leaves eager, not inductor's code (test_compile.py's)
    cfg.checkpoint.save_final = False
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 5
    cfg.model.n_layers = 2
    m = cfg.model.moe
    m.num_experts, m.top_k, m.expert_ffn_dim, m.num_shared_experts = EXPERTS, EXPERTS, 64, 1
    m.aux_loss_coef, m.z_loss_coef = 0.1, 0.01
    Trainer(validate(cfg), dims_for(dp=dp, cp=cp, pp=pp, ep=ep)).train()
    if compile_:  # the graphs compiled, and why dynamo split the blocks (torch/_dynamo/utils.py's counters)
        from torch._dynamo.utils import counters
        return aot_graphs(), inductor_graphs(), sorted(counters["graph_break"])
    return 0, 0, []


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-one-process")
    run_ranks(_train, 1, str(run_dir), timeout=600)
    return _rows(run_dir)


LAYOUTS = {
    # expert parallelism compiled: the blocks compiled, the dispatch (it reads its split sizes
    # on the host: parallel/expert/dispatch.py) and the losses' bookkeeping (model/moe.py) eager
    # between the block's compiled pieces
    "dp2-ep2-compile": (2, dict(dp=2, ep=2, compile_=True)),
}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # compile (aot_eager) traces on every rank at once on 2 loaded cores
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(tmp_path, reference, name):
    world, layout = LAYOUTS[name]
    compiled = run_ranks(_train, world, str(tmp_path), *_args(layout), timeout=1200)
    rows = _rows(tmp_path)
    assert len(rows) == len(reference) == STEPS
    worst = max(abs(r["loss"] - ref["loss"]) / ref["loss"] for r, ref in zip(rows, reference))
    print(f"{name}: worst relative loss difference {worst:.1e}")
    assert worst <= 1e-5
    graphs, inductor, breaks = zip(*compiled)
    # compiled where asked, on every rank, by aot_eager (tests/support/compiled.py's counts)
    assert [(bool(g), i) for g, i in zip(graphs, inductor)] == [(bool(layout.get("compile_")), 0)] * world, compiled
    if layout.get("ep", 1) > 1 and layout.get("compile_"):
        # the dispatch runs eagerly as a whole: dynamo never traces its host reads of the counts
        print(f"{name}: graph breaks: {[reason.splitlines()[0] for reason in breaks[0]]}")
        host_reads = ("Tensor.item()", "tolist", "_local_scalar_dense")
        assert not [r for rank in breaks for r in rank if any(read in r for read in host_reads)], breaks
    for row in rows:
        for layer in range(2):
            assert sum(row[f"moe_tokens/L{layer}/E{e}"] for e in range(EXPERTS)) == BATCH * SEQ * EXPERTS


def _args(layout):
    """``_train``'s positional arguments after the run dir (run_ranks passes no keywords)."""
    return (layout.get("cp", 1), layout.get("dp", 1), layout.get("attention", "ring"),
            layout.get("recompute", False), layout.get("compile_", False), layout.get("pp", 1), layout.get("ep", 1))
