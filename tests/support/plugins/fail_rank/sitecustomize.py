"""Make one rank fail right after it joins the process group, for the failing-rank tests.

A test puts this directory on PYTHONPATH, so every Python process of that run (the submitting
process and each rank, locally or under Slurm) imports this module at start-up (``site``
imports ``sitecustomize``). With ``TRAINER3D_TEST_FAIL_RANK=<rank>`` set, global rank
``<rank>`` raises ``RuntimeError("planted failure on rank <rank>")`` as soon as
``torch.distributed.init_process_group`` returns: a fault no check before launch can see.
The engine carries no hook for this; the torch function is wrapped from outside.
"""

import os

_RANK = os.environ.get("TRAINER3D_TEST_FAIL_RANK")

if _RANK:
    import torch.distributed as dist

    _init = dist.init_process_group

    def _init_then_fail(*args, **kwargs):
        result = _init(*args, **kwargs)
        if str(dist.get_rank()) == _RANK:
            raise RuntimeError(f"planted failure on rank {_RANK}")
        return result

    dist.init_process_group = _init_then_fail
