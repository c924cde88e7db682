"""Published large training runs the planner is checked against: each run's model, layout
and published throughput as its source gives them, and the planner's prediction for the
same layout (``plan.evaluate=true``'s evaluation; tools/bench/published_runs.py prints the
table, docs/planning.md records it, tests/unit/test_published_runs.py holds it).

The sources' models are GPT-3-style (LayerNorm, a 4h GeLU MLP, learned or ALiBi positions)
or Llama-style; trainer3d builds Llama-style blocks, so a 4h GeLU MLP is expressed as a
SwiGLU of width 8h/3 (rounded to a multiple of tp): the same 8h^2 weights and matmul FLOPs
per token. Throughput is compared in tokens per second per GPU, converted from the
published figure with the source's own FLOP count:

    tflops_recompute  Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per
                      iteration (the recomputed forward counted; Megatron-LM's and
                      Megatron-DeepSpeed's logged TFLOP/s)
    iteration_s       seconds per iteration of B sequences of s tokens on the run's GPUs
    model_tflops      model FLOPs per GPU, here the PaLM count of trainer3d/model/flops.py
    tokens_per_s      tokens per second per GPU, as the source prints it

The H100 runs are held out: no figure of the presets or the step-time model was fitted to
them. They are FSDP-style runs (ZeRO-3, or ZeRO-2 for ``SHARD_GRAD_OP``) of other engines
(MosaicML's Composer with PyTorch FSDP, torchtitan with FSDP2), timed here as trainer3d's
engine would run the same layout; docs/planning.md gives their errors and what the model
leaves out.
"""

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from trainer3d.model.flops import flops_per_token
from trainer3d.plan.devices import device_for
from trainer3d.plan.evaluate import evaluate_layout, summary
from trainer3d.plan.settings import PlanConfig

MEGATRON_2021 = ("Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU Clusters Using "
                 "Megatron-LM\" (SC21, arXiv:2104.04473), Table 1")
# Table 1's 1T row is also the abstract's "502 petaFLOP/s on 3072 GPUs (per-GPU throughput of 52% of
# theoretical peak)"; tests/unit/test_published_runs.py checks every row against the table's own
# parameter-count and aggregate-PFLOP/s columns.
KORTHIKANTI_2022 = ("Korthikanti et al. 2022, \"Reducing Activation Recomputation in Large Transformer Models\" "
                    "(arXiv:2205.05198), Tables 3 and 5")
MT_NLG = ("Smith et al. 2022, \"Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B\" "
          "(arXiv:2201.11990), system throughput: 60.1 s per iteration of 1920 sequences on 280 DGX A100 nodes")
BLOOM = ("BigScience 2022, BLOOM 176B model summary (bigscience.notion.site: 384 A100 80GB, one replica per 48 "
         "GPUs, \"about 150 TFLOPs\"); Le Scao et al. 2022 (arXiv:2211.05100) and the training script "
         "(bigscience-workshop/bigscience, train/tr11-176B-ml) for tp 4 x pp 12 x dp 8, micro-batch 2, batch 2048")
LLAMA3 = ("Llama Team 2024, \"The Llama 3 Herd of Models\" (arXiv:2407.21783), Table 4: 405B pre-training, "
          "H100 80GB, BF16 MFU")

MOSAIC_H100 = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md (commit 8c8dd48), tables \"H100 80GB BF16\" "
               "and \"(Large Scale, >= 128 GPUs)\": MPT models (4h GeLU MLP, ALiBi, vocabulary 50368, flash attention), "
               "FSDP FULL_SHARD (SHARD_GRAD_OP: ZeRO-2), amp_bf16, H100 80GB SXM")
TORCHTITAN_H100 = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Tables 1 and 3, FSDP, eager, selective op "
                   "recomputation, local batch 2, 8,192 tokens) and benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
                   "(bf16, vanilla TP, torch.compile): H100 96GB HBM2e at a 500 W power limit")

SHORT = {MEGATRON_2021: "Megatron-LM 2021, T1", KORTHIKANTI_2022: "Korthikanti 2022, T3/T5", MT_NLG: "MT-NLG 2022",
         BLOOM: "BLOOM 2022", LLAMA3: "Llama 3 2024, T4", MOSAIC_H100: "MosaicML H100",
         TORCHTITAN_H100: "torchtitan H100"}


@dataclass(frozen=True)
class Run:
    """One published run (the figures as its source gives them)."""

    source: str
    name: str
    dim: int
    n_layers: int
    n_heads: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    published: float
    unit: str
    """tflops_recompute | iteration_s | model_tflops | tokens_per_s (module docstring)."""
    micro: int = 1
    cp: int = 1
    recompute: bool = True
    sp: bool = False
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    """None: 8h/3, a 4h GeLU MLP's weights as SwiGLU."""
    vocab: int = 51200
    seq: int = 2048
    gpu: str = "a100-80g"
    attention: str = "math"
    """Megatron-LM before 2022 and DeepSpeed's GPT ran unfused attention (FlashAttention: 2022)."""
    zero_stage: int = 0
    pp_layers: Optional[Tuple[int, ...]] = None
    schedule: str = "1f1b"
    virtual: int = 1


