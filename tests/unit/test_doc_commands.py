"""Every training command README.md and docs/*.md print runs as printed, as far as a test can
run it: each ``python -m trainer3d.train ...`` of a fenced bash block is composed from conf/
with its overrides and validated exactly as the entry point validates it before launch (a
sweep's every point; ``model.init_from`` left out, its directory being the user's). A batch
refusal proposes one consistent micro x accum x dp set, and that set is accepted."""

import itertools
import re
import shlex

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import ROOT
from trainer3d.config.conf_dir import CONF_DIR
from trainer3d.config.validate import ConfigError, validate

FENCE = re.compile(r"```bash\n(.*?)```", re.S)
TRAIN = re.compile(r"^(?:\.venv/bin/)?python3? -m trainer3d\.train\b")


def documented_commands():
    """(page, command) of every training command in a fenced bash block."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split(" #")[0].split("&&"):
                    if TRAIN.match(part.strip()):
                        found.append((str(page.relative_to(ROOT)), part.strip()))
    return found


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


def test_the_docs_print_training_commands():
    pages = {page for page, _ in documented_commands()}
    assert "README.md" in pages and len(documented_commands()) >= 15


@pytest.mark.parametrize("page, command", documented_commands(), ids=lambda v: v if v.endswith(".md") else "")
def test_every_documented_training_command_validates(page, command):
    for overrides in points(command):
        try:
            validate(configure(overrides))
        except ConfigError as err:
            pytest.fail(f"{page}: `{command}` is refused as printed:\n" + "\n".join(err.problems))


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
