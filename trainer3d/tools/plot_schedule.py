"""Draw pipeline schedules' timelines, one PNG per schedule, from their action lists.

    python tools/plot_schedule.py --pp 4 --microbatches 8 --out docs/
    python tools/plot_schedule.py --schedules zbv dualpipev --pp 8 --microbatches 16 --out plots/

Each picture is ``trainer3d/parallel/pipeline/timeline.py``'s timeline of torch's own action
lists for the schedule (``schedule_actions``, run on the ideal machine by ``simulate``: the very
figures the planner's bubble and the ``bubble_theory`` column come from). One row per pp rank,
time to the right in cells of one forward of one stage; each action a box coloured by its
micro-batch: a forward (F) in the micro-batch's colour, a whole backward (B) or its input half
(I) darker, the weight half (W) lighter; the label in lower case on a rank's second stage.
White is idle: the bubble. Writes ``schedule_<name>.png`` into --out. Needs matplotlib:
``pip install 'trainer3d[plot]'``.
"""

import argparse
import sys
from pathlib import Path
from typing import Sequence, Tuple

from trainer3d.config.extras import require
from trainer3d.parallel.pipeline.timeline import TORCH_CLASSES, schedule_actions, simulate
from trainer3d.tools import output

require("plot", "plot_schedule")
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import colors  # noqa: E402

DPI = 100
CELL_INCHES = 0.22
ROW_INCHES = 0.45
SHADE = {"F": 0.0, "B": -0.45, "I": -0.45, "W": 0.5}
"""How far each kind's colour moves from its micro-batch's: towards black (< 0) or white (> 0)."""


def virtual_stages(schedule: str, asked: int) -> int:
    """Stages per rank: 1 for 1f1b and gpipe, 2 in a V, ``asked`` for the interleaved ones."""
    if schedule in ("1f1b", "gpipe"):
        return 1
    return 2 if schedule in ("zbv", "dualpipev") else asked


def colour(kind: str, mb: int) -> Tuple[float, float, float]:
    """The fill of ``kind``'s box for micro-batch ``mb`` (tab10's colours, shaded per kind)."""
    base = colors.to_rgb(plt.get_cmap("tab10")(mb % 10))
    shade = SHADE[kind]
    target = 1.0 if shade > 0 else 0.0
    return tuple(c + abs(shade) * (target - c) for c in base)


def figure(schedule: str, pp: int, v: int, m: int):
    """The figure of ``schedule``'s timeline; ``x`` in cells (one forward of one stage), row
    ``r`` spanning ``y`` from ``pp - 1 - r`` to ``pp - r`` (rank 0 on top)."""
    timeline = simulate(schedule_actions(schedule, pp, v, m), v)
    width = timeline.makespan * v
    fig, ax = plt.subplots(figsize=(1.2 + CELL_INCHES * width, 0.8 + ROW_INCHES * pp), dpi=DPI)
    for rank, spans in timeline.spans.items():
        first_stage = min(stage for _, _, (_, stage, _) in spans)
        for start, end, (kind, stage, mb) in spans:
            x, w, y = start * v, (end - start) * v, pp - 1 - rank
            ax.add_patch(plt.Rectangle((x, y), w, 1, facecolor=colour(kind, mb), edgecolor="white", linewidth=0.6))
            label = (kind if stage == first_stage else kind.lower()) + str(mb)
            ax.text(x + w / 2, y + 0.5, label, ha="center", va="center", fontsize=6,
                    color="white" if SHADE[kind] < 0 else "black")
    ax.set_xlim(0, width)
    ax.set_ylim(0, pp)
    ax.set_yticks([pp - 0.5 - r for r in range(pp)], [f"rank {r}" for r in range(pp)], fontsize=7)
    ax.set_xlabel("time (forwards of one stage)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{schedule}  pp={pp}  v={v}  m={m}  bubble {timeline.bubble():.3f}", fontsize=8)
    fig.subplots_adjust(left=0.9 / fig.get_figwidth(), right=1 - 0.2 / fig.get_figwidth(),
                        bottom=0.45 / fig.get_figheight(), top=1 - 0.3 / fig.get_figheight())
    return fig, ax


def draw(schedule: str, pp: int, v: int, m: int, path: Path) -> None:
    fig, _ = figure(schedule, pp, v, m)
    with output.new_file(path) as tmp:  # published whole (trainer3d/tools/output.py)
        fig.savefig(tmp, dpi=DPI, format="png")
    plt.close(fig)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_CLASSES), choices=list(TORCH_CLASSES),
                        help="parallel.pp_schedule values to draw (default: all)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches a step (grad_accum_steps)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="stages per rank of interleaved_1f1b and zb1p (zbv, dualpipev: 2; 1f1b, gpipe: 1)")
    parser.add_argument("--out", default=".", help="directory for the PNG files (default: here)")
    args = parser.parse_args(argv)
    if args.pp < 2 or args.microbatches < 1 or args.virtual_stages < 1:
        print("plot_schedule: --pp must be >= 2, --microbatches and --virtual-stages >= 1", file=sys.stderr)
        return 2
    try:  # a directory the PNGs are added to, as plot_metrics does
        out = output.check(args.out, directory=True, force=True)
        for schedule in args.schedules:
            output.check(out / f"schedule_{schedule}.png")
    except output.OutputError as err:
        print(f"plot_schedule: {err}", file=sys.stderr)
        return 2
    for schedule in args.schedules:
        v, path = virtual_stages(schedule, args.virtual_stages), out / f"schedule_{schedule}.png"
        try:
            draw(schedule, args.pp, v, args.microbatches, path)
        except ValueError as err:  # torch's schedule refuses the shape (e.g. m < pp for zb1p)
            print(f"plot_schedule: {schedule} pp={args.pp} v={v} m={args.microbatches}: {err}", file=sys.stderr)
            return 2
        print(f"plot_schedule: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
