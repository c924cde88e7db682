"""``plan.evaluate=true``: one given layout, its breakdown and its JSON line, checked against
the search's own evaluation of the same layout and against hand arithmetic."""

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, ROOT
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.validate import ConfigError
from trainer3d.plan.devices import device_for
from trainer3d.plan.evaluate import LayoutError, evaluate_report
from trainer3d.plan.search import search

SEVEN_B_ON_8 = ("model=7b", "cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=h100-sxm",
                "train.global_batch_size=64", "train.seq_len=4096")


def _plan_config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("plan", list(overrides)))


def test_evaluate_prints_a_7b_layout_on_8_gpus_with_a_json_last_line():
    cmd = [sys.executable, "-m", "trainer3d.plan", *SEVEN_B_ON_8, "parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
           "parallel.zero_stage=1", "train.micro_batch_size=1", "plan.evaluate=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    fields = json.loads(lines[-1])
    assert fields["layout"]["tp"] == 2 and fields["layout"]["pp"] == 2 and fields["layout"]["grad_accum_steps"] == 32
    assert fields["fits"] is True and 0 < fields["peak_bytes"] <= fields["usable_bytes"]
    # the step moves the global batch: tokens/s per GPU x GPUs x step = 64 x 4096 tokens
    assert fields["tokens_per_s_per_gpu"] * 8 * fields["step_s"] == pytest.approx(64 * 4096)
    # MFU against the H100 SXM data sheet's 989 dense bf16 TFLOP/s
    assert fields["mfu"] == pytest.approx(fields["model_tflops_per_gpu"] / 989)
    # both bounding pipeline ranks printed term by term, and the step's terms
    text = proc.stdout
    assert "pipeline rank 0:" in text and "pipeline rank 1:" in text and "pp_receive_buffers" in text
    assert "bubble" in text and "dp_comm" in text
    for term in ("gemm", "attention", "elementwise", "tp_comm", "launch", "head"):
        assert f"    {term} " in text, term
        assert f"compute.{term}" in fields["step_terms"], term
    parts = sum(v for k, v in fields["step_terms"].items() if k.startswith("compute."))
    assert parts == pytest.approx(fields["step_terms"]["compute"])
    assert sum(fields["step_terms"][k] for k in ("compute", "bubble", "pp_comm", "dp_comm", "optimizer", "host")) \
        == pytest.approx(fields["step_s"])


def test_the_attention_kernel_is_a_cluster_knob():
    layout = (*SEVEN_B_ON_8, "parallel.tp=8", "parallel.pp=1", "parallel.dp=1", "train.micro_batch_size=1",
              "plan.evaluate=true")
    device = device_for("h100-sxm")
    flash = evaluate_report(_plan_config(*layout), device)[1]
    math = evaluate_report(_plan_config(*layout, "cluster.attention=math"), device)[1]
    assert math["step_s"] > flash["step_s"]  # every score computed, and written to memory
    assert math["peak_bytes"] > flash["peak_bytes"]  # ... and kept for backward
    with pytest.raises(LayoutError, match="cluster.attention=xformers is not one of flash, math"):
        evaluate_report(_plan_config(*layout, "cluster.attention=xformers"), device)


def test_evaluate_agrees_with_the_search_on_the_same_layout():
    cfg = _plan_config(*SEVEN_B_ON_8, "search.micro_batch_sizes=[2]", "search.zero_stages=[0]",
                       "search.sequence_parallel=[true]", "search.recompute=[false]", "search.virtual_stages=[1]")
    device = device_for("h100-sxm")
    found = [p for p in search(cfg, device).plans if (p.cfg.parallel.tp, p.cfg.parallel.pp) == (4, 2)]
    assert found, "the search should keep tp=4 pp=2 micro 2 for 7b on 8 H100s"
    given = _plan_config(*SEVEN_B_ON_8, "parallel.tp=4", "parallel.pp=2", "parallel.dp=1", "parallel.zero_stage=0",
                         "parallel.sequence_parallel=true", "train.micro_batch_size=2", "plan.evaluate=true")
    _, fields = evaluate_report(given, device)
    assert fields["step_s"] == pytest.approx(found[0].step.total)
    assert fields["peak_bytes"] == found[0].memory.total


def test_a_layout_that_does_not_cover_the_cluster_is_refused_naming_the_fix():
    cfg = _plan_config(*SEVEN_B_ON_8, "parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "train.micro_batch_size=1",
                       "plan.evaluate=true")
    covers = r"tp\*cp\*pp\*dp = 2\*1\*1\*2 = 4 ranks, but cluster.nodes\*cluster.gpus_per_node = 8; set parallel.dp=4"
    with pytest.raises(LayoutError, match=covers):
        evaluate_report(cfg, device_for("h100-sxm"))
    cfg = _plan_config(*SEVEN_B_ON_8, "parallel.dp=8", "plan.evaluate=true")
    with pytest.raises(LayoutError, match="set train.micro_batch_size"):
        evaluate_report(cfg, device_for("h100-sxm"))
    cfg = _plan_config(*SEVEN_B_ON_8, "parallel.tp=8", "parallel.pp=1", "parallel.dp=1", "train.micro_batch_size=3",
                       "plan.evaluate=true")
    with pytest.raises(ConfigError, match="global_batch_size"):
        evaluate_report(cfg, device_for("h100-sxm"))


def test_a_context_parallel_layout_is_evaluated_with_its_ring_exchange():
    cfg = _plan_config("model=7b", "model.max_seq_len=32768", "cluster.nodes=1", "cluster.gpus_per_node=8",
                       "cluster.gpu=h100-sxm", "train.global_batch_size=8", "train.seq_len=32768", "parallel.tp=2",
                       "parallel.cp=4", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=true",
                       "train.micro_batch_size=1", "train.activation_checkpointing=true", "plan.evaluate=true")
    text, fields = evaluate_report(cfg, device_for("h100-sxm"))
    assert fields["layout"]["cp"] == 4 and fields["world"] == 8
    assert fields["step_terms"]["compute.cp_comm"] >= 0 and "cp_comm" in text
    assert fields["tokens_per_s_per_gpu"] * 8 * fields["step_s"] == pytest.approx(8 * 32768)
