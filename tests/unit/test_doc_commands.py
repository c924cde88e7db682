"""Every command README.md and docs/*.md print runs as printed, as far as a test can run it.

Commands are the lines of fenced bash blocks, ``$ `` lines of other fences and inline code
spans that start with ``python`` (a usage synopsis with ``[...]`` or ``|`` is not a command).
Each kind is run the furthest a test can:

- ``python -m trainer3d.train ...``: composed from conf/ with its overrides and validated
  exactly as the entry point validates it before launch (a sweep's every point;
  ``model.init_from`` left out, its directory being the user's).
- ``python -m trainer3d.plan ...`` naming a model (``model=`` or ``experiment=``): run for real
  in this process (the search, or ``plan.evaluate=true``'s evaluation: seconds, no devices),
  once per command however many pages print it.
- Each command tests/tools/test_doc_commands_run.py runs as printed (``RUN_TIER``: the entry
  points' ``--help``, the planner on the default model) is run there alone, with the same checks.
- ``python tools/*.py``, ``python tools/bench/*.py``, ``python -m trainer3d.plan --calibrate``:
  parsed by the tool's own argument parser and stopped there (tests/support/tool_args.py):
  a real run needs the user's data, a checkpoint, GPUs or minutes; the tools' own tests in
  tests/tools run them at tiny size.
- ``sbatch ... slurm/train.sbatch OVERRIDES``: the overrides validated as a training run
  with ``launcher=inplace`` on nodes x ntasks-per-node ranks, as every rank checks them.
- Set-up and other programs' commands (venv, pip, pytest, tensorboard, ``python -c``) are
  named in ``NOT_RUN`` with the test that covers them.

A batch refusal proposes one consistent micro x accum x dp set, and that set is accepted."""

import itertools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import OmegaConf

from tests.conftest import ROOT
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.conf_dir import CONF_DIR
from trainer3d.config.validate import ConfigError, validate

FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
INLINE = re.compile(r"`((?:\.venv/bin/)?python3? [^`]+)`")
PYTHON = r"^(?:\.venv/bin/)?python3? "
TRAIN = re.compile(PYTHON + r"-m trainer3d\.train\b")
PLAN = re.compile(PYTHON + r"-m trainer3d\.plan\b")
TOOL = re.compile(PYTHON + r"tools/(?:bench/)?\w+\.py\b")
SBATCH = re.compile(r"^sbatch .*slurm/train\.sbatch\b")
PREFIX = re.compile(r"^(?:[A-Z_]+=\S* |nice -n \d+ )+")  # environment assignments and nice: the command follows
NOT_RUN = {  # command prefix: the test that covers it
    "python3 -m venv": "set-up (tests/unit/test_help_install.py installs the package)",
    ".venv/bin/pip install": "set-up (tests/unit/test_help_install.py installs the package; extras: below)",
    "pip install": "set-up of an extra (test_every_documented_extra_exists)",
    ".venv/bin/python -m pytest": "the suite itself",
    "python -m trainer3d.tools.provenance": "tests/multirank/test_provenance.py runs the tool on three layouts' run dirs",
    "tensorboard --logdir": "TensorBoard's own command (tests/integration/test_profile_dashboards.py reads the events)",
    "python -c": "tests/integration/test_export_standard.py loads an export with transformers",
}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HELP = re.compile(PYTHON + r"-m trainer3d\.(?:train|plan) --help$")
DEFAULT_MODEL_PLAN = re.compile(PYTHON + r"-m trainer3d\.plan(?:$| (?!--)(?!.*\b(?:model|experiment)=))")
RUN_TIER = (HELP, DEFAULT_MODEL_PLAN)
"""What tests/tools/test_doc_commands_run.py runs as printed, with every check made here (its
``RUN``): an entry point's ``--help`` and the planner on the default model. Each runs there
once, not here as well."""
REFUSAL = re.compile(r"^\$ (python -m trainer3d\.train .*)\n((?:trainer3d: config error: .*\n)+)", re.M)


def documented_refusals():
    """(page, command, the problems printed under it) of each refusal a page shows. One that needs
    the user's model directory (``model.init_from``) is tests/integration/test_hf.py's."""
    return [(str(page.relative_to(ROOT)), command, [line.split(": ", 2)[2] for line in out.splitlines()])
            for page in PAGES for command, out in REFUSAL.findall(page.read_text())
            if "model.init_from=" not in command]


REFUSALS = {command for page in PAGES for command, _ in REFUSAL.findall(page.read_text())}


