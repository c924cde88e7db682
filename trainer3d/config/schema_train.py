"""The loop's section of the run's schema: ``train.*`` (batch, steps, precision, evaluation,
profiling, and its loss-spike watch, straggler watch and drills) and ``optim.*`` (AdamW, Muon,
the learning-rate schedule). Part of ``trainer3d.config.schema``, which re-exports every class
and registers the whole schema with Hydra; the field docstrings under each field are what
``--help`` prints (trainer3d/config/help.py).
"""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class SpikeConfig:
    """Loss spikes: each step's loss and gradient norm, agreed over the ranks, against the
    median and the median absolute deviation (MAD) of the last ``window`` steps
    (trainer3d/observe/spikes.py; docs/failures.md)."""

    policy: str = "off"
    """skip (the step's update is not applied; its data is consumed and the schedule advances)
    | rollback (restore the newest checkpoint at or before the first of the ``skip_window``
    steps ending at the spike, and skip those steps) | warn (print, train on) | off (no check).
    Every policy but off reads the step's loss on the host before its update (one sync per
    step), which the loop otherwise never does: off by default, skip for a long run."""
    window: int = 100
    """Steps of history the median and MAD are taken over."""
    threshold: float = 6.0
    """A step spikes when its loss (or gradient norm) is above the window's median by more than
    this many robust standard deviations (1.4826 x MAD)."""
    min_steps: int = 100
    """Steps observed before the check arms (early training's fast fall is no baseline)."""
    skip_window: int = 10
    """rollback: the steps skipped, ending at the spike (PaLM skipped 200-500 batches around one)."""


@dataclass
class InjectConfig:
    """Drills: faults put in on purpose, to see the run's handling act."""

    corrupt_steps: List[int] = field(default_factory=list)
    """Steps whose batches are replaced by uniformly random token ids on every rank."""
    slow_rank: Optional[int] = None
    """The global rank whose every step is made ``slow_ms`` slower (null: none), to see the
    straggler watch name it."""
    slow_ms: float = 0.0
    """``slow_rank``'s delay per step, in milliseconds: a sleep at the end of its backward, before
    the gradient reduction waits on its peers."""


@dataclass
class StragglerConfig:
    """Stragglers: each rank's compute time per step against its peers' (the ranks of the same
    pipeline stage), read at the logging interval (trainer3d/observe/stragglers.py;
    docs/failures.md)."""

    window: int = 20
    """A rank is named when the median, over its last ``window`` steps, of its compute over its
    peers' median compute has been at or above ``threshold`` for ``persist`` steps in a row;
    0: no watch."""
    threshold: float = 1.5
    """The ratio to the peers' median compute (the median over the window) that names a rank.
    Where compute times are steady (CUDA events on dedicated GPUs) a lower value, e.g. 1.2,
    names milder stragglers; docs/failures.md gives the soak that set this default."""
    persist: int = 10
    """Steps in a row the window's median must stay at or above ``threshold``."""


