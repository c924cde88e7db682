"""Which device the ranks run on, decided from the config and checked, never guessed.

One rank per GPU, always (NCCL refuses two ranks on one GPU, and a rank that silently fell
back to the CPU would run a GPU job orders of magnitude slower). The decision:

- ``launcher.gpus_per_node > 0``: CUDA (``train.device=cpu`` with it is refused);
- ``train.device=cuda`` or ``cpu``: as given;
- ``train.device=auto``: a Slurm job without GPUs runs on CPU; a local or in-place run
  uses CUDA where a GPU is visible to it.

Three places check it, each as early as what it needs is known:
``config_problems`` (pure rules, from ``validate``), ``machine_problems`` (the submitting
machine's GPUs, for the local launcher, before any rank starts) and ``rank_device`` (inside
each rank: CUDA visible, and a GPU of its own, ``cuda_index``: all of the node's GPUs visible to
every task, or one bound to each task by Slurm).
"""

import os
import shutil
from typing import TYPE_CHECKING, List, Mapping, Optional

from trainer3d.config.schema import Config

if TYPE_CHECKING:  # imported where it is asked (the GPUs visible, a rank's device): validate imports this module
    import torch


class DeviceError(RuntimeError):
    """A rank cannot run on the device its config asks for."""


def uses_cuda(cfg: Config, cuda_visible: bool) -> bool:
    """Whether the ranks of ``cfg`` run on CUDA, on a machine where ``cuda_visible`` says if a GPU is."""
    if cfg.launcher.gpus_per_node > 0 or cfg.train.device == "cuda" or cfg.parallel.backend == "nccl":
        return True
    if cfg.train.device == "cpu" or cfg.launcher.name == "slurm":
        return False
    return cuda_visible


def config_problems(cfg: Config, world_size: int) -> List[str]:
    """The device rules that need no machine: one line per problem, naming the knob."""
    launcher, t = cfg.launcher, cfg.train
    gpus = launcher.gpus_per_node
    problems = []
    if gpus > 0 and t.device == "cpu":
        problems.append(f"launcher.gpus_per_node={gpus} asks for GPUs but train.device=cpu; "
                        "set train.device=cuda (or auto), or launcher.gpus_per_node=0")
    if launcher.name == "slurm" and gpus > 0:
        tasks = launcher.tasks_per_node or world_size // max(1, launcher.nodes)
        if tasks != gpus:
            problems.append(f"launcher.tasks_per_node={tasks} but launcher.gpus_per_node={gpus}: one rank "
                            f"per GPU; set launcher.tasks_per_node={gpus} (and parallel.dp to match)")
    if launcher.name == "slurm" and t.device == "cuda" and gpus == 0:
        problems.append("train.device=cuda on Slurm needs GPUs in the request: set launcher.gpus_per_node "
                        "to the GPUs per node (= launcher.tasks_per_node)")
    if cfg.parallel.backend == "nccl" and (t.device == "cpu" or (launcher.name == "slurm" and gpus == 0)):
        problems.append("parallel.backend=nccl needs CUDA ranks; set parallel.backend=auto (gloo on CPU) "
                        "or run on GPUs (train.device=cuda, launcher.gpus_per_node)")
    return problems


def cpu_overrides(cfg: Config) -> List[str]:
    """Every override that moves ``cfg`` (a GPU recipe, say) onto this machine's CPU ranks: all of
    them in one refusal, not one refusal per try."""
    p, launcher = cfg.parallel, cfg.launcher
    return [o for o, needed in (("launcher=local", launcher.name == "slurm"),
                                ("launcher.gpus_per_node=0", launcher.gpus_per_node > 0),
                                ("train.device=cpu", cfg.train.device == "cuda"),
                                ("parallel.backend=auto", p.backend == "nccl")) if needed]


def visible_gpus() -> int:
    """torch's count of the GPUs this process sees (CUDA_VISIBLE_DEVICES; none in a CPU build of
    torch), as the ranks it starts here will. The one question of the submitting process's
    device check that imports torch; the other checks and ``validate`` do not."""
    import torch  # here, not at the top: validate imports this module, and a refused config asks no GPU count
    return torch.cuda.device_count()


def _count(device_count: Optional[int]) -> int:
    return visible_gpus() if device_count is None else device_count


