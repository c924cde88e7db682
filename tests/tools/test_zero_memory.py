"""Model-state memory: the ZeRO paper's Table 1 from the formulas, the engine's accounting
reconciled with the paper's term by term, and the bytes real ranks hold held to it."""

import subprocess

import pytest
import torch

from trainer3d.memory.states import engine_model_state_bytes, paper_model_state_bytes, table1
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.zero.flat import bucket_numel
from trainer3d.observe.telemetry import model_state_bytes, storage_bytes
from tests.conftest import ROOT
from tests.support import run_scripts
from tests.support.harness import run_ranks
from tests.support.zero_ranks import build, global_batch, loss_of, make_cfg, muon_cfg, train_step
from trainer3d.optim.muon import is_muon_param

# Rajbhandari et al. 2020, Table 1, as printed: GB per device for P_os, P_os+g, P_os+g+p.
PAPER_TABLE1 = {
    "7.5B": {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
             64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    "128B": {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
             64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    "1T": {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}


def _last_digit(printed: str) -> float:
    return 10.0 ** -len(printed.split(".")[1]) if "." in printed else 1.0


def test_formulas_reproduce_the_papers_table1():
    rows = table1()
    assert len(rows) == 18
    for name, dp, *ours in rows:
        for value, printed in zip(ours, PAPER_TABLE1[name][dp]):
            # the paper rounds (41.25 -> 41.3) or truncates (4187.5 -> 4187): within its last digit
            assert abs(value - float(printed)) < _last_digit(printed), (name, dp, value, printed)


def _tool(*args: str) -> subprocess.CompletedProcess:
    """tools/bench/zero_memory.py run to its end in this process as ``python tools/bench/zero_memory.py``
    runs it (tests/support/run_scripts.py: it only reads presets and prints; no interpreter of its own
    to start, and torch is here already)."""
    return run_scripts.run_here(ROOT / "tools" / "bench" / "zero_memory.py", args)


def test_zero_memory_tool_prints_table1():
    proc = _tool()
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("64 |"))
    for figure in ("31.4", "16.6", "1.88", "536", "284", "32", "250"):
        assert figure in line.split(), line


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_accounting_is_the_paper_plus_stated_differences(stage, dtype):
    """With no padding (every size divisible by dp, one bucket) the engine differs from the
    paper exactly by its documented choices: fp32 gradient accumulation (+2 bytes/param, on
    the shard for 2/3; stage 3 keeps no 16-bit parameter shard), no master copy in fp32 training (params/grads 4 bytes instead of 2,
    K = 8), and the step counter / fp16 loss-scaler scalars."""
    shapes, dp = [(64, 32), (32,), (128, 32)], 4
    psi = sum(torch.Size(s).numel() for s in shapes)
    got = engine_model_state_bytes(shapes, dp, stage, dtype, bucket_numel=10 ** 6)
    # the fp32 step counter; fp16 adds the loss scaler's scale, growth count, overflow flag and
    # the scale the last step used (four 4-byte tensors)
    scalars = 4 + (4 * 4 if dtype == "fp16" else 0)
    if dtype == "fp32":  # every term in 4-byte words, and no separate master (K = 8)
        # params 4 + grads 4 + Adam 8; stage 1 shards Adam; stage 2 shards all but the gathered
        # 4-byte parameters it holds between forward and backward; stage 3 shards everything
        per_param = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / dp, 2: 4 + (4 + 4 + 8) / dp, 3: (4 + 4 + 8) / dp}[stage]
        assert got.total == per_param * psi + scalars
    else:
        # +2 bytes/param of fp32 gradient; stage 3 keeps no 16-bit parameter shard (FSDP2 casts
        # while gathering), which gives those 2 bytes back.
        extra = {0: 2 * psi, 1: 2 * psi, 2: 2 * psi / dp, 3: 0}[stage]
        assert got.total == paper_model_state_bytes(psi, dp, stage) + extra + scalars


def _measure(rank, world):
    """Per stage and dtype, after two training steps: (measured, expected) model-state bytes
    at the step, and for stage 2 also mid-step, after the last micro-batch's forward, when
    FSDP2 holds the gathered parameters (trainer3d/memory/states.py's ``gathered`` term) until backward ends."""
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Transformer(make_cfg(1, 0).model).parameters()]
    out = []
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16"):
            cfg = make_cfg(world, stage, dtype=dtype, bucket_mb=0.01)
            dims, model, opt = build(cfg)
            for step in range(2):  # anything allocated lazily exists by now
                train_step(model, opt, cfg, dims.dp_rank, step)
            want = engine_model_state_bytes(shapes, world, stage, dtype, bucket_numel(cfg), dims.dp_rank)
            out.append((stage, dtype, "at the step", model_state_bytes([model], opt), want.total - want.gathered))
            if stage == 2:
                x, y = global_batch(cfg, 2)
                loss = loss_of(model, x[dims.dp_rank], y[dims.dp_rank])
                out.append((stage, dtype, "after forward", model_state_bytes([model], opt), want.total))
                loss.backward()
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_measured_bytes_match_the_engine_accounting(dp):
    """Per rank: parameters + gradients + optimizer state, counted as tensor storage bytes
    (trainer3d.observe.telemetry, what metrics.jsonl reports as mem_state_bytes), within 2% of
    trainer3d.memory.states — at the step (FSDP2 has freed what it gathered) and, for ZeRO-2, while
    the full parameters are gathered between forward and backward."""
    for rank, rows in enumerate(run_ranks(_measure, dp, timeout=300)):
        for stage, dtype, when, measured, expected in rows:
            assert measured == pytest.approx(expected, rel=0.02), (rank, stage, dtype, when, measured, expected)


