"""tools/plot_metrics.py draws PNGs from two runs' metrics.jsonl: loss, throughput and
validation loss, runs labelled by the overrides they do not share; without matplotlib it
refuses in one line naming the extra that installs it."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.support.run_scripts import run_all

TOOL = ROOT / "tools" / "plot_metrics.py"

TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
"""matplotlib's first colours, in the order a figure's curves (or stacked areas) take them."""


def _drawn(png, series: int, alpha: float = 1.0) -> None:
    """``png`` is a PNG on which each of the first ``series`` colours (drawn with ``alpha`` over
    white) covers at least a curve's worth of pixels (a line across the axes, not only its
    legend's swatch): an image of empty axes, or none, fails."""
    from matplotlib import colors, image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(png)[:, :, :3]
    for hex_colour in TAB10[:series]:
        want = [alpha * c + (1 - alpha) for c in colors.to_rgb(hex_colour)]
        near = (abs(pixels - want).max(axis=2) < 0.03).sum()
        assert near > 400, (png.name, hex_colour, int(near))


def _fake_run(path, scale, overrides, val_every=0, goodput=False):
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    rows = [{"step": s, "loss": scale * (5.0 - s / 10), "tokens_per_s": scale * 1000.0 + s, "lr": 1e-3} for s in range(30)]
    for row in rows[val_every - 1::val_every] if val_every else ():
        row["val_loss"] = row["loss"] + 0.1
    if goodput:
        for row in rows:
            row.update(step_time_s=1.0, compute_s=0.7, bubble_s=0.2, comm_s=0.1, ckpt_stall_mean_s=0.0,
                       predicted_step_time_s=0.9, predicted_compute_s=0.75)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


SHARED = ["model=tiny", "train.max_steps=30", "hydra.run.dir=x"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tool on each set of runs this file checks, its own directory each, one after another in
    one interpreter (tests/support/run_scripts.py: torch and matplotlib imported once, not once per
    command): {name: (its directory, its CompletedProcess)}."""
    root = tmp_path_factory.mktemp("plots")
    cases = {}
    d = root / "two"
    _fake_run(d / "a", 1.0, ["parallel.dp=2"])
    _fake_run(d / "b", 1.1, ["parallel.dp=4"])
    cases["two"] = (d, [d / "a", d / "b", "--out", d / "plots", "--smooth", "3"])
    d = root / "goodput"
    _fake_run(d / "a", 1.0, ["parallel.pp=2"], goodput=True)
    cases["goodput"] = (d, [d / "a", "--out", d / "plots"])
    d = root / "sweep"
    _fake_run(d / "sweep" / "0", 1.0, ["parallel.dp=1"])
    _fake_run(d / "sweep" / "1", 1.0, ["parallel.dp=2"])
    cases["sweep"] = (d, [d / "sweep", "--out", d])
    cases["missing"] = (d, [d / "nope"])
    d = root / "val"
    _fake_run(d / "a", 1.0, [*SHARED, "parallel.dp=2"], val_every=10)
    _fake_run(d / "b", 1.1, [*SHARED, "parallel.dp=4", "train.lr=1e-3"], val_every=10)
    cases["val"] = (d, [d / "a", d / "b", "--out", d / "plots"])
    done = run_all([(TOOL, args) for _, args in cases.values()], cwd=root)
    return {name: (directory, proc) for (name, (directory, _)), proc in zip(cases.items(), done)}


def test_plot_two_runs(runs):
    tmp_path, proc = runs["two"]
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "throughput.png"):
        _drawn(tmp_path / "plots" / name, series=2)
    assert not (tmp_path / "plots" / "mfu.png").exists()
    assert not (tmp_path / "plots" / "goodput.png").exists()  # neither run logged goodput's parts


def test_goodput_plot_of_runs_that_logged_it(runs):
    tmp_path, proc = runs["goodput"]
    assert proc.returncode == 0, proc.stderr
    _drawn(tmp_path / "plots" / "goodput.png", series=3, alpha=0.8)  # compute, bubble, communication (no stall)
    assert "goodput.png" in proc.stdout


def test_sweep_dir_and_missing_input(runs):
    ok, missing = runs["sweep"][1], runs["missing"][1]
    assert ok.returncode == 0 and "2 run(s)" in ok.stdout, ok.stderr
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_validation_loss_is_drawn_and_labels_say_what_differs(runs, tmp_path):
    from trainer3d.tools.plot_metrics import find_runs, labels_of

    made, proc = runs["val"]
    (tmp_path / "c").mkdir()  # no overrides: its directory name
    (tmp_path / "c" / "metrics.jsonl").write_text((made / "a" / "metrics.jsonl").read_text())
    runs_found = find_runs([str(made / "a"), str(made / "b"), str(tmp_path / "c")])
    assert labels_of(runs_found) == ["parallel.dp=2", "parallel.dp=4 train.lr=1e-3", "c"]
    assert labels_of(runs_found[:1]) == ["model=tiny train.max_steps=30 parallel.dp=2"]  # one run: all it was given
    assert proc.returncode == 0, proc.stderr  # the tool on a and b
    _drawn(made / "plots" / "val_loss.png", series=2)


def test_without_matplotlib_it_names_the_extra(tmp_path):
    hide = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['plot_metrics.py', '.']; "
            f"runpy.run_path({str(ROOT / 'tools' / 'plot_metrics.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "plot_metrics needs matplotlib, which the plot extra installs: pip install 'trainer3d[plot]'"]
