"""Mixture-of-experts memory: the model states and saved activations trainer3d/memory/ charges
(states.py's shapes of both block kinds, moe.py's terms, peak.py's sums) held to the bytes real
ranks hold and autograd saves (tests/support/moe_memory_ranks.py), to the byte."""

import pytest

from tests.support.harness import run_ranks
from tests.support.moe_memory_ranks import measure, moe_config
from trainer3d.config.validate import validate
from trainer3d.memory.dry_run import describe_plan
from trainer3d.memory.peak import rank_memory
from trainer3d.memory.states import format_bytes

# Grouped by world size (one set of ranks each). Without expert parallelism a rank computes
# exactly tokens x top_k routed slots whatever the routing, so both figures are exact. With
# ep the slots a rank receives depend on every rank's routing: routed to all 4 experts
# (top_k=4), each rank receives exactly the balanced expectation the estimate charges.
# With parallel.offload_optimizer the host bytes (both halves' under ep) are held to the
# accounting's ``host`` and the device's to its total, which then holds no master or moment.
LAYOUTS = {
    1: [dict(), dict(dtype="bf16", router="sigmoid_topk", zero=0), dict(dtype="bf16", zero=0, offload=True)],
    2: [dict(dp=2), dict(dp=2, zero=0, dtype="bf16"), dict(tp=2), dict(tp=2, sp=True, micro=1),
        dict(dp=2, ep=2, top_k=4), dict(dp=2, ep=2, top_k=4, zero=0), dict(dp=2, offload=True),
        dict(dp=2, ep=2, top_k=4, offload=True), dict(dp=2, ep=2, top_k=4, zero=0, dtype="bf16", offload=True)],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_moe_states_and_saved_activations_are_the_accounting_to_the_byte(world):
    layouts = LAYOUTS[world]
    results = run_ranks(measure, world, layouts, timeout=600)
    for i, layout in enumerate(layouts):
        cfg = validate(moe_config(**layout))
        mem = rank_memory(cfg, 0)
        # the dry run prints this accounting: its saved-activation and model-state figures are the measured ones
        lines = describe_plan(cfg).splitlines()
        saved = next(line for line in lines if "activations (saved)" in line).split()
        assert saved[-2:] == format_bytes(results[0][i]["peak"]).split(), (layout, saved)
        states = next(line for line in lines if line.split()[:1] == ["0"] and "/" in line).split()
        assert states[2:4] == format_bytes(results[0][i]["states"]).split(), (layout, states)
        for got in (r[i] for r in results):
            where = f"{layout} tp rank {got['tp_rank']} dp rank {got['dp_rank']}"
            assert got["left"] == 0, where  # backward released every saved tensor
            assert got["states"] == mem.states.total, (where, got["states"], mem.states)
            assert got["host"] == mem.states.host, (where, got["host"], mem.states)
            assert (got["host"] > 0) == layout.get("offload", False), where
            assert got["peak"] == mem.activation_bytes, (where, got["peak"], mem.activations)
