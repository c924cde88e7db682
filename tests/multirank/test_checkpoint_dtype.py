"""Resuming in another train.dtype (and ZeRO stage): the fp32 weights carry over exactly.

A bf16 run with ZeRO-1 keeps its exact weights as fp32 masters (``optim.master.*``) beside
the bf16 parameters; an fp32 run or ZeRO-2/3 (FSDP, fp32 parameters) keeps none. Each case
saves after 2 steps on one rank and resumes with max_steps = 2 (nothing trained after the
load), then compares the resumed run's fp32 weights — the parameters of an fp32 run, the
masters of a bf16 one — with the checkpoint's own fp32 copy, read independently with the
export loader. Before loads were planned per dtype, fp32 -> bf16 died on a missing key and
bf16 -> fp32 took the bf16-rounded weights.
"""

import pytest
import torch

from tests.support.harness import dims_for, run_ranks
from trainer3d.checkpoint import store
from trainer3d.checkpoint.export import load_full_model
from trainer3d.config.schema import Config
from trainer3d.trainer import Trainer
from trainer3d.config.validate import validate


def _train(rank, world, run_dir, dtype, zero_stage, resume):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.zero_stage, cfg.parallel.timeout_s = zero_stage, 60
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 32
    t.max_steps, t.log_every, t.dtype, t.resume = 2, 1, dtype, resume
    cfg.model.n_layers = 2
    trainer = Trainer(validate(cfg), dims_for())
    trainer.train()
    by_kind = {"master": {}, "param": {}}  # one rank: every view covers its whole parameter
    for view in trainer.optimizer.checkpoint_views():
        for kind in by_kind:
            if kind in view.tensors:
                by_kind[kind][view.name] = view.tensors[kind].detach().float().reshape(view.local_shape).numpy().copy()
    return {**by_kind["param"], **by_kind["master"]}  # numpy: tensors do not cross processes here


CASES = [("bf16", 1, "fp32", 0, "optim.master."), ("fp32", 0, "bf16", 1, "model."),
         ("bf16", 3, "bf16", 1, "model.")]


@pytest.mark.parametrize("saved_dtype,saved_zero,dtype,zero,exact", CASES,
                         ids=[f"{a}-zero{b}-to-{c}-zero{d}" for a, b, c, d, _ in CASES])
def test_resume_in_another_dtype_keeps_the_fp32_weights(tmp_path, saved_dtype, saved_zero, dtype, zero, exact):
    run_ranks(_train, 1, str(tmp_path / "a"), saved_dtype, saved_zero, "never", timeout=300)
    path = store.step_dir(tmp_path / "a" / "checkpoints", 2)
    resumed = run_ranks(_train, 1, str(tmp_path / "b"), dtype, zero, str(path), timeout=300)[0]
    reference = load_full_model(path, prefix=exact)
    assert reference and reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert tensor.dtype == torch.float32, (name, tensor.dtype)
        assert torch.equal(torch.from_numpy(resumed[name]), tensor), name
