#!/usr/bin/env python
"""trainer3d against DeepSpeed, side by side: tokens/s of FLOP-matched models, interleaved pairs.

    python tools/bench/deepspeed_pair.py [--pairs 4] [--steps 100] [--warmup 20] [--only trainer3d]
                                         [--against REV]
    python tools/bench/deepspeed_pair.py --blocks 10 [--reps 50]

Both train data-parallel over 2 CPU ranks (gloo), ZeRO stage 1, fp32, AdamW, gradient
clipping at 1.0, micro-batches of 8 x 64 tokens, one micro-batch per step, each through its
own entry point:

- trainer3d: ``python -m trainer3d.train`` with overrides (the local launcher, its
  heartbeats, metrics, watches and all): a Llama of dim 128, 4 blocks, 4 heads (no grouped
  queries), SwiGLU of 344, byte vocabulary (257). Its tokens/s come from its own
  metrics.jsonl: the tokens of the steps after ``--warmup`` over the wall time they took
  (each row's ``step_time_s`` is its logging interval's mean: whole intervals are summed).
- DeepSpeed (0.19.8; ``pip install -e '.[peers]'``): ``torchrun`` starts 2 ranks of this
  script, each building a GPT-2-style model of its own (plain torch modules: learned
  positions, LayerNorm, fused q/k/v, GELU MLP, biases, tied head) and calling
  ``deepspeed.initialize`` with ZeRO stage 1 over torch's fused AdamW. Its MLP is
  3 x 344 / 2 = 516 wide, so every block multiplies as many weights per token as
  trainer3d's (4 d^2 + 2 x 128 x 516 = 3 x 128 x 344 + 4 d^2, biases aside), the head and the
  attention scores the same: the same model FLOPs per token (printed, counted from each
  model's own linear layers). Tokens/s: rank 0's wall time from the end of the warm-up
  step to the end of the last step. Its first run on a machine compiles DeepSpeed's
  shared-memory communication op once (cached after).

Both sides train, on the same data and schedule, so the losses printed are comparable (a
peer that cannot learn is no peer): the DeepSpeed ranks read windows of 64 + 1 tokens of
the corpus trainer3d trains on (``data=stdlib``: this Python's standard library, byte-level;
``trainer3d.data.stdlib_corpus``), drawn at seeded random offsets, each rank its own, before
the clock starts; their learning rate follows trainer3d's own ``lr_at`` (linear warm-up over
20 steps to 3e-3, cosine decay to 3e-4 at the last step) through a ``LambdaLR`` handed to
``deepspeed.initialize``, which steps it after each optimizer step; AdamW's weight decay
(0.1) applies to matrices and embeddings only, as trainer3d's ``param_groups`` applies it
(1-D biases and LayerNorm weights undecayed). Random tokens would leave DeepSpeed's loss at
ln 257 = 5.55 whatever the optimizer did, and a constant learning rate is not trainer3d's.

``--blocks ROUNDS`` prints instead what one block of each model costs one thread, forward
and backward at the bench's shape: the best ``time.thread_time`` (CPU time of the thread,
which other processes on the core do not add to) of ROUNDS x ``--reps`` (50) calls, the two
alternating by round: a figure a loaded machine moves far less than tokens/s.

Each pair runs both, alternating which goes first; each pair's ratio is trainer3d's tokens/s
over DeepSpeed's, and the last line is the median ratio. ``--against REV`` adds trainer3d as
it is at git revision REV (``git archive`` of trainer3d/ and conf/; overrides it does not
know are left out) to each pair, with its own ratio: how the ratio moved between the two. Ranks get one intra-op thread each
(2 ranks on the 2-core development machine; trainer3d's launcher gives each rank its share
of the cores, and so does this script through ``--threads``). On a loaded machine the
figures are noise-dominated: measure on an idle one.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tools.bench.revision; a child puts its revision's tree before it

from tools.bench.revision import extract_revision  # noqa: E402
DIM, LAYERS, HEADS, SWIGLU, VOCAB = 128, 4, 4, 344, 257
GPT_MLP = 3 * SWIGLU // 2  # 516: the GELU MLP's two matrices hold as many weights as SwiGLU's three
DP, MICRO, SEQ, LR, CLIP = 2, 8, 64, 3e-3, 1.0


def trainer3d_overrides(steps: int, run_dir: Path):
    return ["parallel=dp2", "parallel.zero_stage=1", "model=tiny", f"model.dim={DIM}", f"model.n_layers={LAYERS}",
            f"model.n_heads={HEADS}", f"model.n_kv_heads={HEADS}", f"model.ffn_dim={SWIGLU}", f"model.vocab_size={VOCAB}",
            f"train.micro_batch_size={MICRO}", "train.grad_accum_steps=1", "train.global_batch_size=null",
            f"train.seq_len={SEQ}", "train.dtype=fp32", f"train.max_steps={steps}", "train.eval_every=0",
            "train.log_every=10", f"optim.lr={LR}", f"optim.grad_clip={CLIP}", "checkpoint.save_final=false",
            f"hydra.run.dir={run_dir}", f"run_dir={run_dir}", f"launcher.folder={run_dir / 'launcher'}"]


def matmul_weights_per_token(linears) -> int:
    """Weights of the linear layers a token goes through (in x out each), the head included."""
    return sum(m.in_features * m.out_features for m in linears)


# ---------------------------------------------------------------------------- trainer3d

def run_trainer3d(steps: int, warmup: int, root: Path = ROOT) -> dict:
    """trainer3d's half, with trainer3d/ and conf/ of ``root`` (this tree, or a revision's)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        overrides = trainer3d_overrides(steps, run_dir)
        schemas = [*(root / "trainer3d" / "config").glob("schema*.py"), root / "trainer3d" / "config.py"]
        schemas = [f for f in schemas if f.exists()]
        if not any("eval_every" in f.read_text(errors="replace") for f in schemas):
            overrides.remove("train.eval_every=0")  # a revision from before evaluation
        cmd = [sys.executable, "-m", "trainer3d.train", *overrides]
        env = dict(os.environ, WANDB_MODE="disabled",
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=1800, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r["step"] >= warmup]
    seconds = sum(r["step_time_s"] for r in timed)
    return {"tokens_per_s": len(timed) * DP * MICRO * SEQ / seconds, "loss": rows[-1]["loss"]}


