"""What surrounds the loop in the run's schema: ``data.*`` (the tokens it reads),
``launcher.*`` (how its ranks start), ``logger.*`` (where its metrics go) and ``checkpoint.*``
(what it saves). Part of ``trainer3d.config.schema``, which re-exports every class
(trainer3d/config/composed.py registers the whole schema with Hydra); the field docstrings under each field are what ``--help`` prints
(trainer3d/config/help.py).
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional

MISSING = "???"
"""OmegaConf's ``MISSING`` (a value the config must give), spelled out: a rank imports this
module and no OmegaConf (trainer3d/config/composed.py)."""


@dataclass
class BlendSource:
    """One token file of a blend and its share of the training samples."""

    path: str = MISSING
    """Token file (.bin, with its .json header)."""
    weight: float = 1.0
    """Relative share of the samples (weights are normalised by their sum)."""


@dataclass
class DataConfig:
    """Training tokens: the built-in corpus, or token files made by tools/prepare_data.py."""

    name: str = "stdlib"
    """stdlib (this Python's standard-library source, byte-level, no download) | tokens |
    chat_sample (a few dozen built-in conversations with their loss mask, for supervised
    fine-tuning with no download: trainer3d/data/chat_sample.py)."""
    path: Optional[str] = None
    """Token file (.bin, with its .json header) when name=tokens, or a Megatron-LM dataset's
    prefix (PREFIX.bin + PREFIX.idx; set data.eos_id)."""
    blend: List[BlendSource] = field(default_factory=list)
    """Several token files mixed by weight, instead of data.path (name=tokens), e.g.
    '[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]'; they must share a tokenizer."""
    val_fraction: float = 0.0
    """Hold out the last fraction of every training file's tokens for validation (0: none)."""
    val_path: Optional[str] = None
    """A token file to validate on, instead of val_fraction (same tokenizer as the training data)."""
    eos_id: Optional[int] = None
    """The end-of-document id of Megatron-LM datasets (PREFIX.bin + PREFIX.idx, read in place as
    data.path, a blend's path or data.val_path: their files do not record it), put between their
    documents as token files have it; unused for token files, which record their own."""
    loss_mask: bool = False
    """Train only on the tokens each token file's loss mask keeps (<name>.mask beside it, written by
    trainer3d-prepare-data --chat: the assistant's tokens); the loss is their mean over the whole
    global batch, the same in every layout (docs/data.md)."""
    cache_dir: str = "~/.cache/trainer3d"
    """Where the built-in corpus is tokenised once and kept, with the record of verified token files."""
    document_mask: bool = False
    """Each token attends only to the earlier tokens of its own document, and rotary positions
    restart at each document (and at each window's start): boundaries from the token file's
    document index (<name>.docs, written by trainer3d-prepare-data), a Megatron dataset's .idx,
    or, for a token file without an index, its end-of-document id (docs/data.md). With
    parallel.cp > 1 each cp rank masks its blocks by the documents' ids (docs/context_parallel.md)."""


@dataclass
class LauncherConfig:
    """How ranks are started: local processes or a Slurm job, both through submitit."""

    name: str = "local"
    """local (one process per rank on this machine) | slurm | inplace (already inside srun/torchrun)."""
    folder: str = "${hydra:runtime.output_dir}/submitit"
    """submitit's folder: pickled job, per-rank logs."""
    timeout_min: int = 60
    wait: bool = True
    """Follow the job's progress and exit with its status (slurm: false = submit and return)."""
    nodes: int = 1
    tasks_per_node: Optional[int] = None
    """Ranks per node; default: world size / nodes."""
    gpus_per_node: int = 0
    """GPUs per node; > 0 means the ranks run on CUDA, one per GPU (the Slurm request asks for them
    and tasks_per_node must equal it)."""
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[float] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    job_name: str = "trainer3d"
    sbatch_extra: List[str] = field(default_factory=list)
    """Extra '#SBATCH' options, e.g. ['--exclusive', '--reservation=foo']."""
    setup: List[str] = field(default_factory=list)
    """Shell lines run in the job before the ranks start (module load, conda activate)."""
    signal_delay_s: int = 90
    """Slurm sends USR2 this long before the time limit: ranks checkpoint and the job requeues."""
    max_requeues: int = 3
    """Cap on requeues after preemption or time limit."""
    check_memory: bool = True
    """Refuse (local launcher) a run whose estimated peak (the dry run's accounting) exceeds each
    GPU's memory, or for CPU ranks this host's; false launches anyway (trainer3d/preflight/memory_check.py)."""


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl and the console."""

    name: str = "console"
    """console | wandb | tensorboard (event files in <run_dir>/tensorboard: ``tensorboard --logdir outputs``)."""
    mode: str = "auto"
    """wandb mode: auto ($WANDB_MODE if set, else online when $WANDB_API_KEY is set, else offline)
    | offline (no key needed; `wandb sync` later) | online | disabled."""
    project: str = "trainer3d"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    run_name: Optional[str] = None


@dataclass
class CheckpointConfig:
    every: Any = 0
    """Save every this many steps (0: only at the end and on preemption), or ``auto``: the interval
    that loses the least expected time to saves and interruptions, from the run's measured save
    stall and step time and checkpoint.mtbf_hours (Young/Daly; trainer3d/checkpoint/interval.py)."""
    mtbf_hours: Any = "auto"
    """``every=auto``: the expected time between interruptions of the job (failures, preemptions),
    in hours; ``auto``: estimated from the run dir's history of starts and interruptions, with a
    prior of 24 h (trainer3d/checkpoint/history.py)."""
    keep: int = 2
    """Published checkpoints kept; older ones are deleted."""
    dir: Optional[str] = None
    """Default: <run_dir>/checkpoints."""
    save_final: bool = True
    async_save: bool = True
    """Save every ``every`` steps in the background: the loop stops only to copy this rank's
    state into host memory (pinned on CUDA), then writing, hashing and read-back run while
    training goes on (docs/checkpoints.md). false: the loop waits for the whole save."""
