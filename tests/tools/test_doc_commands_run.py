"""Every command README.md, docs/*.md and tools/README.md print: run for real where a CPU runs
it in a short budget, else named with the reason it is only parsed.

tests/unit/test_doc_commands.py parses every command (its tool's argparse, Hydra's grammar, the
config's validation, the planner in process); this tier runs the ones a CPU can, as a user
types them (``python -m MODULE`` or ``python tools/X.py``, as the interpreter runs it:
tests/support/run_scripts.py), from a scratch directory holding the tiny inputs the test made,
one after another in one fresh interpreter (torch, Hydra and the engine imported once, not once
per command):

- ``--help`` of the entry points;
- ``python -m trainer3d.plan ...`` on the default model (no ``model=`` or ``experiment=``): the entry point's
  search or refusal, its exit status and its proposed commands; a named model's search is
  tests/unit/test_doc_commands.py's, run once in process with the page's printed output
  checked (dates, times and job ids masked);
- ``python -m trainer3d.plan --calibrate --max-ranks 2 --quick --out FILE``: the smallest calibration,
  its file read back by the planner as ``cluster.gpu=calibrated``;
- ``python -m trainer3d.train ... dry_run=true`` without a user's model or data: the dry run;
  ``--cfg job``: the resolved config;
- ``python tools/prepare_data.py`` on text files made by the test;
- the workflow after a run — ``tools/export_model.py``, ``tools/sample.py`` (of the checkpoint
  and of the export) and ``tools/plot_metrics.py`` — on a two-step run of the tiny model the
  test trains, its paths put where the page has ``outputs/...``, ``exported/`` or ``llama-ft/``;
  these in the test's own process (``run_here``), which has torch and the engine imported.

A command that is neither run here nor given a reason in ``NOT_RUN`` fails
``test_every_documented_command_is_run_or_has_a_reason``, so a new documented command is
either run or says why not.
"""

import json
import math
import os
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support.run_scripts import run_all, run_here
from tests.unit.test_doc_commands import DEFAULT_MODEL_PLAN, HELP, _commands_of, assert_shows, shown_output

pytestmark = pytest.mark.slow

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "README.md"]


def documented():
    """(page, command) of every command the pages print, each once."""
    seen, found = set(), []
    for page in PAGES:
        for command in _commands_of(page.read_text()):
            if command not in seen:
                seen.add(command)
                found.append((str(page.relative_to(ROOT)), command))
    return found


PY = r"^(?:\.venv/bin/)?python3? "
RUN = {  # what runs for real here: a pattern of the command -> how it is run (below)
    "help": HELP,  # these two: test_doc_commands.py's RUN_TIER, which that file leaves to this one
    "calibrate": re.compile(PY + r"-m trainer3d\.plan --calibrate --max-ranks 2 --quick --out \S+$"),
    "plan": DEFAULT_MODEL_PLAN,
    "print_config": re.compile(PY + r"-m trainer3d\.train --cfg job$"),
    "dry_run": re.compile(PY + r"-m trainer3d\.train (?!.*(?:init_from|data\.path|launcher=slurm))"
                          r".*\bdry_run=true\b"),
    "prepare_data": re.compile(PY + r"tools/prepare_data\.py --out data/notes\.bin my_texts/ notes\.md$"),
    "after_a_run": re.compile(PY + r"tools/(?:export_model|sample|plot_metrics)\.py (?:outputs/|exported/|llama-ft/)"),
}
NOT_RUN = [  # the first pattern a command matches gives the reason it is only parsed
    (r"-m trainer3d\.plan (?!--).*\b(?:model|experiment)=", "a named model's search: tests/unit/test_doc_commands.py runs it in process "
     "with every check, its printed output too (one run per command; this tier runs the entry point on the default model)"),
    (r"^python3 -m venv|pip install", "set-up: tests/unit/test_help_install.py installs the package"),
    (r"-m pytest", "the suite itself"),
    (r"^tensorboard ", "TensorBoard's own command"),
    (r"^python -c ", "needs an export: tests/integration/test_export_standard.py loads one with transformers"),
    (r"model\.init_from=|--tokenizer \S*models/|hf_import\.py", "needs a downloaded Hugging Face model"),
    (r"launcher=slurm|^sbatch ", "needs a Slurm cluster (tests/slurm)"),
    (r"gpus_per_node=\d+ .*train\.dtype=bf16|launcher\.gpus_per_node|tools/bench/gpu|offload_optimizer=true",
     "needs GPUs"),
    (r"outputs/|llama-ft/|exported/|--calibration FILE|--against <", "needs a run's checkpoint or files"),
    (r"data\.path=|data\.blend=|web_text_document|web/|src/ docs/", "needs the user's data"),
    (r"-m trainer3d\.plan --calibrate$", "minutes: every probe up to 8 ranks (the run tier runs --max-ranks 2 --quick)"),
    (r"tools/bench/", "a benchmark: minutes (tests/tools smoke-runs each at its smallest size)"),
    (r"tools/plot_schedule\.py .*--out docs/", "redraws docs/'s pictures: tests/tools/test_plot_schedule.py runs the tool "
     "into a scratch folder and reads each image back against torch's action lists"),
    (r"tools/parity\.py", "two training runs: minutes (tests/tools/test_parity_tool.py runs it small)"),
    (r"-m trainer3d\.tools\.prepare_data$", "the module form of tools/prepare_data.py, run above"),
    (r"-m trainer3d\.tools\.provenance$", "needs a run's checkpoints: tests/multirank/test_provenance.py runs it "
     "on three layouts' run dirs"),
    (r"-m trainer3d\.train", "a training run: minutes on CPU ranks (tests/integration runs the entry point)"),
]


