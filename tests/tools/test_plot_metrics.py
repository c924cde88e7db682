"""tools/plot_metrics.py draws PNGs from two runs' metrics.jsonl: loss, throughput and
validation loss, runs labelled by the overrides they do not share; without matplotlib it
refuses in one line naming the extra that installs it."""

import json
import subprocess
import sys

from tests.conftest import ROOT

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


def test_plot_two_runs(tmp_path):
    _fake_run(tmp_path / "a", 1.0, ["parallel.dp=2"])
    _fake_run(tmp_path / "b", 1.1, ["parallel.dp=4"])
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "a"),
                           str(tmp_path / "b"), "--out", str(tmp_path / "plots"), "--smooth", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "throughput.png"):
        _drawn(tmp_path / "plots" / name, series=2)
    assert not (tmp_path / "plots" / "mfu.png").exists()
    assert not (tmp_path / "plots" / "goodput.png").exists()  # neither run logged goodput's parts


def test_goodput_plot_of_runs_that_logged_it(tmp_path):
    _fake_run(tmp_path / "a", 1.0, ["parallel.pp=2"], goodput=True)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "a"),
                           "--out", str(tmp_path / "plots")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _drawn(tmp_path / "plots" / "goodput.png", series=3, alpha=0.8)  # compute, bubble, communication (no stall)
    assert "goodput.png" in proc.stdout


def test_sweep_dir_and_missing_input(tmp_path):
    _fake_run(tmp_path / "sweep" / "0", 1.0, ["parallel.dp=1"])
    _fake_run(tmp_path / "sweep" / "1", 1.0, ["parallel.dp=2"])
    tool = str(ROOT / "tools" / "plot_metrics.py")
    ok = subprocess.run([sys.executable, tool, str(tmp_path / "sweep"), "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "2 run(s)" in ok.stdout, ok.stderr
    missing = subprocess.run([sys.executable, tool, str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_validation_loss_is_drawn_and_labels_say_what_differs(tmp_path):
    from trainer3d.tools.plot_metrics import find_runs, labels_of

    shared = ["model=tiny", "train.max_steps=30", "hydra.run.dir=x"]
    _fake_run(tmp_path / "a", 1.0, [*shared, "parallel.dp=2"], val_every=10)
    _fake_run(tmp_path / "b", 1.1, [*shared, "parallel.dp=4", "train.lr=1e-3"], val_every=10)
    (tmp_path / "c").mkdir()  # no overrides: its directory name
    (tmp_path / "c" / "metrics.jsonl").write_text((tmp_path / "a" / "metrics.jsonl").read_text())
    runs = find_runs([str(tmp_path / n) for n in "abc"])
    assert labels_of(runs) == ["parallel.dp=2", "parallel.dp=4 train.lr=1e-3", "c"]
    assert labels_of(runs[:1]) == ["model=tiny train.max_steps=30 parallel.dp=2"]  # one run: all it was given
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "a"),
                           str(tmp_path / "b"), "--out", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _drawn(tmp_path / "plots" / "val_loss.png", series=2)


def test_without_matplotlib_it_names_the_extra(tmp_path):
    hide = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['plot_metrics.py', '.']; "
            f"runpy.run_path({str(ROOT / 'tools' / 'plot_metrics.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "plot_metrics needs matplotlib, which the plot extra installs: pip install 'trainer3d[plot]'"]
