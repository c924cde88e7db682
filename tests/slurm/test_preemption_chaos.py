"""Zero-loss preemption with saves in the background: tools/bench/preemption_chaos.py against the
dev cluster, two USR2 preemptions (the tool's default is five; its figures are in
docs/checkpoints.md). Every step's loss must equal the uninterrupted local run's."""

import json

import pytest

from tools.bench import preemption_chaos

pytestmark = pytest.mark.slurm


@pytest.mark.slow
def test_preempted_twice_with_saves_in_flight_loses_no_step(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_cluster["SLURM_CONF"])
    code = preemption_chaos.main(["--signals", "2", "--steps", "20", "--gap", "6", "--every", "4",
                                  "--dir", str(tmp_path)])
    report = json.loads((tmp_path / "chaos" / "preemption_chaos.json").read_text())
    assert code == 0 and report["lossless"], report
    assert [r["signal"] for r in report["records"]] == [1, 2]
    stops = [r["stopped_after"] for r in report["records"]]
    assert stops[0] >= 6 and stops[1] >= stops[0] + 6, stops  # each after --gap steps of its own attempt
