"""What a fresh process imports: every run of the entry point starts one launcher and one
interpreter per rank, and each pays for its imports (tests/README.md, "What each tier costs").

torch.distributed.pipelining imports torch._dynamo, and torch._inductor's config pulls in
inductor: seconds of CPU that only a pp > 1 layout, cp > 1 or ``train.compile`` uses (so do
``torch.compiler.disable``, which compile applies to a model's eager parts, and a DTensor's
constructor, which a checkpoint's pieces are not: trainer3d/parallel/compile.py ``leave_eager``,
trainer3d/checkpoint/state.py ``Pieces``);
torch.distributed.checkpoint, torch.distributed.tensor and torch.distributed.fsdp import sympy,
which only a save, a load or ZeRO-2/3 needs (docs/performance.md, "A process's start and
exit"). The ranks ``--calibrate`` starts fork from a server that imports torch and, by name, what
an engine probe's rank runs (trainer3d/plan/calibrate_ranks.py); importing that module imports
neither the planner nor Hydra.
The submitting process imports torch (2-3 s of CPU) only in the checks that ask it, where they
run: the GPU count of a ``train.device=auto`` run, the memory estimate's block on the meta
device, a checkpoint's metadata pickle, ``dry_run``, ``model.init_from``. Composing and
validating the config, ``--help``, a refusal, the device rules of a CPU run, the data and
run-dir checks and the submission itself import none."""

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from tests.conftest import BYTECODE_TREES, ROOT

_PROBE = """
import json, sys
def loaded(names):
    return sorted(n for n in names if n in sys.modules)
import trainer3d.plan.calibrate_ranks
ranks = loaded(["trainer3d.plan.calibrate", "trainer3d.plan.search", "trainer3d.model", "hydra"])
import trainer3d.rank.task
task = loaded(["hydra", "omegaconf", "yaml", "antlr4"])
import trainer3d.train
import trainer3d.rank.task
entry = loaded(["torch._dynamo", "torch._inductor", "torch.distributed.pipelining", "sympy", "torch.distributed.tensor",
                "torch.distributed.checkpoint", "torch.distributed.fsdp", "trainer3d.rank.body", "trainer3d.trainer",
                "trainer3d.plan.search"])
import dataclasses, gc, tempfile
from trainer3d.config.schema import Config
with tempfile.TemporaryDirectory() as tmp:  # the launcher's checks, refused at the data check after the memory estimate
    cfg = Config(run_dir=tmp)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=16),
                              train=dataclasses.replace(cfg.train, device="cpu"))
    collections = [s["collections"] for s in gc.get_stats()]
    status = trainer3d.train.run(cfg, entry_point=True)  # as python -m trainer3d.train's process
    full = gc.get_stats()[2]["collections"] - collections[2]  # over every object, torch's included
    launcher = [status, "torch" in sys.modules, full, gc.get_freeze_count() > 100000]
gc.unfreeze()
import torch
from trainer3d.config.schema import ModelConfig, MoEConfig
from trainer3d.model.transformer import Transformer
with torch.device("meta"):
    Transformer(ModelConfig())  # the tiny model
    Transformer(ModelConfig(moe=MoEConfig(num_experts=4)))  # a mixture of experts
entry += loaded(["torch._dynamo"])
import tempfile
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from trainer3d.checkpoint.state import PieceMaker
with tempfile.TemporaryDirectory() as tmp:  # a save of one rank's pieces
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    dcp.save({"w": PieceMaker()(torch.zeros(6), (2, 3), None, 0, 6)}, checkpoint_id=f"{tmp}/checkpoint")
    dist.destroy_process_group()
save = loaded(["torch._dynamo"])
import gc
collections = [s["collections"] for s in gc.get_stats()]
frozen = [gc.get_freeze_count()]
trainer3d.rank.task.rank_body()  # the body's import, as TrainTask runs it
body = [after - before for before, after in zip(collections, [s["collections"] for s in gc.get_stats()])]
frozen.append(gc.get_freeze_count() > 100000)
loop = loaded(["jinja2", "tokenizers", "trainer3d.trainer"])
import atexit
trainer3d.rank.task.skip_exit_collection()
alive = [[n] for n in range(1000)]  # what the run made after the body's import
frozen.append(len(gc.get_objects()) >= 1000)
atexit._run_exitfuncs()
frozen.append(len(gc.get_objects()))  # left to Python's last collection
print(json.dumps({"ranks": ranks, "task": task, "entry": entry, "launcher": launcher, "save": save, "body": body,
                  "loop": loop, "frozen": frozen, "collector": gc.isenabled()}))
"""


