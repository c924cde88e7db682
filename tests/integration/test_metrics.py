"""Observability: metrics.jsonl's keys, wandb (offline, for real), the progress line, no syncs. A
sweep's points as wandb runs of one group: tests/integration/test_lineage.py, with their resume.

The 4-rank wandb run does the entry point's work on in-process ranks (tests/support/runs.py:
``configure`` and ``_train_rank``, as ``train_in_ranks``): the metrics, the goodput summary and the
wandb run are the ranks' (rank 0's sinks: trainer3d/observe/loggers.py), not the launcher's."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, ROOT
from tests.support.harness import dims_for, run_ranks
from tests.support.runs import _train_rank, configure, read_metrics
from tests.support.wandb_records import read_run, run_files
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.memory.states import engine_model_state_bytes
from trainer3d.observe.metrics import MetricsLogger
from trainer3d.model.flops import flops_per_token
from trainer3d.parallel.parallelize import build_meta_chunks
from trainer3d.parallel.zero.flat import bucket_numel
from trainer3d.parallel.topology import ParallelDims, Topology
from trainer3d.trainer import Trainer
from trainer3d.config.validate import validate

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_rank", "tflops_per_rank", "mfu",
        "step_time_s", "comm_s", "bubble", "bubble_theory", "skipped", "mem_state_bytes", "mem_rss_bytes"}
SMALL = ("train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.grad_accum_steps=null",
         "optim.warmup_steps=2", "parallel.timeout_s=60")


def _state_bytes_by_accounting(overrides) -> int:
    """trainer3d.memory.states's model-state bytes of the run's layout, max over its ranks (per
    pipeline stage: the shapes a rank of that stage holds, built on the meta device)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = validate(OmegaConf.to_object(compose(config_name="config", overrides=[*overrides, "run_dir=/unused",
                                                                               "launcher.folder=/unused"])))
    p, topo = cfg.parallel, Topology(tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp)
    most = 0
    for pp_rank in range(p.pp):
        dims = ParallelDims(topo=topo, rank=topo.rank(pp_rank, 0, 0, 0), mesh=None, tp_group=None, dp_group=None,
                            pp_group=None, device=torch.device("meta"))
        shapes = [tuple(q.shape) for chunk in build_meta_chunks(cfg, dims) for q in chunk.parameters()]
        want = engine_model_state_bytes(shapes, p.dp, p.zero_stage, cfg.train.dtype, bucket_numel(cfg))
        most = max(most, want.total)
    return most


API_KEY = "sk-must-never-be-written-0123456789abcdef"


def _rank_with_a_wandb_key(rank, world_size, cfg):
    """A rank of the run, with a wandb API key in its environment and no $WANDB_MODE (the forkserver's
    ranks do not see the test's environment): rank 0's stdout."""
    os.environ["WANDB_API_KEY"] = API_KEY
    os.environ.pop("WANDB_MODE", None)
    return _train_rank(rank, world_size, cfg)


