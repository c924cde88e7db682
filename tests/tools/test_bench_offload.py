"""tools/bench/offload.py times the engine's host AdamW step beside torch's kernel, a round of
each in turn, and prints the throughput on its last line (run here at a tiny size, without
DeepSpeed)."""

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_offload_prints_rounds_medians_and_the_host_step_last():
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "offload.py"), "--params", "100000", "--steps", "3",
           "--threads", "2", "--no-deepspeed", "--foreach"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", proc.stdout, re.M)
    assert [int(r[0]) for r in rounds] == [1, 2, 3], proc.stdout
    rows = {m[0]: (float(m[1]), float(m[2]))
            for m in re.findall(r"^(ours|torch fused|foreach)\s+([\d.]+)\s+([\d.]+)$", proc.stdout, re.M)}
    assert rows.keys() == {"ours", "torch fused", "foreach"}, proc.stdout
    ours = [float(r[1]) for r in rounds]
    assert rows["ours"][1] == max(ours) > 0
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"host AdamW step: ([\d.]+) Mparam/s", last), last
    assert float(last.split()[3]) == rows["ours"][1]
