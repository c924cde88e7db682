"""tools/bench/tp.py runs both variants on the same model and prints their ratio."""

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_tp_trains_the_same_model_and_prints_a_ratio():
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "tp.py"), "--dim", "64", "--layers", "2",
           "--seq-len", "32", "--steps", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ours|DTensor TP)\s+[\d.]+\s+([\d.]+)$",
                                                               proc.stdout, re.M)}
    assert rows.keys() == {"ours", "DTensor TP"}, proc.stdout
    assert abs(rows["ours"] - rows["DTensor TP"]) < 1e-3, proc.stdout  # the same model, trained alike
    assert re.search(r"DTensor / ours: \d+\.\d\d x step time", proc.stdout)