def _megatron(name, heads, h, layers, tp, pp, gpus, batch, tflops) -> Run:
    return Run(MEGATRON_2021, name, h, layers, heads, tp, pp, gpus, batch, tflops, "tflops_recompute")


def _korthikanti(name, heads, h, layers, pp, gpus, batch, full_s, present_s) -> List[Run]:
    """Table 3's configuration (tp 8 throughout) and Table 5's iteration times; micro-batch 1
    is assumed (the tables give the global batch only)."""
    full = Run(KORTHIKANTI_2022, f"{name} full recompute", h, layers, heads, 8, pp, gpus, batch, full_s, "iteration_s")
    present = replace(full, name=f"{name} SP, no recompute", published=present_s, recompute=False, sp=True,
                      attention="flash")
    return [full, present]


MPT_SHAPES = {"1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
              "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
"""MPT's d_model, heads, layers (llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml)."""


def _mpt(size, seq, gpus, micro, accum, recompute, tokens_per_s, zero_stage=3) -> Run:
    h, heads, layers = MPT_SHAPES[size]
    return Run(MOSAIC_H100, f"MPT {size}, {seq} tokens, {gpus} GPUs", h, layers, heads, 1, 1, gpus,
               micro * accum * gpus, tokens_per_s, "tokens_per_s", micro=micro, recompute=recompute, vocab=50368,
               seq=seq, gpu="h100-sxm", attention="flash", zero_stage=zero_stage)


def _llama31_8b(name, gpus, tp, micro, tokens_per_s, recompute=False) -> Run:
    return Run(TORCHTITAN_H100, name, 4096, 32, 32, tp, 1, gpus, micro * gpus // tp, tokens_per_s, "tokens_per_s",
               micro=micro, recompute=recompute, sp=tp > 1, n_kv_heads=8, ffn_dim=14336, vocab=128256, seq=8192,
               gpu="h100-sxm", attention="flash", zero_stage=3)


H100_RUNS: Tuple[Run, ...] = (
    # size, seq, GPUs, micro-batch, accumulation, recompute, tokens/s per GPU (the table's T/s/GPU column)
    _mpt("1b", 2048, 8, 14, 1, False, 45455),
    _mpt("1b", 32768, 8, 1, 4, False, 12025),
    _mpt("3b", 4096, 8, 5, 6, False, 20964),
    _mpt("7b", 2048, 8, 6, 1, False, 10643),
    _mpt("7b", 8192, 8, 8, 2, True, 6935),
    _mpt("13b", 4096, 8, 10, 3, True, 4717),
    _mpt("13b", 2048, 64, 2, 1, False, 4800),
    _mpt("30b", 2048, 8, 3, 21, True, 2002),
    _mpt("1b", 2048, 512, 12, 1, False, 39837, zero_stage=2),
    _mpt("7b", 2048, 512, 6, 1, False, 9670),
    _mpt("70b", 2048, 128, 8, 1, True, 1058),
    _llama31_8b("Llama 3.1 8B, FSDP, 8 GPUs", 8, 1, 2, 5762),
    _llama31_8b("Llama 3.1 8B, FSDP, 128 GPUs", 128, 1, 2, 5605),
    _llama31_8b("Llama 3.1 8B, FSDP 8 x TP 8", 64, 8, 12, 4378),
    Run(TORCHTITAN_H100, "Llama 3.1 70B, FSDP 32 x TP 8", 8192, 80, 64, 8, 1, 256, 512, 597.3, "tokens_per_s", micro=16,
        recompute=True, sp=True, n_kv_heads=8, ffn_dim=28672, vocab=128256, seq=8192, gpu="h100-sxm",
        attention="flash", zero_stage=3),
)

RUNS: Tuple[Run, ...] = (
    # name, heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    # name, heads, hidden, layers, pp, GPUs, batch, iteration s: full recompute, SP + selective
    *_korthikanti("22B", 64, 6144, 48, 1, 8, 4, 1.42, 1.10),
    *_korthikanti("175B", 96, 12288, 96, 8, 64, 64, 18.13, 13.75),
    *_korthikanti("530B", 128, 20480, 105, 35, 280, 280, 49.05, 37.83),
    *_korthikanti("1T", 160, 25600, 128, 64, 512, 512, 94.42, 71.49),
    Run(MT_NLG, "MT-NLG 530B", 20480, 105, 128, 8, 35, 2240, 1920, 60.1, "iteration_s"),
    Run(BLOOM, "BLOOM 176B", 14336, 70, 112, 4, 12, 384, 2048, 150, "tflops_recompute", micro=2, vocab=250880,
        zero_stage=1),
    *(Run(LLAMA3, f"Llama 3 405B, {gpus} GPUs", 16384, 126, 128, 8, 16, gpus, 2048, tflops, "model_tflops",
          n_kv_heads=8, ffn_dim=53248, vocab=128256, seq=8192, gpu="h100-sxm", attention="flash", recompute=False,
          sp=True, zero_stage=1, pp_layers=(7, *[8] * 14, 7))
      for gpus, tflops in ((8192, 430), (16384, 400))),
    Run(LLAMA3, "Llama 3 405B, 16384 GPUs, 131k tokens", 16384, 126, 128, 8, 16, 16384, 128, 380, "model_tflops",
        cp=16, n_kv_heads=8, ffn_dim=53248, vocab=128256, seq=131072, gpu="h100-sxm", attention="flash",
        recompute=False, sp=True, zero_stage=1, pp_layers=(7, *[8] * 14, 7)),
    *H100_RUNS,
)


def gpt_ffn(dim: int, tp: int) -> int:
    """SwiGLU width with a 4h MLP's weights (3 x h x f = 8 h^2), a multiple of tp."""
    return round(8 * dim / 3 / tp) * tp


def plan_config(run: Run) -> PlanConfig:
    """The run's model and layout as ``python -m trainer3d.plan plan.evaluate=true`` overrides set them."""
    cfg = PlanConfig()
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    m.name, m.dim, m.n_layers, m.n_heads = run.name, run.dim, run.n_layers, run.n_heads
    m.n_kv_heads = run.n_kv_heads or run.n_heads
    m.ffn_dim = run.ffn_dim or gpt_ffn(run.dim, run.tp)
    m.vocab_size, m.max_seq_len, m.tie_embeddings = run.vocab, run.seq, run.ffn_dim is None
    p.tp, p.cp, p.pp, p.dp = run.tp, run.cp, run.pp, run.gpus // (run.tp * run.cp * run.pp)
    p.zero_stage, p.sequence_parallel = run.zero_stage, run.sp
    p.pp_layers = list(run.pp_layers) if run.pp_layers else None
    p.pp_schedule, p.pp_virtual_stages = run.schedule, run.virtual
    t.dtype, t.seq_len, t.micro_batch_size = "bf16", run.seq, run.micro
    t.global_batch_size, t.grad_accum_steps, t.activation_checkpointing = run.global_batch, None, run.recompute
    c.gpu, c.nodes, c.gpus_per_node, c.attention = run.gpu, run.gpus // 8, 8, run.attention
    cfg.plan.evaluate = True
    return cfg


def published_tokens_per_s_per_gpu(run: Run) -> float:
    """The published figure as tokens per second per GPU (module docstring)."""
    s, h, layers, v = run.seq, run.dim, run.n_layers, run.vocab
    if run.unit == "tflops_recompute":
        return run.published * 1e12 / (96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))
    if run.unit == "iteration_s":
        return run.global_batch * s / (run.published * run.gpus)
    if run.unit == "model_tflops":
        return run.published * 1e12 / flops_per_token(plan_config(run).model, s)
    if run.unit == "tokens_per_s":
        return run.published
    raise ValueError(f"unit {run.unit!r}")


