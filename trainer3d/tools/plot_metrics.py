"""Draw loss and throughput curves from one or more runs' metrics.jsonl into PNG files.

    python tools/plot_metrics.py outputs/2026-11-22/08-15-24 outputs/2026-11-22/09-01-02
    python tools/plot_metrics.py multirun/2026-11-22/10-00-00      # every point of a sweep
    python tools/plot_metrics.py RUN --out plots/ --smooth 10

Each argument is a run dir, a metrics.jsonl file, or a sweep dir (every sub-dir holding a
metrics.jsonl becomes one curve). Curves are labelled by what differs between the runs: the
overrides (from each run's .hydra/overrides.yaml) that not every run shares; a run without
overrides, or runs that differ in none, by the directory name. Writes ``loss.png`` and
``throughput.png``, plus ``val_loss.png`` and ``mfu.png`` when the runs logged them, into
--out, and ``goodput.png`` when they logged goodput's parts (trainer3d/observe/goodput.py):
per run, each step's measured compute, pipeline bubble, exposed communication and checkpoint
stall stacked, with the planner's predicted step and compute for the run's layout as lines.
Needs matplotlib: ``pip install 'trainer3d[plot]'``.
"""

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from trainer3d.config.extras import require
from trainer3d.config.rows import read_metrics
from trainer3d.tools import output

require("plot", "plot_metrics")
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402


def find_runs(paths: List[str]) -> List[Path]:
    """metrics.jsonl files for the given run dirs, files or sweep dirs."""
    found = []
    for arg in map(Path, paths):
        if arg.is_file():
            found.append(arg)
        elif (arg / "metrics.jsonl").is_file():
            found.append(arg / "metrics.jsonl")
        elif arg.is_dir():
            found.extend(sorted(arg.glob("*/metrics.jsonl"), key=lambda p: p.parent.name))
        else:
            raise SystemExit(f"plot_metrics: {arg} not found")
    if not found:
        raise SystemExit(f"plot_metrics: no metrics.jsonl under {', '.join(paths)}")
    return found


def overrides_of(metrics: Path) -> List[str]:
    """The run's command-line overrides (.hydra/overrides.yaml), hydra.* left out."""
    overrides = metrics.parent / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return []
    items = [line.strip()[2:] for line in overrides.read_text().splitlines() if line.strip().startswith("- ")]
    return [i for i in items if not i.startswith("hydra.")]


def labels_of(runs: List[Path]) -> List[str]:
    """One label per run: its overrides that not every run shares, else its directory name."""
    overrides = [overrides_of(m) for m in runs]
    given = [set(o) for o in overrides if o]
    shared = set.intersection(*given) if len(runs) > 1 and given else set()
    labels = []
    for metrics, items in zip(runs, overrides):
        differ = [i for i in items if i not in shared]
        labels.append(" ".join(differ) if differ else metrics.parent.name)
    return labels


def load(metrics: Path) -> Dict[str, List[Tuple[int, float]]]:
    """Each metric's (step, value) points; a torn line (a crash mid-write) is skipped, named,
    as a resume skips it (trainer3d/config/rows.py)."""
    series: Dict[str, List[Tuple[int, float]]] = {}
    rows, torn = read_metrics(metrics)
    if torn:
        print(f"plot_metrics: {metrics}: skipped {torn} line(s) that are not complete rows (a write cut short)",
              file=sys.stderr)
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and value == value:  # skip NaN
                series.setdefault(key, []).append((row["step"], float(value)))
    return series


def smooth(values: List[float], window: int) -> List[float]:
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs: Dict[str, Dict], key: str, ylabel: str, path: Path, window: int, log_y: bool = False) -> bool:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for label, series in runs.items():
        points = series.get(key)
        if points:
            steps, values = zip(*points)
            ax.plot(steps, smooth(list(values), window), label=label, linewidth=1.4)
            drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save(fig, path)
    plt.close(fig)
    return drawn


def save(fig, path: Path) -> None:
    """The PNG written beside ``path`` and published whole (trainer3d/tools/output.py)."""
    with output.new_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")


GOODPUT_PARTS = (("compute_s", "compute"), ("bubble_s", "pipeline bubble"), ("comm_s", "exposed communication"),
                 ("ckpt_stall_mean_s", "checkpoint stall"))


def plot_goodput(runs: Dict[str, Dict], path: Path) -> bool:
    """One panel per run that logged goodput: measured parts stacked, predictions as lines."""
    shown = {label: series for label, series in runs.items() if series.get("compute_s")}
    if not shown:
        return False
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 3.2 * len(shown)), squeeze=False)
    for ax, (label, series) in zip(axes[:, 0], shown.items()):
        steps = [s for s, _ in series["compute_s"]]
        stacks = []
        for key, _ in GOODPUT_PARTS:
            values = dict(series.get(key, []))
            stacks.append([values.get(s, 0.0) for s in steps])
        ax.stackplot(steps, *stacks, labels=[name for _, name in GOODPUT_PARTS], alpha=0.8)
        for key, name, style in (("predicted_step_time_s", "predicted step", "--"),
                                 ("predicted_compute_s", "predicted compute", ":")):
            if series.get(key):
                ax.plot(*zip(*series[key]), style, color="black", linewidth=1.2, label=name)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("seconds per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return True


PLOTS = ("loss.png", "val_loss.png", "throughput.png", "mfu.png", "goodput.png")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run dirs, metrics.jsonl files or sweep dirs")
    parser.add_argument("--out", default=".", help="directory for the PNG files (default: here)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in steps")
    args = parser.parse_args(argv)
    runs: Dict[str, Dict] = {}
    found = find_runs(args.runs)
    for metrics, label in zip(found, labels_of(found)):
        while label in runs:
            label += "'"
        runs[label] = load(metrics)
    try:  # a directory the PNGs are added to: only its shape is checked, and each file against the inputs
        out = output.check(args.out, directory=True, force=True)
        for name in PLOTS:
            output.check(out / name, found)
    except output.OutputError as err:
        print(f"plot_metrics: {err}", file=sys.stderr)
        return 2
    written = [name for name, key, ylabel, log_y in (("loss.png", "loss", "loss", False),
                                                    ("val_loss.png", "val_loss", "validation loss", False),
                                                    ("throughput.png", "tokens_per_s", "tokens/s", False),
                                                    ("mfu.png", "mfu", "MFU", False))
               if plot(runs, key, ylabel, out / name, args.smooth, log_y)]
    if plot_goodput(runs, out / "goodput.png"):
        written.append("goodput.png")
    for name in written:
        print(f"plot_metrics: wrote {out / name} ({len(runs)} run(s))")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
