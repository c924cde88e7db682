"""Make one rank stall in the middle of a checkpoint save, for the kill-mid-save tests.

A test puts this directory on PYTHONPATH, so every Python process of that run (the launcher
and each rank) imports this module at start-up (``site`` imports ``sitecustomize``). With
``TRAINER3D_TEST_STALL_SAVE=<rank>:<step>[:write]`` set, global rank ``<rank>`` stops in step
``<step>``'s save: right after its DCP files are written and before the gather that leads to
publication, or, with ``:write``, while its data files are written but not yet read back
(DCP's ``write_data``; the coordinator's ``.metadata`` not written yet). It writes its pid
into ``<checkpoints>/stalled-rank<rank>`` so the test can kill it there. The engine carries
no hook for this: torch.distributed.checkpoint is wrapped from outside.

Only a rank's process wraps it (submitit's task variable, local or Slurm, as
tests/support/background.py tells a rank): the submitting process and submitit's controller
import this module too, and would otherwise each import torch.distributed.checkpoint for nothing
(the controller imports no torch at all).
"""

import os

_SPEC = os.environ.get("TRAINER3D_TEST_STALL_SAVE")  # "<rank>:<step>[:write]"
_A_RANK = os.environ.get("SUBMITIT_LOCAL_GLOBALID") is not None or os.environ.get("SLURM_PROCID") is not None

if _SPEC and _A_RANK:
    import time
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    _rank, _step, _phase = (_SPEC.split(":") + [""])[:3]

    def _stall_if_due(partial: Path, phase: str) -> None:
        """<checkpoints>/step_<8 digits>.partial: stall there when it is the planted rank and step."""
        rank = dist.get_rank()
        if (str(rank), partial.name[5:13], phase) == (_rank, f"{int(_step):08d}", _phase):
            (partial.parent / f"stalled-rank{rank}").write_text(str(os.getpid()))
            time.sleep(3600)

    _save = dcp.save

    def _save_then_stall(state_dict, *args, **kwargs):
        result = _save(state_dict, *args, **kwargs)
        _stall_if_due(Path(kwargs.get("checkpoint_id") or kwargs["storage_writer"].path), "")
        return result

    dcp.save = _save_then_stall
    _write_data = filesystem._FileSystemWriter.write_data

    def _write_data_then_stall(self, plan, planner):
        future = _write_data(self, plan, planner)
        future.wait()  # the data files are written, not yet read back
        _stall_if_due(Path(self.path), "write")
        return future

    filesystem._FileSystemWriter.write_data = _write_data_then_stall