def test_one_offline_wandb_run_per_training_run_with_config_and_every_metric(tmp_path):
    run_dir = tmp_path / "run"
    layout = [*SMALL, "parallel=single", "parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=1"]
    cfg = configure(run_dir, [*layout, "train.max_steps=6", "train.log_every=3", "logger=wandb", "logger.mode=offline",
                              "logger.tags=[ci]", "train.peak_tflops=0.5", "train.eval_every=3", "train.eval_steps=1"])
    stdout = run_ranks(_rank_with_a_wandb_key, 4, cfg, timeout=600, pg_timeout_s=cfg.parallel.timeout_s)[0]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    state_bytes = _state_bytes_by_accounting(layout)
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert row["tokens_per_s_per_rank"] == pytest.approx(row["tokens_per_s"] / 4)
        # MFU = model FLOPs per rank per second / the configured peak; FLOPs per token from
        # trainer3d/model/flops.py (held to a hand count in tests/unit/test_flops.py).
        assert row["tflops_per_rank"] == pytest.approx(row["tokens_per_s_per_rank"] * flops_per_token(ModelConfig(), 64) / 1e12)
        assert row["mfu"] == pytest.approx(row["tflops_per_rank"] / 0.5)
        # pp 2, 2 micro-batches: theory 1/3; every stage waits on its neighbour some of the step
        assert row["bubble"] > 0 and row["bubble_theory"] == pytest.approx(1 / 3)
        assert row["mem_state_bytes"] == pytest.approx(state_bytes, rel=0.02)  # measured = the accounting
        assert row["comm_s"] > 0 and row["skipped"] == 0  # the dp reduction and the norm's all-reduce take time
        # goodput: the step split into its parts, the planner's prediction for this layout beside it
        assert 0 < row["bubble_s"] < row["step_time_s"] and row["compute_s"] >= 0
        assert row["predicted_step_time_s"] > 0 and row["predicted_bubble_s"] > 0
        assert row["predicted_step_time_s"] == pytest.approx(
            row["predicted_compute_s"] + row["predicted_bubble_s"] + row["predicted_comm_s"])
        assert row["predicted_tokens_per_s"] == pytest.approx(8 * 64 / row["predicted_step_time_s"])
    for interval in (rows[:3], rows[3:]):  # train.log_every=3: the parts cover the interval's mean step
        mean = {k: sum(r.get(k, 0.0) for r in interval) / 3 for k in ("bubble", "comm_s", "ckpt_stall_s")}
        step = interval[0]["step_time_s"]
        for r in interval:
            assert r["bubble_s"] == pytest.approx(mean["bubble"] * step)
            assert r["compute_s"] == pytest.approx(max(0.0, step - r["bubble_s"] - mean["comm_s"] - mean["ckpt_stall_s"]))
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert goodput["steps"] == 6 and goodput["lost_s"] == 0
    assert goodput["train_s"] == pytest.approx(sum(r["step_time_s"] for r in rows))
    assert goodput["goodput"] == pytest.approx(sum(r["compute_s"] for r in rows) / goodput["train_s"])
    # tokens/s by hand: 6 steps of 8 sequences x 64 tokens over the rows' step times
    assert goodput["tokens_per_s"] == pytest.approx(6 * 8 * 64 / sum(r["step_time_s"] for r in rows))
    for row in rows:  # and in each interval's row and line, its step's tokens over its mean step time
        assert row["tokens_per_s"] == pytest.approx(8 * 64 / row["step_time_s"])
    assert goodput["predicted"]["step_s"] == rows[0]["predicted_step_time_s"]
    assert "goodput:" in stdout, stdout
    files = run_files(run_dir)
    assert len({f.stem for f in files}) == 1, f"one wandb run per training run (4 ranks), got {files}"
    run = read_run(files[0])
    assert list(run["run"].tags) == ["ci"]
    assert run["config"]["parallel"]["pp"] == 2 and run["config"]["layout"]["world_size"] == 4
    history = run["history"]
    assert [h["_step"] for h in history] == list(range(6))
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows])
    # evaluated after steps 3 and 6 (train.eval_every=3): the same val_loss in both places
    assert [r["step"] for r in rows if "val_loss" in r] == [h["_step"] for h in history if "val_loss" in h] == [2, 5]
    assert [h["val_loss"] for h in history if "val_loss" in h] == pytest.approx(
        [r["val_loss"] for r in rows if "val_loss" in r])
    assert KEYS - {"step"} <= history[0].keys()
    assert run["summary"]["goodput/goodput"] == pytest.approx(goodput["goodput"])
    assert run["summary"]["goodput/predicted.step_s"] == pytest.approx(goodput["predicted"]["step_s"])
    assert "wandb sync" in stdout, stdout
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), f"API key written to {path}"


def _logger(stream, max_steps=3):
    dims = ParallelDims(topo=Topology(tp=1, pp=1, dp=2), rank=1, mesh=None, tp_group=None, dp_group=None,
                        pp_group=None, device=torch.device("cpu"))  # not rank 0: writes no file
    return MetricsLogger(dims, "/nonexistent-not-written", max_steps, 1000, stream=stream)


ROW = {"step": 0, "loss": 3.2, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 12345.0, "mfu": 0.012,
       "step_time_s": 0.5}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_in_a_file_is_plain_lines():
    out = io.StringIO()
    logger = _logger(out)
    for step in range(3):
        logger._print(dict(ROW, step=step))
    text = out.getvalue()
    assert "\r" not in text and text.count("\n") == 3
    assert text.splitlines()[0] == ("step 1/3 | loss 3.2000 | lr 1.00e-03 | grad_norm 1.000 | 12,345 tok/s | "
                                    "MFU 1.2% | 0.500 s/step | eta 1s")


def test_progress_line_never_prints_an_mfu_above_100_percent_without_saying_why():
    out = io.StringIO()
    logger = _logger(out)
    logger.peak_tflops = 0.02
    logger._print(dict(ROW, mfu=1.44))
    assert "| MFU >100% (144% of a peak of 0.02 TFLOP/s, which is low: measured at start-up under contention, " \
           "or train.peak_tflops set low) |" in out.getvalue()


