"""tools/plot_schedule.py draws each schedule's timeline as a PNG whose boxes are torch's action
list: the written image is read back, every cell of every rank's row sampled, and the sequence
of coloured cells compared with torch's own ``pipeline_order`` (zbv) or the textbook 1F1B
(every rank idle (p - 1) forward-plus-backward slots: the bubble (p - 1) / (m + p - 1))."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("matplotlib")

from matplotlib import image  # noqa: E402

from trainer3d.tools import plot_schedule  # noqa: E402

WHITE = (1.0, 1.0, 1.0)
CELLS = {"B": 2}
"""Cells an action covers at unit costs: a whole backward is its input plus its weight half."""


def _cells(png, schedule, pp, v, m):
    """Per rank, each cell's (kind, micro-batch) decoded from the PNG's pixels, None where white."""
    pixels = image.imread(png)[:, :, :3]
    fig, ax = plot_schedule.figure(schedule, pp, v, m)  # the same layout, for its axes' transform
    fig.canvas.draw()
    height = pixels.shape[0]
    palette = {(k, mb): plot_schedule.colour(k, mb) for k in "FBW" for mb in range(m)}
    palette[None] = WHITE
    rows = []
    for rank in range(pp):
        row = []
        for cell in range(round(ax.get_xlim()[1])):
            # the cell's upper left, clear of its centred label and its white edge
            x, y = ax.transData.transform((cell + 0.25, pp - rank - 0.15))
            rgb = pixels[height - 1 - int(round(y)), int(round(x))]
            key, dist = min(((k, max(abs(a - b) for a, b in zip(rgb, c))) for k, c in palette.items()),
                            key=lambda kc: kc[1])
            assert dist < 0.02, (schedule, rank, cell, rgb)  # a palette colour, not a blend or a line
            row.append(key)
        rows.append(row)
    return rows


def _draw(tmp_path, schedule, pp, m):
    assert plot_schedule.main(["--schedules", schedule, "--pp", str(pp), "--microbatches", str(m),
                               "--out", str(tmp_path)]) == 0
    png = tmp_path / f"schedule_{schedule}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return png


def test_zbv_boxes_are_torchs_action_list(tmp_path):
    from trainer3d.parallel.pipeline.timeline import torch_schedule

    pp, m = 4, 8
    rows = _cells(_draw(tmp_path, "zbv", pp, m), "zbv", pp, 2, m)
    order = torch_schedule("zbv", pp, 2, m).pipeline_order  # torch's own lists, idle slots as None
    for rank, row in enumerate(rows):
        expected = []
        for action in (a for a in order[rank] if a is not None):
            kind = str(action.computation_type.value)
            drawn_as = "B" if kind == "I" else kind  # I and B share their shade; B covers two cells
            expected += [(drawn_as, action.microbatch_index)] * CELLS.get(kind, 1)
        assert [c for c in row if c is not None] == expected, rank
        assert None in row  # the V's start leaves every rank idle somewhere


def test_1f1b_idle_cells_are_the_textbook_bubble(tmp_path):
    pp, m = 4, 8
    rows = _cells(_draw(tmp_path, "1f1b", pp, m), "1f1b", pp, 1, m)
    assert len(rows[0]) == 3 * (m + pp - 1)  # m + p - 1 slots of one forward (1) and one backward (2)
    for rank, row in enumerate(rows):
        assert row.count(None) == 3 * (pp - 1), rank
        assert sorted(c for c in row if c is not None) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)] * 2)
        assert row[:rank] == [None] * rank and row[rank] == ("F", 0)  # rank r starts after r forwards


def test_checkout_script_and_a_refused_shape(tmp_path, capsys):
    tool = str(ROOT / "tools" / "plot_schedule.py")
    ok = subprocess.run([sys.executable, tool, "--schedules", "gpipe", "dualpipev", "--pp", "2", "--microbatches", "4",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["schedule_dualpipev.png", "schedule_gpipe.png"]
    assert plot_schedule.main(["--pp", "1", "--out", str(tmp_path / "none")]) == 2
    assert "--pp must be >= 2" in capsys.readouterr().err and not (tmp_path / "none").exists()
