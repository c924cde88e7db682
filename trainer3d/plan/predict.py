"""The planner's step for a run's own layout, which goodput is split by (trainer3d/observe/goodput.py).

The rank's body (trainer3d/rank/body.py) computes it and hands it to the trainer, so the
training loop imports no part of the planner.
"""

import os
from pathlib import Path
from typing import Optional

import torch

from trainer3d.config.schema import Config
from trainer3d.observe.goodput import Prediction
from trainer3d.parallel.topology import ParallelDims
from trainer3d.plan.devices import DEFAULT_CALIBRATION, PRESETS, device_for
from trainer3d.plan.search import evaluate


def device_preset(device: torch.device) -> Optional[str]:
    """The planner's device (trainer3d/plan/devices.py) this rank runs on: a GPU preset by its
    name, on CPUs ``calibrated`` where ``python -m trainer3d.plan --calibrate`` measured the
    machine, else the ``cpu`` placeholder; None for a GPU without a preset."""
    if device.type != "cuda":
        return "calibrated" if Path(os.path.expanduser(DEFAULT_CALIBRATION)).is_file() else "cpu"
    name = torch.cuda.get_device_name(device).upper()
    for marker, preset in (("H100 PCIE", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"),
                           ("A100-SXM4-80GB", "a100-80g"), ("A100 80GB", "a100-80g"), ("A100", "a100-40g")):
        if marker in name:
            return preset
    return None


def predict_step(cfg: Config, dims: ParallelDims) -> Optional[Prediction]:
    """The planner's step for this run's own layout (trainer3d/plan/search.py ``evaluate``;
    every rank computes it, so none waits in the first step for another's), in goodput's
    parts: its pipeline bubble with the stage hand-overs (what a rank waits on its
    neighbours), its exposed data-parallel communication, and the rest as compute."""
    preset = device_preset(dims.device)
    if preset is None:
        return None
    device = device_for(preset)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dims.topo.world_size))
    try:
        plan = evaluate(cfg, device, per_node, "gloo" if dims.device.type == "cpu" else "nccl")
    except (ValueError, NotImplementedError) as err:  # a layout the planner cannot time: train without
        print(f"goodput: no prediction for this layout ({err})", flush=True)
        return None
    step = plan.step
    waiting = step.bubble + step.pp_comm
    source = device.name if preset in PRESETS else f"{device.name} (calibrated)"
    return Prediction(step_s=step.total, compute_s=step.total - waiting - step.dp_comm, bubble_s=waiting,
                      comm_s=step.dp_comm, tokens_per_s=plan.tokens_per_s, device=source)