def _commands_of(text: str):
    for lang, block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if lang != "bash":
                if not line.startswith("$ ") or line[2:] in REFUSALS:
                    continue
                line = line[2:]
            for part in line.split(" #")[0].split("&&"):
                if part.strip() and not part.strip().startswith("#"):
                    yield PREFIX.sub("", " ".join(part.split()))
    for span in INLINE.findall(FENCE.sub("", text)):
        if "[" not in span and " | " not in span:
            yield " ".join(span.split())


def documented_commands(kind=None):
    """(page, command) of every command the pages print; ``kind``: only TRAIN, PLAN, TOOL or SBATCH's."""
    found = []
    for page in PAGES:
        for command in _commands_of(page.read_text()):
            if kind is None or kind.match(command):
                found.append((str(page.relative_to(ROOT)), command))
    return found


def test_every_documented_extra_exists():
    """``pip install … '.[x]'`` and ``'trainer3d[x]'`` on the pages name extras pyproject.toml has."""
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {(page, x) for page in PAGES + [ROOT / "tools" / "README.md"]
             for group in re.findall(r"(?:\.|trainer3d)\[([\w,-]+)\]", page.read_text()) for x in group.split(",")}
    assert named and not [(str(page), x) for page, x in named if x not in extras]


def _ids(value):
    return value if isinstance(value, str) and value.endswith(".md") else ""


def test_every_documented_command_is_of_a_kind_this_test_runs():
    unknown = [(page, c) for page, c in documented_commands()
               if not any(k.match(c) for k in (TRAIN, PLAN, TOOL, SBATCH)) and not c.startswith(tuple(NOT_RUN))]
    assert not unknown, f"commands no test runs (add their kind here): {unknown}"
    for kind in (TRAIN, PLAN, TOOL, SBATCH):
        assert documented_commands(kind), kind.pattern
    assert "README.md" in {page for page, _ in documented_commands(TRAIN)} and len(documented_commands(TRAIN)) >= 15


def points(command: str):
    """The override lists a command runs: flags dropped, a sweep (-m a=1,2) expanded."""
    args = shlex.split(command)[3:]
    sweep = "-m" in args or "--multirun" in args
    args = [a for a in args if not a.startswith("-") and a != "job" and not a.startswith("model.init_from=")]
    choices = [[f"{a.split('=', 1)[0]}={v}" for v in a.split("=", 1)[1].split(",")]
               if sweep and "," in a and not re.search(r"[\[{'\"]", a) else [a] for a in args]
    return [list(p) for p in itertools.product(*choices)]


def configure(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name="config", overrides=[*overrides, "run_dir=/tmp/unused",
                                                        "launcher.folder=/tmp/unused"])
    return OmegaConf.to_object(dcfg)


def _not_run_tier(commands):
    return [(page, c) for page, c in commands if not any(kind.match(c) for kind in RUN_TIER)]


@pytest.mark.parametrize("page, command", _not_run_tier(documented_commands(TRAIN)), ids=_ids)
def test_every_documented_training_command_validates(page, command):
    for overrides in points(command):
        try:
            validate(configure(overrides))
        except ConfigError as err:
            pytest.fail(f"{page}: `{command}` is refused as printed:\n" + "\n".join(err.problems))


def hydra_overrides(command: str):
    """The Hydra overrides a train, plan or sbatch command line hands to Hydra, as bash passes
    them (quotes removed, ``$VAR`` expanded; ``~`` after ``=`` is not: bash expands it only at a
    word's start)."""
    args = [os.path.expandvars(a) for a in shlex.split(command)]
    if SBATCH.match(command):
        args = args[next(i for i, a in enumerate(args) if a.endswith("slurm/train.sbatch")) + 1:]
    else:
        args = args[3:]
    # Hydra's own flags and the value each takes (hydra/_internal/utils.py, get_args_parser)
    valued = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
              "--config-dir", "-cd", "--info", "-i"}
    return [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in valued)]


HYDRA_COMMANDS = documented_commands(TRAIN) + documented_commands(PLAN) + documented_commands(SBATCH)


@pytest.mark.parametrize("page, command", [pc for pc in HYDRA_COMMANDS if "--calibrate" not in pc[1]], ids=_ids)
def test_every_documented_command_line_is_hydra_grammar(page, command):
    """Each override as Hydra's own parser reads it; composing alone would miss a line whose
    override names no knob composed here (``model.init_from`` is left out of the validation)."""
    try:
        OverridesParser.create().parse_overrides(hydra_overrides(command))
    except OverrideParseException as err:
        pytest.fail(f"{page}: `{command}`: Hydra refuses it as printed: {err}")


