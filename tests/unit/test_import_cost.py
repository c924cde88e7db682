"""What a fresh process imports: every run of the entry point starts one launcher and one
interpreter per rank, and each pays for its imports (tests/README.md, "What each tier costs").

torch.distributed.pipelining imports torch._dynamo, and torch._inductor's config pulls in
inductor: seconds of CPU that only a pp > 1 layout, cp > 1 or ``train.compile`` uses. The
ranks ``--calibrate`` spawns import torch alone (trainer3d/plan/calibrate_ranks.py)."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_PROBE = """
import json, sys
def loaded(names):
    return sorted(n for n in names if n in sys.modules)
import trainer3d.plan.calibrate_ranks
ranks = loaded(["trainer3d.plan.calibrate", "trainer3d.plan.search", "trainer3d.model", "hydra"])
import trainer3d.train
import trainer3d.rank.task
entry = loaded(["torch._dynamo", "torch._inductor", "torch.distributed.pipelining"])
print(json.dumps({"ranks": ranks, "entry": entry}))
"""


def test_a_rank_and_the_launcher_import_no_compiler_or_pipelining():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == {"ranks": [], "entry": []}, found
