"""Make one rank stall in the middle of a checkpoint save, for the kill-mid-save test.

tests/integration/test_checkpoint_resume.py puts this directory on PYTHONPATH, so every Python process of
that run (the launcher and each rank) imports this module at start-up (``site`` imports
``sitecustomize``). With ``TRAINER3D_TEST_STALL_SAVE=<rank>:<step>`` set, global rank
``<rank>`` stops right after its DCP files of step ``<step>``'s save are written and before
the barrier that leads to publication; it writes its pid into
``<checkpoints>/stalled-rank<rank>`` so the test can kill it there. The engine carries no
hook for this: ``torch.distributed.checkpoint.save`` is wrapped from outside.
"""

import os

_SPEC = os.environ.get("TRAINER3D_TEST_STALL_SAVE")  # "<rank>:<step>"

if _SPEC:
    import time
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _save = dcp.save

    def _save_then_stall(state_dict, *args, **kwargs):
        result = _save(state_dict, *args, **kwargs)
        # <checkpoints>/step_<8 digits>.partial, named directly or by the storage writer
        partial = Path(kwargs.get("checkpoint_id") or kwargs["storage_writer"].path)
        rank = dist.get_rank()
        if _SPEC == f"{rank}:{int(partial.name[5:13])}":
            (partial.parent / f"stalled-rank{rank}").write_text(str(os.getpid()))
            time.sleep(3600)
        return result

    dcp.save = _save_then_stall