def test_the_grammar_check_catches_a_tilde_after_equals():
    """bash leaves ``~`` after ``=`` as it is and Hydra's lexer refuses it."""
    bad = "python -m trainer3d.train model.init_from=~/models/Llama-3.1-8B"
    with pytest.raises(OverrideParseException):
        OverridesParser.create().parse_overrides(hydra_overrides(bad))
    OverridesParser.create().parse_overrides(hydra_overrides(bad.replace("~", "$HOME")))


BAD_BATCHES = [
    ["parallel=dp2", "train.micro_batch_size=8", "train.global_batch_size=20", "train.grad_accum_steps=null"],
    ["parallel=dp2", "train.micro_batch_size=3", "train.grad_accum_steps=2", "train.global_batch_size=16"],
    ["train.micro_batch_size=4", "train.grad_accum_steps=1", "train.global_batch_size=null"],  # 1f1b, pp=2
    ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2", "train.micro_batch_size=1",
     "train.grad_accum_steps=5", "train.global_batch_size=null"],
    ["parallel.dp=3", "train.micro_batch_size=2", "train.global_batch_size=32", "train.grad_accum_steps=null"],
]


@pytest.mark.parametrize("overrides", BAD_BATCHES)
def test_a_batch_refusal_proposes_one_set_that_is_accepted(overrides):
    with pytest.raises(ConfigError) as err:
        validate(configure(overrides))
    proposals = [re.search(r"one consistent set: ((?:train\.\w+=\d+ ?){3})", p) for p in err.value.problems]
    proposals = [m.group(1).split() for m in proposals if m]
    assert proposals, err.value.problems
    for proposal in proposals:
        validate(configure([*overrides, *proposal]))


SHOWN = re.compile(r"```bash\n(.*?)```\n```\n(.*?)```", re.S)
MASK = [re.compile(r"\d{4}-\d\d-\d\d[ T/]\d\d[:-]\d\d(?:[:-]\d\d)?"), re.compile(r"\bjob \d+")]
"""What legitimately differs between the printed example and a run: dates and times, job ids."""


def shown_output(command: str):
    """The output a page prints under ``command`` (a plain fence right after its bash fence), or None."""
    for page in PAGES:
        for given, shown in SHOWN.findall(page.read_text()):
            if " ".join(given.replace("\\\n", " ").split()) == command:
                return shown
    return None


def assert_shows(shown: str, printed: str) -> None:
    """Every line of the example (but its ``...`` elisions) is a line of the output, in order,
    once dates, times and job ids are masked."""
    def masked(line):
        for pattern in MASK:
            line = pattern.sub("<masked>", line)
        return line.rstrip()
    lines = iter(masked(line) for line in printed.splitlines())
    for want in (masked(line) for line in shown.splitlines()):
        if want.strip() in ("", "...") or want.strip().startswith("..."):
            continue
        assert any(line == want for line in lines), f"the page shows a line the command no longer prints:\n{want}"


def test_the_output_check_catches_a_drifted_figure():
    printed = "searched 10 layouts\n  1   2 70.96 GiB\n  2   4 73.79 GiB\nstep time 46.98 s:\n"
    assert_shows("searched 10 layouts\n  ...\nstep time 46.98 s:", printed)
    with pytest.raises(AssertionError):
        assert_shows("searched 10 layouts\n  1   2 75.96 GiB", printed)
    with pytest.raises(AssertionError):  # in another order
        assert_shows("step time 46.98 s:\nsearched 10 layouts", printed)


def _plan_commands():
    """(pages, command) of each planner search a page prints, once however many pages print it;
    not ``--calibrate``'s and not the run tier's (``RUN_TIER``)."""
    pages = {}
    for page, command in _not_run_tier(documented_commands(PLAN)):
        if "--calibrate" not in command:
            pages.setdefault(command, []).append(page)
    return [(" ".join(on), command) for command, on in pages.items()]