# ---------------------------------------------------------------------------- DeepSpeed

def gpt2_model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.c_fc, self.mlp_proj = nn.Linear(DIM, GPT_MLP), nn.Linear(GPT_MLP, DIM)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(DIM, dim=-1)
            q, k, v = (t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
            self.h = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as GPT-2's
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, tokens, targets):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return GPT2()


def corpus_windows(count: int, seed: int):
    """``count`` windows of SEQ + 1 tokens of trainer3d's built-in corpus at seeded random offsets."""
    import numpy as np
    import torch

    from trainer3d.config.schema import DataConfig
    from trainer3d.data import TokenFile, stdlib_corpus

    tokens = TokenFile.open(stdlib_corpus(DataConfig().cache_dir), verify=False).tokens
    starts = np.random.default_rng(seed).integers(0, len(tokens) - SEQ - 1, size=count)
    return torch.from_numpy(np.stack([np.asarray(tokens[a:a + SEQ + 1], dtype=np.int64) for a in starts]))


def deepspeed_rank(args) -> None:
    """One torchrun rank: a GPT-2 through deepspeed.initialize, ZeRO-1, timed on rank 0."""
    import deepspeed
    import torch

    from trainer3d.config.schema import OptimConfig
    from trainer3d.optim.schedule import lr_at, param_groups

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    model = gpt2_model()
    cfg = OptimConfig(lr=LR, grad_clip=CLIP)  # trainer3d's defaults: betas, eps, decay, warm-up, min_lr
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, args.steps) / cfg.lr)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "gradient_clipping": CLIP, "steps_per_print": 10 ** 9,
              "fp16": {"enabled": False}, "bf16": {"enabled": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    rank = torch.distributed.get_rank()
    data = corpus_windows(args.steps * MICRO, seed=rank).view(args.steps, MICRO, SEQ + 1)
    inputs, targets = data[..., :-1].contiguous(), data[..., 1:].contiguous()  # made before the clock starts
    started = None
    for step in range(args.steps):
        loss = engine(inputs[step], targets[step])
        engine.backward(loss)
        engine.step()
        if step + 1 == args.warmup:
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    if rank == 0:
        print(json.dumps({"tokens_per_s": (args.steps - args.warmup) * DP * MICRO * SEQ / seconds, "loss": loss.item()}))


def run_deepspeed(steps: int, warmup: int, threads: int) -> dict:
    from trainer3d.config.schema import DataConfig
    from trainer3d.data import stdlib_corpus

    stdlib_corpus(DataConfig().cache_dir)  # made here, once, so the two ranks only read it
    from trainer3d.rank.master_port import local_port
    port = local_port()  # outside the ephemeral range: no connection takes it before torchrun binds it
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={DP}", f"--master_port={port}",
           __file__, "--deepspeed-rank", f"--steps={steps}", f"--warmup={warmup}", f"--threads={threads}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


# ---------------------------------------------------------------------------- one block each

def block_thread_ms(rounds: int, reps: int = 50) -> dict:
    """One thread's CPU time (``time.thread_time``: what other processes take from the core
    does not count) for the forward and backward of one block of each model at the bench's
    shape, best of ``rounds`` x ``reps``, the two measured in alternating rounds (this thread's
    intra-op thread count is put back after)."""
    import torch

    import trainer3d.cpu  # noqa: F401 - the CPU kernels of the model's operators, as a CPU rank has them
    from trainer3d.config.schema import ModelConfig
    from trainer3d.model.transformer import Block

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # the bench's seed; its caller's generator is left as it was
            torch.manual_seed(0)
            cfg = ModelConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=HEADS, ffn_dim=SWIGLU,
                              vocab_size=VOCAB, max_seq_len=SEQ)
            # The gradient from above as a block meets it in a model (dense, not ``sum()``'s expanded one).
            blocks = {"trainer3d": (Block(cfg), torch.randn(SEQ, MICRO, DIM, requires_grad=True),  # sequence-first
                                    torch.randn(SEQ, MICRO, DIM)),
                      "gpt2": (gpt2_model().h[0], torch.randn(MICRO, SEQ, DIM, requires_grad=True),
                               torch.randn(MICRO, SEQ, DIM))}
        best = {name: float("inf") for name in blocks}
        for _ in range(rounds):
            for name, (block, x, grad) in blocks.items():
                for _ in range(reps):
                    started = time.thread_time()
                    block(x).backward(grad)
                    best[name] = min(best[name], time.thread_time() - started)
    finally:
        torch.set_num_threads(threads)
    return {name: seconds * 1e3 for name, seconds in best.items()}