def kind_of(command: str):
    """("run", how) or ("parsed", reason) or (None, None) for a command no rule covers."""
    for how, pattern in RUN.items():
        if pattern.search(command):
            return "run", how
    for pattern, reason in NOT_RUN:
        if re.search(pattern, command):
            return "parsed", reason
    return None, None


def test_every_documented_command_is_run_or_has_a_reason():
    uncovered = [(page, c) for page, c in documented() if kind_of(c)[0] is None]
    assert not uncovered, f"documented commands neither run nor given a reason (RUN / NOT_RUN): {uncovered}"
    ran = {kind_of(c)[1] for _, c in documented() if kind_of(c)[0] == "run"}
    assert ran == set(RUN), f"RUN kinds no page prints: {set(RUN) - ran}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory with the tiny inputs the commands name: my_texts/ and notes.md."""
    root = tmp_path_factory.mktemp("doc-commands")
    (root / "my_texts").mkdir()
    for i in range(3):
        (root / "my_texts" / f"t{i}.txt").write_text("The three dimensions of parallelism. " * 40 * (i + 1))
    (root / "notes.md").write_text("# notes\n" + "tensor, pipeline and data parallelism\n" * 50)
    (root / "data").mkdir()
    return root


def _entry(command: str) -> list:
    """``command`` as a user types it, as a run_scripts.py entry: ``[target, args]``."""
    args = shlex.split(os.path.expandvars(command))
    if args[1] == "-m":
        return [f"-m {args[2]}", args[3:]]
    return [str(ROOT / args[1]) if args[1].startswith("tools/") else args[1], args[2:]]


def _env() -> dict:
    return dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


RUNS = [(page, c, kind_of(c)[1]) for page, c in documented()
        if kind_of(c)[0] == "run" and kind_of(c)[1] != "after_a_run"]
READ_BACK = "python -m trainer3d.plan cluster.gpu=calibrated cluster.calibration={out}"
"""The planner on the calibration the documented ``--calibrate`` wrote."""


@pytest.fixture(scope="module")
def ran(scratch, tmp_path_factory):
    """Every command of ``RUNS`` (``--calibrate``'s ``--out`` a scratch file), then ``READ_BACK``,
    run in that order from ``scratch`` in one fresh interpreter: {command: its CompletedProcess},
    the read-back's, and the calibration file."""
    out = tmp_path_factory.mktemp("calibration") / "calibration.json"
    commands = [re.sub(r"--out \S+", f"--out {out}", c) if how == "calibrate" else c for _, c, how in RUNS]
    with pytest.MonkeyPatch.context() as env:
        for key, value in _env().items():
            env.setenv(key, value)
        done = run_all([_entry(c) for c in [*commands, READ_BACK.format(out=out)]], cwd=scratch, timeout=1700)
    return {command: proc for (_, command, _), proc in zip(RUNS, done)}, done[-1], out


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page, command, how", RUNS, ids=[f"{p}-{h}" for p, _, h in RUNS])
def test_documented_command_runs(page, command, how, ran, scratch):
    proc = ran[0][command]
    if how == "plan" and proc.returncode == 2:  # a page showing a refusal must show it as printed
        lines = proc.stderr.strip().splitlines()
        assert lines and all(line in (ROOT / page).read_text() for line in lines), f"{page}: `{command}`: {lines}"
        return
    assert proc.returncode == 0, f"{page}: `{command}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    if how == "help":
        assert " = " in proc.stdout
    elif how == "plan":
        assert "python -m trainer3d.train" in proc.stdout or "plan.evaluate=true" in command, proc.stdout[-2000:]
        shown = shown_output(command)
        if shown is not None:
            assert_shows(shown, proc.stdout)
    elif how == "print_config":
        assert "parallel:" in proc.stdout and "train:" in proc.stdout, proc.stdout[-2000:]
    elif how == "dry_run":
        assert "rank" in proc.stdout, proc.stdout[-2000:]
    elif how == "prepare_data":
        assert (scratch / "data" / "notes.bin").stat().st_size > 0
    elif how == "calibrate":
        check, out = ran[1], ran[2]
        assert check.returncode == 0 and "python -m trainer3d.train" in check.stdout, check.stderr[-3000:]
        # the block probe on the model's block as it is (it crashed with AttributeError 'Identity'
        # object has no attribute 'positions' when it rebuilt the block by hand): a positive, finite
        # overhead and elementwise rate
        figures = json.loads(out.read_text())
        block = [figures["layer_overhead_us"], figures["elementwise_gbps"]]
        assert all(math.isfinite(v) and v > 0 for v in block), block


