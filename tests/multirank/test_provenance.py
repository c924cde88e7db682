"""trainer3d-provenance's token ids against what the ranks actually read (trainer3d/tools/provenance.py).

Each layout trains steps 0-2 at a global batch of 4 (a checkpoint at step 3), then resumes at a
global batch of 8 for steps 3-5 with step 4 skipped (train.skip_steps). Every rank's data
loader is hooked to record the batches the trainer took; the tool, given only the run dir, must give the
same ids for every step and data-parallel rank (inputs on the first stage, targets on the
last), and call step 4 skipped.
"""

import contextlib
import io

import numpy as np
import pytest

from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.data.loader import Prefetcher
from trainer3d.tools.provenance import provenance

SKIPPED = 4


def _cfg(run_dir, tp, pp, dp, batch, steps, resume):
    cfg = Config(run_dir=run_dir)
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.timeout_s = tp, pp, dp, 120
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 32, 2, 2, 2, 64
    t = cfg.train
    # two sequences a micro-batch (fewer rounds of collectives) where no pipeline needs
    # grad_accum_steps >= pp: one a micro-batch there
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2 if pp == 1 else 1, batch, None, 16
    t.max_steps, t.log_every, t.eval_every, t.resume = steps, 1, 0, resume
    t.skip_steps = [SKIPPED] if steps > SKIPPED else []
    cfg.checkpoint.async_save = False
    return validate(cfg)


def _train(rank, world, run_dir, tp, pp, batch, steps, resume):
    dp = world // (tp * pp)
    read = []
    real = Prefetcher.get

    def get(prefetcher, step):  # what the trainer takes for ``step`` (not what is read ahead)
        inputs, targets = real(prefetcher, step)
        read.append((step, prefetcher.reader.dp_rank, None if inputs is None else inputs.tolist(),
                     None if targets is None else targets.tolist()))
        return inputs, targets
    Prefetcher.get = get
    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(_cfg(run_dir, tp, pp, dp, batch, steps, resume), dims_for(tp=tp, pp=pp, dp=dp)).train()
    return read


from trainer3d.trainer import Trainer  # noqa: E402  (after the hook's target is imported)


@pytest.mark.slow
# dp2, and pp2 x dp2: a rank's data-parallel rank is not its global rank there, and the inputs
# (first stage) and the targets (last) are read by different ranks. That a tensor-parallel rank
# reads its data-parallel rank's batch is what every tp layout's parity run shows.
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 2), (1, 2, 2)], ids=["dp2", "pp2xdp2"])
def test_provenance_gives_the_ids_the_ranks_read(tmp_path, tp, pp, dp):
    world = tp * pp * dp
    first = run_ranks(_train, world, str(tmp_path), tp, pp, 4, 3, "auto", timeout=600)
    second = run_ranks(_train, world, str(tmp_path), tp, pp, 8, 6, "auto", timeout=600)
    read = [r for rank in first + second for r in rank]
    assert {step for step, *_ in read} == {0, 1, 2, 3, 5}  # step 4 skipped: no reader read it
    checked = 0
    for step in range(6):
        got = provenance(tmp_path, step)
        assert got["skipped"] == (step == SKIPPED)
        assert got["global_batch_size"] == (4 if step < 3 else 8)
        for _, dp_rank, inputs, targets in (r for r in read if r[0] == step):
            windows = np.array([sample["ids"] for sample in got["ranks"][dp_rank]])
            if inputs is not None:
                assert np.array(inputs).reshape(len(windows), -1).tolist() == windows[:, :-1].tolist()
                checked += 1
            if targets is not None:
                assert np.array(targets).reshape(len(windows), -1).tolist() == windows[:, 1:].tolist()
                checked += 1
    assert checked >= 5 * world  # every rank's reads of the five trained steps (pp stages: one side each)
