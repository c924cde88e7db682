import math

from trainer3d.config.schema import OptimConfig
from trainer3d.optim.schedule import lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 110) == 0.1
    assert lr_at(9, cfg, 110) == 1.0
    assert lr_at(10, cfg, 110) == 1.0
    assert math.isclose(lr_at(60, cfg, 110), 0.55)  # half way down the cosine
    assert math.isclose(lr_at(110, cfg, 110), 0.1) and math.isclose(lr_at(500, cfg, 110), 0.1)
    lrs = [lr_at(s, cfg, 110) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
