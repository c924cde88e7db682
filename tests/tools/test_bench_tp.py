"""tools/bench/tp.py runs both variants on the same model and prints their ratio."""

import re

from tests.conftest import ROOT
from tests.support.run_scripts import run_here


def test_bench_tp_trains_the_same_model_and_prints_a_ratio():
    proc = run_here(ROOT / "tools" / "bench" / "tp.py", ["--dim", "64", "--layers", "2", "--seq-len", "32",
                                                         "--steps", "2", "--warmup", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ours|DTensor TP)\s+[\d.]+\s+([\d.]+)$",
                                                               proc.stdout, re.M)}
    assert rows.keys() == {"ours", "DTensor TP"}, proc.stdout
    assert abs(rows["ours"] - rows["DTensor TP"]) < 1e-3, proc.stdout  # the same model, trained alike
    assert re.search(r"DTensor / ours: \d+\.\d\d x step time", proc.stdout)