def machine_problems(cfg: Config, world_size: int, device_count: Optional[int] = None,
                     slurm_client: Optional[bool] = None) -> List[str]:
    """What this machine cannot give a local run (the launcher starts every rank here), or a
    Slurm run of GPUs where this machine has neither a Slurm client nor a GPU.
    ``slurm_client``: whether sbatch is on PATH (looked up where None); ``device_count``: the
    GPUs visible here, asked (``visible_gpus``) only where the answer decides something: a
    local run whose device is fixed (``train.device=cpu``) or an inplace one asks nothing."""
    if cfg.launcher.name == "slurm":
        has_sbatch = shutil.which("sbatch") is not None if slurm_client is None else slurm_client
        if has_sbatch or not uses_cuda(cfg, False) or _count(device_count) > 0:
            return []  # the job's nodes are Slurm's to check
        return [f"launcher=slurm with launcher.gpus_per_node={cfg.launcher.gpus_per_node}, but this machine has "
                "neither a Slurm client (sbatch) nor a CUDA device; to run on its CPU ranks add "
                f"{' '.join(cpu_overrides(cfg))}"]
    if cfg.launcher.name != "local" or not uses_cuda(cfg, True):  # CPU ranks whatever is visible
        return []
    count = _count(device_count)
    if not uses_cuda(cfg, count > 0):
        return []
    if count == 0:
        knob = (f"launcher.gpus_per_node={cfg.launcher.gpus_per_node}" if cfg.launcher.gpus_per_node
                else "train.device=cuda" if cfg.train.device == "cuda" else "parallel.backend=nccl")
        return [f"{knob} but no CUDA device is visible here (torch.cuda.device_count() = 0); to run on "
                f"this machine's CPU ranks add {' '.join(cpu_overrides(cfg))}, or run where GPUs are"]
    if world_size > count:
        p = cfg.parallel
        return [f"tp({p.tp}) * pp({p.pp}) * dp({p.dp}) = {world_size} ranks on this machine, but {count} "
                f"GPU(s) are visible: one rank per GPU; lower parallel.dp (or tp, pp) to fit, or set "
                "train.device=cpu"]
    return []


def rank_device(cfg: Config) -> "torch.device":
    """This rank's device; raises DeviceError where a CUDA rank cannot have its own GPU.
    Inside a rank (trainer3d/rank/body.py), where torch is imported already."""
    import torch  # a rank's question, torch imported already: validate imports this module too

    if not uses_cuda(cfg, torch.cuda.is_available()):
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceError(f"rank {os.environ.get('RANK', '0')} was asked to run on CUDA (train.device="
                          f"{cfg.train.device}, launcher.gpus_per_node={cfg.launcher.gpus_per_node}) but sees "
                          f"no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                          "request GPUs for the job or set train.device=cpu")
    return torch.device("cuda", cuda_index(count, os.environ))


def cuda_index(visible: int, env: Mapping[str, str]) -> int:
    """The index of this rank's GPU among the ``visible`` ones, from the launcher's environment
    ``env`` (LOCAL_RANK, LOCAL_WORLD_SIZE, and Slurm's variables); raises DeviceError otherwise.

    Two ways of giving a node's ranks their GPUs are in use, and both are right:
    - every task sees all of the node's GPUs (``--gpus-per-node``, torchrun, the local launcher):
      ``visible >= LOCAL_WORLD_SIZE``, and local rank r takes ``cuda:r``;
    - Slurm binds one GPU to each task (``--gpus-per-task=1``, ``--gpu-bind=single:1`` or
      ``map_gpu``, ``SBATCH_GPU_BIND``; with cgroup device constraints, every task's only GPU
      is its ``cuda:0``): ``visible == 1`` while the node holds at least one GPU per local
      rank (``SLURM_GPUS_ON_NODE``) or the step asked for one per task
      (``SLURM_GPUS_PER_TASK=1``), and every rank takes ``cuda:0``.
    Anything else would put two ranks on one GPU (NCCL refuses) or leave a rank without one."""
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if visible >= local_world and local_rank < visible:
        return local_rank
    node_gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    one_per_task = (env.get("SLURM_GPUS_PER_TASK", "").strip() == "1"
                    or (node_gpus.isdigit() and int(node_gpus) >= local_world))
    if visible == 1 and one_per_task:
        return 0
    raise DeviceError(
        f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world} but this task sees {visible} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}, SLURM_GPUS_ON_NODE="
        f"{node_gpus or 'unset'}): one rank per GPU, and each task must see either all of the node's GPUs "
        "or exactly one of its own; set launcher.tasks_per_node to the GPUs per node (launcher.gpus_per_node), "
        "or bind one GPU per task (srun --gpus-per-task=1)")


PINNED_ROUNDING_MB = 64
"""Pinned host allocations above this size are made at the size asked for (``exact_pinned_sizes``)."""


def exact_pinned_sizes() -> bool:
    """Make pinned host buffers above ``PINNED_ROUNDING_MB`` take the bytes they ask for; True
    where this process's setting was changed.

    torch's caching host allocator rounds every pinned allocation up to a power of two ("to
    improve reuse", aten/src/ATen/core/CachingHostAllocator.h) unless the allocator setting
    ``pinned_max_round_threshold_mb`` bounds it. The large pinned buffers of a run are made once
    and kept: the offloaded optimizer state (trainer3d/parallel/zero/offload.py, FSDP2's
    CPUOffloadPolicy) and a checkpoint's staging buffers (trainer3d/checkpoint/staging.py).
    Rounded, a 17 GiB state would pin 32 GiB, past what the memory check and the planner count
    as host memory. A threshold given in ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``
    is the user's and stays, and the user's other settings are given again with it (the
    setter parses a whole setting string); a torch without the setter or the key (2.11 refuses
    it: found on the first GPU run, docs/gpu.md) keeps its rounding."""
    import torch  # a rank's setting, torch imported already: validate imports this module too

    given = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if "pinned_max_round_threshold_mb" in given or setter is None:
        return False
    try:
        setter(",".join(filter(None, [given, f"pinned_max_round_threshold_mb:{PINNED_ROUNDING_MB}"])))
    except ValueError as e:  # torch 2.11 has the setter but not this key: "Unrecognized key ..."
        if "pinned_max_round_threshold_mb" not in str(e):
            raise
        return False
    return True