@pytest.mark.parametrize("page, command", _plan_commands(), ids=_ids)
def test_every_documented_plan_command_runs(page, command, tmp_path):
    """The planner for real, in this process: its search (or plan.evaluate=true's evaluation);
    where a page prints the output under the command, every line shown is a line it prints.
    One run per command (``page``: every page printing it): tests/tools/test_doc_commands_run.py
    runs the entry point itself (``python -m trainer3d.plan`` in a fresh process) on the
    default model, and its ``--help``."""
    from trainer3d.plan.devices import device_for
    from trainer3d.plan.evaluate import evaluate_report
    from trainer3d.plan.knobs import plan_problems
    from trainer3d.plan.report import report
    from trainer3d.plan.search import search

    args = shlex.split(command)[3:]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="plan", overrides=args))
    refused = plan_problems(cfg)
    if refused:  # a page showing a refusal: it must show it as the planner prints it
        for text in [(ROOT / one).read_text() for one in page.split()]:
            assert all(f"trainer3d.plan: {p}" in text for p in refused), (page, command, refused)
        return
    device = device_for(cfg.cluster.gpu, str(tmp_path / "no-calibration.json"))
    try:
        text = evaluate_report(cfg, device)[0] if cfg.plan.evaluate else report(cfg, device, search(cfg, device), args)
    except ConfigError as err:
        pytest.fail(f"{page}: `{command}` is refused as printed:\n" + "\n".join(err.problems))
    # an answer: commands to run, or an evaluation
    assert "python -m trainer3d.train" in text or cfg.plan.evaluate, text
    shown = shown_output(command)
    if shown is not None:
        assert_shows(shown, text)


TOOL_COMMANDS = [pc for pc in documented_commands(TOOL)] + [pc for pc in documented_commands(PLAN)
                                                             if "--calibrate" in pc[1]]


DRIFTED = [["tools/sample.py", ["ckpt/", "--prompt", "a", "--greedy"]],
           ["tools/sample.py", ["ckpt/", "--prompt", "a", "--max-tokens", "9"]],  # it is --max-new-tokens
           ["tools/export_model.py", ["ckpt/"]]]
"""The check's own check: a command that parses, a drifted flag, a missing positional."""


@pytest.fixture(scope="module")
def parsed_tool_commands():
    """Every documented tool command parsed by its tool's own argparse, then ``DRIFTED``'s
    entries, in one process: {command: result}, and DRIFTED's results."""
    entries = []
    for _, command in TOOL_COMMANDS:
        args = shlex.split(command)[1:]
        entries.append(["-m " + args[1], args[2:]] if args[0] == "-m" else [args[0], args[1:]])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "tool_args.py"),
                           json.dumps(entries + DRIFTED)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(entries) + len(DRIFTED), proc.stdout
    return {command: result for (_, command), result in zip(TOOL_COMMANDS, results)}, results[len(entries):]


@pytest.mark.parametrize("page, command", TOOL_COMMANDS, ids=_ids)
def test_every_documented_tool_command_parses(page, command, parsed_tool_commands):
    result = parsed_tool_commands[0][command]
    assert result["ok"], f"{page}: `{command}` is refused as printed: {result['error']}"


def test_the_tool_check_catches_a_drifted_flag(parsed_tool_commands):
    ok, drifted, missing = parsed_tool_commands[1]
    assert ok["ok"] and not drifted["ok"] and not missing["ok"]
    assert "unrecognized arguments: --max-tokens 9" in drifted["error"]
    assert "required: out" in missing["error"]


@pytest.mark.parametrize("page, command, printed", documented_refusals(), ids=_ids)
def test_every_documented_refusal_is_refused_as_printed(page, command, printed):
    with pytest.raises(ConfigError) as err:
        validate(configure(points(command)[0]))
    assert err.value.problems == printed, f"{page}: `{command}` prints other problems than the page shows"


def sbatch_commands():
    """The pages' sbatch commands, and the examples in slurm/train.sbatch's header."""
    header = re.findall(r"^#\s+(sbatch .*)$", (ROOT / "slurm" / "train.sbatch").read_text(), re.M)
    return documented_commands(SBATCH) + [("slurm/train.sbatch", command) for command in header]


@pytest.mark.parametrize("page, command", sbatch_commands(), ids=_ids)
def test_every_documented_sbatch_command_validates(page, command):
    args = shlex.split(command)
    at = next(i for i, a in enumerate(args) if a.endswith("slurm/train.sbatch"))
    flags = dict(a[2:].split("=", 1) for a in args[1:at] if a.startswith("--") and "=" in a)
    sbatch = (ROOT / "slurm" / "train.sbatch").read_text()
    default = {k: v for k, v in re.findall(r"^#SBATCH --([\w-]+)=(\S+)", sbatch, re.M)}
    world = int(flags.get("nodes", default["nodes"])) * int(flags.get("ntasks-per-node", default["ntasks-per-node"]))
    try:
        cfg = validate(configure(["launcher=inplace", *args[at + 1:]]), world)
    except ConfigError as err:
        pytest.fail(f"{page}: `{command}` is refused as printed:\n" + "\n".join(err.problems))
    assert cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.cp == world
