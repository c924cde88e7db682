"""Every refusal of a command line is one line and exit status 2, an unknown key names the
nearest known ones (trainer3d/config/command_line.py), alike for ``python -m trainer3d.train``,
``python -m trainer3d.plan`` and the parity tool; so is a refusal of the config Hydra composed
(an added ``+key`` outside the schema: trainer3d/config/composed.py ``unknown_keys``; a layout
trainer3d/config/validate.py refuses), with nothing launched. Hydra's own refusal of the same
command line is a multi-line page ending in its HYDRA_FULL_ERROR hint, with exit status 1."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TRAIN = ["-m", "trainer3d.train"]
PLAN = ["-m", "trainer3d.plan"]
PARITY = ["-m", "trainer3d.tools.parity"]

REFUSALS = [
    ([*TRAIN, "optim.lrr=1e-3"], "optim.lrr is not a knob of this config; did you mean optim.lr"),
    ([*TRAIN, "-m", "train.max_stepz=3,4"], "train.max_stepz is not a knob of this config; did you mean train.max_steps"),
    ([*TRAIN, "parallel=tp3"], "parallel=tp3 is not an option of parallel; the options are: dp2, single, tp2-pp2-dp2"),
    ([*TRAIN, "train.max_steps=abc"], "train.max_steps=abc is refused: train.max_steps takes an integer"),
    ([*TRAIN, "optim.lr=fast"], "optim.lr=fast is refused: optim.lr takes a number"),
    ([*PLAN, "cluster.gpuz=h100"], "cluster.gpuz is not a knob of this config; did you mean cluster.gpu"),
    ([*PLAN, "parallel=tp3"], "parallel=tp3 is not an option of parallel"),
    ([*PARITY, "parallel.tpp=2", "--out", "parity"], "layout A: parallel.tpp is not a knob of this config; "
                                                     "did you mean parallel.tp"),
    # refused after Hydra composed the config, each in a run dir of its own (nothing may be launched there)
    ([*TRAIN, "hydra.run.dir=added-key", "+train.max_stpes=5"], "train.max_stpes is not a config key"),
    ([*TRAIN, "hydra.run.dir=batch", "parallel.dp=3", "train.global_batch_size=32"],
     "train.global_batch_size=32 is not a multiple"),
]

# the planner's own knobs out of range (trainer3d/plan/knobs.py plan_problems): refused before the
# search, in its own words (without the check: "searched 0 layouts ... no layout fits" for
# gpus_per_node=0, a search over NaN)
BAD_CLUSTERS = [
    ("cluster.gpus_per_node=0", "trainer3d.plan: cluster.gpus_per_node=0 must be in [1, 1025)"),
    ("cluster.host_memory_gb=nan", "trainer3d.plan: cluster.host_memory_gb=nan must be in (0, 1.04858e+06)"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every command line of REFUSALS, then the planner with each of BAD_CLUSTERS, run as
    ``python -m MODULE ARGS`` runs it, one after another in one fresh process
    (tests/support/run_scripts.py: torch imported once, not twelve times), from an empty
    directory: each one's exit status and output, and that directory."""
    cwd = tmp_path_factory.mktemp("refusals")
    entries = [[f"-m {cmd[1]}", cmd[2:]] for cmd, _ in REFUSALS]
    entries += [["-m trainer3d.plan", [override]] for override, _ in BAD_CLUSTERS]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "run_scripts.py"), json.dumps(entries)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()], cwd


@pytest.mark.parametrize("case", range(len(REFUSALS)), ids=[w for _, w in REFUSALS])
def test_a_command_line_refusal_is_one_line_with_exit_2_and_a_suggestion(case, refused):
    results, cwd = refused
    out, wanted = results[case], REFUSALS[case][1]
    lines = out["stderr"].strip().splitlines()
    assert out["code"] == 2 and len(lines) == 1, (out["code"], out["stderr"])
    assert lines[0].startswith("trainer3d: config error: ") and "HYDRA_FULL_ERROR" not in out["stderr"]
    assert wanted in lines[0]
    assert not (cwd / "outputs").exists()  # no run directory but the one a case names (hydra.run.dir=)
    assert "Traceback" not in out["stderr"] + out["stdout"]
    run_dir = next((a.split("=", 1)[1] for a in REFUSALS[case][0] if a.startswith("hydra.run.dir=")), None)
    assert run_dir is None or not (cwd / run_dir / "submitit").exists(), "nothing may be launched for a refused config"


@pytest.mark.parametrize("case", range(len(BAD_CLUSTERS)), ids=[o for o, _ in BAD_CLUSTERS])
def test_the_planner_refuses_a_bad_cluster_before_searching(case, refused):
    out, line = refused[0][len(REFUSALS) + case], BAD_CLUSTERS[case][1]
    assert out["code"] == 2 and "Traceback" not in out["stderr"], out["stderr"]
    assert out["stderr"].splitlines() == [line], out["stderr"]


def test_hydras_own_refusal_of_the_same_key_is_a_page_with_exit_1(tmp_path):
    """The reference the one line replaces: Hydra itself, through its compose API's run."""
    code = ("import sys; from hydra import main; import trainer3d.config.composed\n"
            "from trainer3d.config.conf_dir import CONF_DIR\n"
            "main(version_base=None, config_path=str(CONF_DIR), config_name='config')(lambda cfg: None)()")
    out = subprocess.run([sys.executable, "-c", code, "optim.lrr=1e-3"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and "HYDRA_FULL_ERROR" in out.stderr and len(out.stderr.strip().splitlines()) > 1