def test_zero_memory_tool_reports_the_dry_runs_rank_shapes():
    """The tool's per-rank figure comes from the same meta-built shapes as dry_run=true."""
    from trainer3d.config.schema import Config
    from trainer3d.memory.states import rank_parameter_shapes

    proc = _tool("--model", "tiny", "--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "1", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = 2, 2, 2
    counts = [sum(torch.Size(s).numel() for s in rank_parameter_shapes(cfg, rank)) for rank in (0, 4)]
    stage = max(range(2), key=counts.__getitem__)
    assert f"largest stage {stage}: {counts[stage]:,} parameters per rank" in proc.stdout


def _split(model, opt):
    """(device bytes, host bytes) of the model states: the optimizer names its host tensors;
    the rest of the model's parameters and the optimizer's tensors are the device's."""
    host = opt.adam.host_tensors() if hasattr(opt, "adam") else opt.host_tensors()
    held = {t.untyped_storage().data_ptr() for t in host}
    everything = [*model.parameters(), *(t for ts in opt.state_tensors().values() for t in ts)]
    device = [t for t in everything if getattr(t, "_local_tensor", t).untyped_storage().data_ptr() not in held]
    return storage_bytes(device), storage_bytes(host)


def _measure_offload(rank, world):
    """Every stage with the optimizer offloaded, after two steps: (stage, dtype, when, device
    bytes measured, host bytes measured, the accounting's ModelStateBytes); stage 2 also after
    the last micro-batch's forward, with FSDP2's gathered parameters on the device."""
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Transformer(make_cfg(1, 0).model).parameters()]
    out = []
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16", "fp16"):
            cfg = make_cfg(world, stage, dtype=dtype, bucket_mb=0.01)
            cfg.parallel.offload_optimizer = True
            dims, model, opt = build(cfg)
            for step in range(2):
                train_step(model, opt, cfg, dims.dp_rank, step)
            want = engine_model_state_bytes(shapes, world, stage, dtype, bucket_numel(cfg), dims.dp_rank, offload=True)
            out.append((stage, dtype, "at the step", *_split(model, opt), want))
            if stage == 2:
                x, y = global_batch(cfg, 2)
                loss = loss_of(model, x[dims.dp_rank], y[dims.dp_rank])
                out.append((stage, dtype, "after forward", *_split(model, opt), want))
                loss.backward()
    return out


def test_offloaded_state_is_host_memory_as_accounted():
    """parallel.offload_optimizer: the host holds exactly the bytes trainer3d.memory.states says
    — stages 0/1: 16 per owned element, + 2 for the bf16/fp16 cast, + the step counter; stages
    2/3: the padded fp32 parameter shard, the gradient shard and moments of the real rows, the
    step counter — and the device the rest: stages 0/1 the parameters, the fp32 gradient
    buckets and fp16's scaler; stages 2/3 fp16's scaler, and ZeRO-2's gathered parameters
    between forward and the end of backward; never a master or a moment."""
    for rank, rows in enumerate(run_ranks(_measure_offload, 2, timeout=300)):
        for stage, dtype, when, device, host, want in rows:
            assert host == want.host, (rank, stage, dtype, when, host, want)
            gathered = want.gathered if when == "after forward" else 0
            assert device == want.total - want.gathered + gathered, (rank, stage, dtype, when, device, want)
            assert want.master == 0 and want.optimizer == (16 if dtype == "fp16" else 0)


def _measure_muon(rank, world):
    """optim=muon, stages 0/1, fp32 and bf16, after two steps: (measured, expected) model-state bytes."""
    with torch.device("meta"):
        named = list(Transformer(make_cfg(1, 0).model).named_parameters())
    shapes, muon = [tuple(p.shape) for _, p in named], [is_muon_param(n, p) for n, p in named]
    out = []
    for stage in (0, 1):
        for dtype in ("fp32", "bf16"):
            cfg = muon_cfg(make_cfg(world, stage, dtype=dtype, bucket_mb=0.01))
            dims, model, opt = build(cfg)
            for step in range(2):
                train_step(model, opt, cfg, dims.dp_rank, step)
            want = engine_model_state_bytes(shapes, world, stage, dtype, bucket_numel(cfg), dims.dp_rank, muon=muon)
            adamw = engine_model_state_bytes(shapes, world, stage, dtype, bucket_numel(cfg), dims.dp_rank)
            out.append((stage, dtype, model_state_bytes([model], opt), want.total, adamw.total))
    return out


def test_muon_measured_bytes_equal_the_accounting():
    """optim=muon: one fp32 momentum per owned Muon element instead of Adam's two moments, and
    state for the owned parameter elements only; the tensors the ranks hold (mem_state_bytes)
    equal trainer3d.memory.states to the byte, and are below AdamW's."""
    for rank, rows in enumerate(run_ranks(_measure_muon, 2, timeout=300)):
        for stage, dtype, measured, expected, adamw in rows:
            assert measured == expected, (rank, stage, dtype, measured, expected)
            assert measured < adamw, (rank, stage, dtype)
