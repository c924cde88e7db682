"""tools/bench/offload.py times the engine's host AdamW step beside its candidates and prints the
throughput on its last line (run here at a tiny size, without DeepSpeed)."""

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_offload_prints_each_variant_and_the_host_step_last():
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "offload.py"), "--params", "100000", "--steps", "2",
           "--threads", "2", "--no-deepspeed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^(fused, 1 thread|fused, 2 Python threads|foreach|ours)\s+([\d.]+)$", proc.stdout, re.M))
    assert rows.keys() == {"fused, 1 thread", "fused, 2 Python threads", "foreach", "ours"}, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"host AdamW step: ([\d.]+) Mparam/s", last), last
    assert float(last.split()[3]) == float(rows["ours"]) > 0
