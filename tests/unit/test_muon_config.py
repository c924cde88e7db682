"""``optim=muon``: the conf group composes and validates; what Muon does not run under is refused
before launch, naming the knob and the reason."""

import pytest

from trainer3d.config.validate import ConfigError, validate
from trainer3d.optim.muon import adjusted_lr, is_muon_param
from tests.unit.test_validate import make


def test_optim_muon_composes_and_validates():
    cfg = validate(make(["optim=muon", "parallel.zero_stage=1"]))
    m = cfg.optim.muon
    assert (cfg.optim.name, m.momentum, m.nesterov, m.ns_steps, m.adjust_lr) == ("muon", 0.95, True, 5, "original")


@pytest.mark.parametrize("overrides,fragment", [
    (["parallel.zero_stage=2"], "optim.name=muon with parallel.zero_stage=2"),
    (["parallel.zero_stage=3"], "Newton-Schulz needs the whole matrix"),
    (["parallel.offload_optimizer=true"], "set parallel.offload_optimizer=false"),
    (["train.dtype=fp16"], "use train.dtype=bf16 or fp32"),
    (["optim.muon.adjust_lr=rms"], "optim.muon.adjust_lr=rms is not one of original, match_rms_adamw"),
    (["optim.muon.ns_steps=0"], "optim.muon.ns_steps=0 must be in [1, 100)"),
    (["optim.muon.momentum=1.0"], "optim.muon.momentum=1.0 must be in [0, 1)"),
    (["optim.muon.ns_dtype=fp16"], "optim.muon.ns_dtype=fp16 is not one of bf16, fp32"),
])
def test_bad_muon_settings_are_refused_naming_the_knob(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        validate(make(["optim=muon", *overrides]))
    assert fragment in str(err.value), str(err.value)


def test_the_groups_and_scales():
    """Muon: the blocks' matrices (and stacked experts); AdamW: embedding, head, norms. The scales
    are torch's formulas (torch/optim/_muon.py, _adjust_lr) by hand: 4x1 -> sqrt(4), 1x4 -> 1."""
    import torch
    assert is_muon_param("layers.0.attention.wq.weight", torch.empty(4, 4))
    assert is_muon_param("layers.1.feed_forward.experts.w1", torch.empty(2, 4, 8))
    assert not is_muon_param("layers.0.attention_norm.weight", torch.empty(4))
    assert not is_muon_param("tok_embeddings.weight", torch.empty(8, 4))
    assert not is_muon_param("output.weight", torch.empty(8, 4))
    assert adjusted_lr(0.1, "original", (4, 1)) == pytest.approx(0.2)
    assert adjusted_lr(0.1, "original", (1, 4)) == pytest.approx(0.1)
    assert adjusted_lr(0.1, "match_rms_adamw", (16, 4)) == pytest.approx(0.1 * 0.2 * 4)