# ---------------------------------------------------------------------------- the pairs

def flops_line() -> str:
    from torch import nn

    from trainer3d.config.schema import ModelConfig
    from trainer3d.model.transformer import Transformer

    llama = Transformer(ModelConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=HEADS, ffn_dim=SWIGLU,
                                    vocab_size=VOCAB, max_seq_len=SEQ))
    ours = matmul_weights_per_token(m for m in llama.modules() if isinstance(m, nn.Linear))
    gpt = matmul_weights_per_token(m for m in gpt2_model().modules() if isinstance(m, nn.Linear))
    if ours != gpt:
        raise RuntimeError(f"the models are not FLOP-matched: {ours} and {gpt} weights multiply each token")
    return f"both models multiply {ours:,} weights per token (Llama SwiGLU {SWIGLU}, GPT-2 MLP {GPT_MLP})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the rate (a multiple of 10)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // DP),
                        help="intra-op threads of each DeepSpeed rank (trainer3d's launcher: cores / ranks)")
    parser.add_argument("--only", choices=("trainer3d", "deepspeed"), help="run one side (no ratio)")
    parser.add_argument("--against", metavar="REV",
                        help="also run trainer3d as it is at git revision REV (its trainer3d/ and conf/) in each pair")
    parser.add_argument("--blocks", type=int, metavar="ROUNDS",
                        help="instead: one thread's best CPU time per block forward+backward, each model's")
    parser.add_argument("--reps", type=int, default=50, help="--blocks: calls per round of each block")
    parser.add_argument("--deepspeed-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.deepspeed_rank:
        deepspeed_rank(args)
        return 0
    if args.blocks:
        ms = block_thread_ms(args.blocks, args.reps)
        print(f"one block's forward+backward, one thread, best thread time of {args.blocks} x {args.reps}: trainer3d Llama "
              f"{ms['trainer3d']:.3f} ms, GPT-2 {ms['gpt2']:.3f} ms, ratio {ms['trainer3d'] / ms['gpt2']:.3f} "
              f"(load average {os.getloadavg()[0]:.1f})")
        return 0
    print(f"dp={DP} ZeRO-1 fp32, dim {DIM} x {LAYERS} blocks, micro-batch {MICRO} x {SEQ}, {args.steps} steps "
          f"({args.warmup} warm-up); load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.only != "trainer3d":
        print(flops_line(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"trainer3d": lambda: run_trainer3d(args.steps, args.warmup),
                 "deepspeed": lambda: run_deepspeed(args.steps, args.warmup, args.threads)}
        if args.only:
            sides = {args.only: sides[args.only]}
        if args.against:
            old = extract_revision(args.against, Path(tmp))
            sides[args.against] = lambda: run_trainer3d(args.steps, args.warmup, old)
        ratios = {name: [] for name in sides if name != "deepspeed"}
        for pair in range(args.pairs):
            order = list(sides) if pair % 2 == 0 else list(reversed(sides))
            got = {name: sides[name]() for name in order}
            cells = "  ".join(f"{name} {r['tokens_per_s']:,.0f} tok/s (loss {r['loss']:.3f})" for name, r in got.items())
            for name in ratios if "deepspeed" in got else ():
                ratios[name].append(got[name]["tokens_per_s"] / got["deepspeed"]["tokens_per_s"])
                cells += f"  {name} / deepspeed {ratios[name][-1]:.3f}"
            print(f"pair {pair + 1}: {cells}  (load {os.getloadavg()[0]:.1f})", flush=True)
    for name in [n for n in ratios if n != "trainer3d" and ratios[n]]:
        print(f"{name} / deepspeed tokens/s, median of {len(ratios[name])} pairs: {statistics.median(ratios[name]):.3f}")
    if ratios.get("trainer3d"):
        print(f"trainer3d / deepspeed tokens/s, median of {len(ratios['trainer3d'])} pairs: "
              f"{statistics.median(ratios['trainer3d']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