@dataclass
class TrainConfig:
    """The optimisation loop. Give any two of micro_batch_size, grad_accum_steps and
    global_batch_size; the third is derived as global = micro * grad_accum * dp."""

    micro_batch_size: Optional[int] = 8
    """Sequences per micro-batch on one data-parallel rank."""
    grad_accum_steps: Optional[int] = None
    """Micro-batches per optimizer step on one data-parallel rank (the pipeline's micro-batches)."""
    global_batch_size: Optional[int] = 32
    """Sequences per optimizer step over all data-parallel ranks."""
    seq_len: int = 128
    max_steps: int = 300
    seed: int = 1234
    log_every: int = 10
    """Read metrics from the device, print and write them every this many steps."""
    dtype: str = "fp32"
    """Parameter/activation dtype: fp32 | bf16 | fp16 (master weights stay fp32)."""
    loss_scale_init: float = 65536.0
    """fp16 only: the dynamic loss scale's first value (halved on each step with inf/nan gradients,
    which is skipped; doubled after 2000 clean steps)."""
    on_nonfinite: str = "stop"
    """What an inf/nan loss or gradient norm does (read at the logging interval and before each
    checkpoint): stop (end the run with an error, saving nothing) | continue (train on)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them."""
    resume: str = "auto"
    """auto (newest complete checkpoint of the run, if any) | never | a checkpoint path."""
    allow_data_change: bool = False
    """Resume a checkpoint on data other than what it recorded (another token file, tokenizer or
    Megatron dataset under the data.* knobs): refused unless true (docs/checkpoints.md)."""
    device: str = "auto"
    """auto | cpu | cuda. auto is cuda when launcher.gpus_per_node > 0, cpu for a Slurm job
    without GPUs, else cuda where a GPU is visible (checked before launch); one rank per GPU."""
    compile: bool = False
    """torch.compile each transformer block (after tensor parallelism, before pipeline staging);
    under parallel.pp_schedule=zb1p, zbv or dualpipev the model's elementwise operators instead
    (trainer3d/parallel/compile.py)."""
    compile_backend: str = "inductor"
    """torch.compile's backend under ``train.compile``, as torchtitan's ``compile.backend``:
    inductor (generated kernels) or aot_eager (dynamo's graph and AOTAutograd's forward and
    backward, split by inductor's min-cut partitioner, their operators run eagerly: no code
    generated or built). aot_eager tells a fault of the trace from one of inductor's code, and checks what
    compile does to the training (graph breaks, hooks, recomputation) without inductor's
    lowering and C++ builds (trainer3d/parallel/compile.py)."""
    loss_chunk_tokens: int = 256
    """The last stage applies the head inside the loss, this many tokens at a time, so no more
    than this many rows of logits exist at once (parallel/tensor/loss.py; docs/memory.md);
    0: the model returns the whole logits and the loss reads them."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s per rank for MFU; default from the device name where known."""
    eval_every: int = 100
    """Evaluate on the validation set (data.val_fraction or data.val_path) every this many steps; 0: never."""
    eval_steps: Optional[int] = 10
    """Global batches of validation windows per evaluation, the same ones each time, at most: a split
    holding fewer windows evaluates on all it has, the last batch partial (trainer3d/observe/evaluate.py);
    null: the whole set."""
    profile: List[int] = field(default_factory=list)
    """A window of steps to trace, ``[first, end]`` (steps first..end-1, e.g. [10, 13]; []: off):
    every rank writes a torch.profiler trace, ``<run_dir>/profile/trace_rank<r>.json`` (Chrome
    trace JSON for ui.perfetto.dev or TensorBoard), and on CUDA a memory snapshot,
    ``memory_rank<r>.pickle``, for pytorch.org/memory_viz (trainer3d/observe/profile.py)."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    skip_steps: List[int] = field(default_factory=list)
    """Steps trained without an update and without reading their batch, besides those in the run
    dir's skipped_steps.json: a fresh run given another run's ``steps`` replays its decisions."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)


@dataclass
class MuonConfig:
    """Muon's group under ``optim.name=muon`` (docs/optimizers.md): the 2-D weights inside the
    blocks. Fields are named as ``torch.optim.Muon`` names its arguments."""

    lr: float = 0.02
    """Peak learning rate of the Muon group; it follows optim's warm-up and decay, scaled by
    lr / optim.lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the Muon group (multiplied by its unadjusted learning rate)."""
    momentum: float = 0.95
    """Decay of the momentum buffer."""
    nesterov: bool = True
    """Orthogonalise the Nesterov look-ahead (gradient lerped toward the buffer) instead of the buffer."""
    ns_steps: int = 5
    """Newton-Schulz iterations per matrix (each three matmuls)."""
    adjust_lr: str = "original"
    """original: lr * sqrt(max(1, rows / cols)) (Keller Jordan's) | match_rms_adamw: lr * 0.2 *
    sqrt(max(rows, cols)) (Moonshot's, arXiv 2502.16982), torch's ``adjust_lr_fn``."""
    eps: float = 1e-7
    """Floor of the Frobenius norm the matrix is divided by before Newton-Schulz."""
    ns_dtype: str = "bf16"
    """bf16 (torch's and Keller Jordan's) | fp32: the dtype Newton-Schulz iterates in. bf16
    rounding turns a gradient's last-bit difference (another layout's order of sums) into a
    bf16-ulp difference of the whole update, so layouts agree to ~1e-3, not 1e-5; fp32 keeps
    them at the parity tolerance (docs/optimizers.md)."""
    layer_wise: bool = True
    """ZeRO-1 with dp > 1: each matrix orthogonalised by one owner rank of the dp group (balanced
    by Newton-Schulz FLOPs) and its result broadcast back, Megatron-Core's layer-wise layout;
    false: every dp rank orthogonalises every matrix of its stage. The same update either way."""


@dataclass
class OptimConfig:
    """AdamW (``name=adamw``), or Muon for the blocks' matrices and AdamW for the rest
    (``name=muon``), with linear warm-up and cosine decay to min_lr."""

    name: str = "adamw"
    """adamw | muon: the conf/optim member this came from."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 3e-4
    """Where the cosine decay ends."""
    warmup_steps: int = 20
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    decay_steps: Optional[int] = None
    """Steps of the cosine decay after warm-up; default: the rest of train.max_steps."""
    weight_decay: float = 0.1
    """Applied to matrices and embeddings, not to norm weights."""
    beta1: float = 0.9
    """AdamW's decay of the first moment."""
    beta2: float = 0.95
    """AdamW's decay of the second moment."""
    eps: float = 1e-8
    """Added to the square root of the second moment."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's group; read only when name=muon."""
