"""``trainer3d-gpu-check`` on a machine without CUDA (trainer3d/tools/gpu_check.py), and the GPU
calibration's arithmetic (trainer3d/plan/calibrate_gpu.py): what can be checked without a GPU.
The checks themselves run only on a GPU node (docs/gpu.md, "The first hour on a new cluster")."""

import json
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT
from trainer3d.plan.calibrate_gpu import calibrated_device, device_record, preset_for
from trainer3d.plan.devices import PRESETS, load_calibration
from trainer3d.plan.evaluate import evaluate_layout, summary
from trainer3d.plan.probe import training_config
from trainer3d.tools import gpu_check
from trainer3d.tools.gpu_check import CHECKS, Result, planner_errors, summarise


def _run(*args):
    """``trainer3d-gpu-check ARGS`` (the console script calls ``main``) in this process: its exit
    status, stdout and stderr (argparse's refusals exit through SystemExit)."""
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = gpu_check.main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_list_prints_each_check_on_a_line_of_its_own():
    proc = _run("--list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["tier", "resume", "mfu", "planner"]
    assert all(len(line.split(None, 1)) == 2 for line in lines)  # a name, then what it does


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    proc = _run("--out", str(tmp_path / "report.json"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [gpu_check.NO_CUDA] and "CUDA" in gpu_check.NO_CUDA
    assert not (tmp_path / "report.json").exists()


def test_an_unknown_check_is_refused_naming_the_checks():
    proc = _run("--only", "tier,nope")
    assert proc.returncode == 2 and "--only nope" in proc.stderr and "tier, resume, mfu, planner" in proc.stderr


CANNED = [Result("tier", "pass", "12 passed, 0 failed, 23 skipped", 250.0, {"passed": 12, "failed": 0, "skipped": 23}),
          Result("resume", "pass", "steps 10-19 bit-identical after the resume", 40.0, {"steps_compared": 10}),
          Result("mfu", "fail", "RuntimeError: out of memory", 12.0),
          Result("planner", "skip", "needs the mfu check's measurement", 0.0)]


def test_the_summary_and_the_report_of_canned_results():
    text, report = summarise(CANNED, "1 x NVIDIA H100 80GB HBM3")
    lines = text.splitlines()
    assert lines[0] == "trainer3d GPU check on 1 x NVIDIA H100 80GB HBM3"
    assert [line.split()[:2] for line in lines[2:6]] == [["PASS", "tier"], ["PASS", "resume"], ["FAIL", "mfu"],
                                                         ["SKIP", "planner"]]
    assert "RuntimeError: out of memory" in lines[4] and lines[-1] == "FAILED: mfu"
    assert len(lines) <= 24  # one screen
    assert report["ok"] is False and report["gpu"] == "1 x NVIDIA H100 80GB HBM3"
    assert [c["name"] for c in report["checks"]] == list(CHECKS)
    assert report["checks"][0]["figures"] == {"passed": 12, "failed": 0, "skipped": 23}
    assert json.loads(json.dumps(report)) == report  # what --out writes

    text, report = summarise(CANNED[:2], "8 x NVIDIA H200")
    assert report["ok"] is True and text.splitlines()[-1] == "all checks passed"


def test_planner_errors_are_relative_to_the_measurement():
    assert planner_errors(1000.0, {"h100-sxm": 1400.0, "calibrated": 900.0}) == pytest.approx(
        {"h100-sxm": 0.4, "calibrated": -0.1})


def test_the_planner_evaluates_the_mfu_run_on_a_preset():
    """What the planner check evaluates on the GPU node, here on the H100 preset: the mfu run's
    own model and batch (1.3B, 2,048 tokens) on one GPU."""
    cfg = gpu_check.plan_of(training_config([o for o in gpu_check.MFU_RUN if not o.startswith(
        ("train.device", "train.compile"))]), "h100-sxm")
    fields = summary(cfg, PRESETS["h100-sxm"], evaluate_layout(cfg, PRESETS["h100-sxm"]))
    assert cfg.cluster.gpus_per_node == 1 and cfg.model.n_layers == 24 and cfg.train.seq_len == 2048
    assert fields["fits"] and fields["tokens_per_s_per_gpu"] > 0


@pytest.mark.parametrize("name, memory, preset", [("NVIDIA H100 80GB HBM3", 79.1, "h100-sxm"),
                                                  ("NVIDIA H100 PCIe", 79.6, "h100-pcie"),
                                                  ("NVIDIA H200", 139.8, "h200"),
                                                  ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40g"),
                                                  ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80g"),
                                                  ("Tesla V100-SXM2-32GB", 31.7, None)])
def test_a_cuda_devices_name_picks_its_preset(name, memory, preset):
    assert preset_for(name, memory) == preset


def test_a_calibrated_preset_takes_the_measured_rates_and_round_trips_through_its_file(tmp_path):
    """An H100 at 500 W measuring 10% under the preset's matmul figure: the GEMM model's anchor
    and the flat rates scale by the same 0.9, the bandwidth is the measured one, the rest (tiles,
    attention, links) the preset's; the file ``cluster.gpu=calibrated`` reads gives it back."""
    preset = PRESETS["h100-sxm"]
    figures = {"bf16_tflops": 0.9 * preset.kernels.mamf_tflops, "fp32_tflops": 50.0, "hbm_gbps": 2000.0}
    device = calibrated_device(preset, figures)
    assert device.kernels.mamf_tflops == pytest.approx(0.9 * preset.kernels.mamf_tflops)
    assert device.matmul_tflops["bf16"] == pytest.approx(0.9 * preset.matmul_tflops["bf16"])
    assert device.matmul_tflops["fp32"] == 50.0 and device.memory_gbps == device.kernels.hbm_gbps == 2000.0
    assert (device.kernels.sms, device.kernels.mamf_shape, device.kernels.flash_fraction) == (
        preset.kernels.sms, preset.kernels.mamf_shape, preset.kernels.flash_fraction)
    assert (device.intra_gbps, device.inter_gbps, device.peak_tflops) == (
        preset.intra_gbps, preset.inter_gbps, preset.peak_tflops)
    # a GEMM at the anchor's shape runs 10% slower; one far from it too (the same rate scales)
    m, n, k = preset.kernels.mamf_shape
    assert device.kernels.gemm_s(m, n, k) == pytest.approx(preset.kernels.gemm_s(m, n, k) / 0.9)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(device_record(device)))
    assert load_calibration(str(path)) == device


def test_the_console_script_is_declared_and_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["trainer3d-gpu-check"] == "trainer3d.tools.gpu_check:main"
    assert callable(gpu_check.main)