def test_progress_line_shows_the_validation_loss_of_an_evaluated_step():
    out = io.StringIO()
    _logger(out)._print(dict(ROW, val_loss=2.5, val_ppl=12.1825))
    assert out.getvalue().rstrip("\n").endswith("| eta 1s | val_loss 2.5000 (ppl 12.18)")


def test_progress_line_in_a_terminal_rewrites_one_line():
    out = _Terminal()
    logger = _logger(out)
    for step in range(3):
        logger._print(dict(ROW, step=step))
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("eta 0s\n")


def _reduced_rows(rank, world, run_dir):
    """Two steps on a dp=world layout: rank r's loss is 10 r + step, its bubble column
    (r + 1) / 10, its memory figure 1000 (r + 1)."""
    dims = dims_for(dp=world)
    logger = MetricsLogger(dims, run_dir, max_steps=2, tokens_per_step=100, stream=io.StringIO(),
                           state_bytes=lambda: 1000 * (rank + 1))
    logger.add_column("bubble", lambda: [(rank + 1) / 10] * 2)
    for step in range(2):
        logger.record(step, torch.tensor(10.0 * rank + step), torch.tensor(1.0), 1e-3)
    return logger.flush()


def test_interval_reduction_means_over_replicas_and_ranks_and_maxes_memory(tmp_path):
    """The loss is the mean over dp replicas, a column the mean over all ranks, memory the max."""
    world = 4
    last = run_ranks(_reduced_rows, world, str(tmp_path), timeout=120)[0]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and rows[-1] == last
    for step, row in enumerate(rows):
        assert row["loss"] == pytest.approx(sum(10.0 * r + step for r in range(world)) / world)
        assert row["bubble"] == pytest.approx(sum((r + 1) / 10 for r in range(world)) / world)
        assert row["mem_state_bytes"] == 1000 * world


def test_process_memory_grows_by_what_the_process_touches_in_bytes():
    """A process started from this (large) pytest process touches 64 MiB: its reported peak
    grows by 64 MiB. Units (Linux reports KiB) and the source both matter: getrusage's peak
    would still hold this parent's size from before exec and not move at all."""
    code = ("import torch; from trainer3d.observe.telemetry import process_memory; cpu = torch.device('cpu');"
            "before = process_memory(cpu)['mem_rss_bytes']; x = torch.ones(64 * 2 ** 20 // 4);"
            "print(process_memory(cpu)['mem_rss_bytes'] - before)")
    ballast = bytearray(b"\x01") * (512 * 2 ** 20)  # touched: this parent is larger than the child gets
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    del ballast
    assert proc.returncode == 0, proc.stderr
    assert 60 * 2 ** 20 <= float(proc.stdout) <= 80 * 2 ** 20, proc.stdout


# ------------------------------------------------------------------ no host sync inside the step

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _count_reads(rank, world, layout):
    cfg = Config()
    cfg.run_dir = layout.pop("run_dir")
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 8, None
    cfg.train.seq_len, cfg.train.max_steps, cfg.train.log_every = 32, 4, 4
    for key, value in layout.items():
        setattr(cfg.parallel, key, value)
    cfg = validate(cfg)
    trainer = Trainer(cfg, dims_for(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp))
    for step in range(2):  # warm-up: the pipeline infers shapes on its first step
        trainer.metrics.record(step, *trainer.train_step(step))
    trainer.metrics.flush()
    counts = {"step": 0, "flush": 0}
    phase = ["step"]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            counts[phase[0]] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        for step in range(2, 4):
            loss, grad_norm, lr = trainer.train_step(step)
            trainer.metrics.record(step, loss, grad_norm, lr, trainer.optimizer.step_metrics())
            trainer.nonfinite.record(step, loss, grad_norm)  # the non-finite watch adds no read either
        phase[0] = "flush"
        trainer.metrics.flush()
        trainer.nonfinite.check()
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    return counts


@pytest.mark.parametrize("layout", [dict(dp=2, zero_stage=1), dict(pp=2, dp=1), dict(tp=2, dp=1, sequence_parallel=True)],
                         ids=["dp2-zero1", "pp2-1f1b", "tp2-sp"])
def test_no_host_reads_of_tensors_inside_the_step(tmp_path, layout):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    counts = run_ranks(_count_reads, world, dict(layout, run_dir=str(tmp_path)), timeout=300)
    for rank, c in enumerate(counts):
        assert c["step"] == 0, f"rank {rank}: {c['step']} tensor reads inside train_step/record"
    assert counts[0]["flush"] > 0  # the reads happen at the logging interval, on rank 0 at least