def test_a_rank_and_the_launcher_import_no_compiler_or_pipelining():
    """Submitit's task (trainer3d/rank/task.py, with the config a rank unpickles) imports no Hydra
    or OmegaConf: a rank composes nothing (trainer3d/config/composed.py; the body's modules are
    held to it by tests/unit/test_imports.py). Neither the task nor the launcher imports DCP,
    DTensor or FSDP2 (which bring sympy), the rank's body, the loop or the planner's search: a
    rank imports those as it runs (trainer3d/rank/task.py ``TrainTask``, trainer3d/rank/body.py),
    DCP where a checkpoint is saved or read, FSDP2 for ZeRO-2/3. Building a model on the meta
    device (every rank, the memory estimate), a mixture of experts too, imports no
    torch._dynamo, nor does a save of a checkpoint's pieces; the loop imports no chat
    template or tokenizer library (only data=chat_sample uses them). The submitting process's
    checks (trainer3d/train.py ``run``), which import torch for the memory estimate, and the
    rank's body run with the garbage collector off: no collection during them nor after (no full
    one in the submitting process's run at all; the body's import, none of any generation), and
    what they imported frozen (trainer3d/rank/task.py ``imports_frozen``), the collector on
    again. At exit,
    once the exit handlers have run, what is alive since is frozen too, so Python's last
    collection skips it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == {"ranks": [], "task": [], "entry": [], "launcher": [2, True, 0, True], "save": [],
                     "body": [0, 0, 0], "loop": ["trainer3d.trainer"], "frozen": [0, True, True, 0],
                     "collector": True}, found


_LAUNCHER = """
import json, runpy, sys
import cloudpickle
import trainer3d.train, trainer3d.launch.local, trainer3d.launch.slurm, trainer3d.launch.follow, trainer3d.launch.sweep
from trainer3d.config.schema import Config
from trainer3d.rank.task import TrainTask
cloudpickle.dumps(TrainTask(Config()))  # as submitit pickles the task: by reference to its module
sys.argv = ["trainer3d.train", *sys.argv[1:]]
try:
    runpy.run_module("trainer3d.train", run_name="__main__")
except SystemExit as stop:
    status = stop.code
print(json.dumps({"status": status, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_the_submitting_process_imports_no_torch(tmp_path):
    """The entry point's own work on a fresh CPU run, in one interpreter: the launcher's modules,
    the pickled ``TrainTask`` (trainer3d/rank/task.py), then ``python -m trainer3d.train`` composing,
    resolving and validating the config, choosing the checkpoint to resume (none yet), checking
    the devices and the data, which refuses the run (a vocabulary the model cannot embed): no
    module of torch is imported on the way (the memory estimate, which builds on the meta
    device, is off here: trainer3d/preflight/refusal.py ``estimate_problems``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    args = ["train.device=cpu", "launcher.check_memory=false", "model.vocab_size=16", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data error: " in proc.stderr and "model.vocab_size=16" in proc.stderr, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"status": 2, "torch": []}


def test_every_module_a_fresh_process_imports_has_current_bytecode():
    """tests/conftest.py compiles the package, the tests and the tools once before any worker
    starts, so a fresh interpreter reads each module's bytecode instead of compiling its source,
    where ``PYTHONDONTWRITEBYTECODE`` keeps Python from writing it: every cache exists and records
    its source's current modification time and size (a timestamp-checked .pyc, PEP 552)."""
    stale = []
    for tree in BYTECODE_TREES:
        for source in (ROOT / tree).rglob("*.py"):
            cache = Path(importlib.util.cache_from_source(str(source)))
            stat = source.stat()
            want = struct.pack("<4sIII", importlib.util.MAGIC_NUMBER, 0, int(stat.st_mtime) & 0xFFFFFFFF,
                               stat.st_size & 0xFFFFFFFF)
            if not cache.exists() or cache.read_bytes()[:16] != want:
                stale.append(str(source.relative_to(ROOT)))
    assert not stale, f"{len(stale)} modules without current bytecode, e.g. {stale[:5]}"
