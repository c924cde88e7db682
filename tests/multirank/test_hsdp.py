"""Hybrid sharding (HSDP, ``parallel.dp_shard``): FSDP2 on a 2-D (replicate, shard) mesh trains
the single-process model (fp32, relative 1e-5 over 20 steps), and each rank holds the shard of
its shard group's place, the same as its replicas.
"""

import pytest

from tests.support.runs import PARITY, assert_parity, losses_in_ranks, reference_losses

LAYOUTS = [
    ("parallel.zero_stage=3", "parallel.dp=4", "parallel.dp_shard=2"),
    ("parallel.zero_stage=2", "parallel.tp=2", "parallel.dp=4", "parallel.dp_shard=2",
     "parallel.sequence_parallel=true"),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[" ".join(o.split(".")[-1] for o in lay) for lay in LAYOUTS])
def test_hsdp_matches_single_process(tmp_path, session_tmp, layout):
    ref = reference_losses(session_tmp, PARITY)
    assert_parity(losses_in_ranks(tmp_path, [*PARITY, "parallel=single", *layout]), ref)