OUTPUTS = [  # what the pages' placeholders stand for, in a run the test made
    (re.compile(r"outputs/(?:<date>/<time>|\.\.\.)/checkpoints/step_\d+"), "{checkpoint}"),
    (re.compile(r"outputs/(?:<date>/<time>|<[^>/]+>)"), "{run}"),  # <run>, <one process>: the same run
    (re.compile(r"(?<![\w/])(exported|llama-ft)/"), r"{exports}/\1/"),
]


def _in_the_run(command: str, run, checkpoint, exports) -> str:
    for pattern, stand_in in OUTPUTS:
        command = pattern.sub(stand_in.format(run=run, checkpoint=checkpoint, exports=exports), command)
    return command


@pytest.mark.timeout(900)
def test_the_tools_after_a_run_run_as_documented(tmp_path, monkeypatch):
    """Every documented export, sample and plot command, in that order (a sample may read an
    export), on a two-step run of the tiny model: exit 0, and what each writes is there. The
    tools are under test, not the run that feeds them: it runs on forkserver ranks
    (tests/support/runs.py: train_in_ranks)."""
    from tests.support.runs import train_in_ranks

    run = tmp_path / "run"
    train_in_ranks(run, ["parallel=single", "train.max_steps=2", "train.log_every=1", "train.seq_len=64",
                         "train.micro_batch_size=2", "train.global_batch_size=4", "train.grad_accum_steps=null",
                         "train.eval_every=0", "checkpoint.every=2"])
    checkpoint = run / "checkpoints" / "step_00000002"
    assert checkpoint.is_dir()
    order = {"export_model": 0, "sample": 1, "plot_metrics": 2}
    tool = lambda c: re.search(r"tools/(\w+)\.py", c).group(1)  # noqa: E731
    commands = sorted(((page, c) for page, c in documented() if kind_of(c) == ("run", "after_a_run")),
                      key=lambda pc: (pc[0], order[tool(pc[1])]))
    assert {tool(c) for _, c in commands} == set(order), commands
    runs = []
    for page, documented_command in commands:  # each page's exports apart: a page samples its own
        command = _in_the_run(documented_command, run, checkpoint, tmp_path / "exports" / Path(page).stem)
        if "sample.py" in command:  # a short budget: 8 new tokens (the default and the pages' 200: minutes here)
            command = re.sub(r" --max-new-tokens \d+", "", command) + " --max-new-tokens 8"
        runs.append((documented_command, command))
    # this process runs the tools one after another, each as ``python tools/X.py`` runs it
    # (tests/support/run_scripts.py run_here), in the run's directory: they read and write files
    # and set nothing of the process's own, and torch and the engine are imported here already
    monkeypatch.chdir(tmp_path)
    for documented_command, command in runs:
        result = run_here(*_entry(command))
        assert result.returncode == 0, f"`{documented_command}` as `{command}` exited {result.returncode}:\n{result.stderr[-3000:]}"
        if "export_model" in command:
            out = Path(shlex.split(command)[3])
            assert (out / "config.json").is_file() and list(out.glob("*.safetensors")), sorted(out.iterdir())
        elif "sample.py" in command:
            prompt = shlex.split(command)[shlex.split(command).index("--prompt") + 1]
            assert result.stdout.startswith(prompt), result.stdout[:500]
        else:
            out = Path(shlex.split(command)[shlex.split(command).index("--out") + 1])
            assert out.is_absolute() or (tmp_path / out).is_dir()
            assert list((tmp_path / out).glob("*.png")), result.stdout[-2000:]