@dataclass
class Check:
    run: Run
    published: float
    """Tokens per second per GPU."""
    predicted: float
    fits: bool
    peak_bytes: int
    usable_bytes: int

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def check(run: Run) -> Check:
    cfg = plan_config(run)
    device = device_for(run.gpu)
    fields = summary(cfg, device, evaluate_layout(cfg, device))
    return Check(run, published_tokens_per_s_per_gpu(run), fields["tokens_per_s_per_gpu"], fields["fits"],
                 fields["peak_bytes"], fields["usable_bytes"])


def command(run: Run) -> str:
    """The ``plan.evaluate=true`` command of a run."""
    cfg = plan_config(run)
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    parts = [f"model.dim={m.dim}", f"model.n_layers={m.n_layers}", f"model.n_heads={m.n_heads}",
             f"model.n_kv_heads={m.n_kv_heads}", f"model.ffn_dim={m.ffn_dim}", f"model.vocab_size={m.vocab_size}",
             f"model.max_seq_len={m.max_seq_len}", f"model.tie_embeddings={str(m.tie_embeddings).lower()}",
             f"cluster.gpu={c.gpu}", f"cluster.nodes={c.nodes}", f"cluster.attention={c.attention}",
             f"parallel.tp={p.tp}", f"parallel.cp={p.cp}", f"parallel.pp={p.pp}", f"parallel.dp={p.dp}", f"parallel.zero_stage={p.zero_stage}",
             f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}",
             f"train.seq_len={t.seq_len}", f"train.global_batch_size={t.global_batch_size}",
             f"train.micro_batch_size={t.micro_batch_size}",
             f"train.activation_checkpointing={str(t.activation_checkpointing).lower()}"]
    if p.pp_layers:
        parts.append("parallel.pp_layers=[" + ",".join(map(str, p.pp_layers)) + "]")
    return "python -m trainer3d.plan plan.evaluate=true " + " ".join(parts)
