"""The oldest torch trainer3d runs on, checked when the package is imported (the installed
distribution's version, ``importlib.metadata``: importing torch costs the submitting process,
which imports trainer3d but no torch, seconds of CPU: tests/unit/test_import_cost.py).

The floor is the oldest release the tests were seen to pass on: 2.11 (ZeRO stages 0-3, TP,
pipeline, topology, process-group timeout and floor tests; CI runs 2.13). On 2.9.1 the ZeRO-2 (FSDP2
``fully_shard``) optimizer test's gradient norms leave torch AdamW's from the second step
(by 5%), so 2.9 and older are refused. The APIs used are older than the floor:
``torch.distributed.pipelining`` (2.4), SDPA's ``enable_gqa`` (2.5), ``fully_shard`` under
``torch.distributed.fsdp`` (2.6), ``_set_pg_timeout`` for the per-group timeouts
(trainer3d/parallel/timeouts.py). pyproject.toml's ``torch>=`` must say the same
(tests/unit/test_requirements.py).
"""

from typing import Tuple

TORCH_FLOOR = "2.11"


def _release(version: str) -> Tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu' or '2.10.0a0+git1234'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(version: str) -> None:
    """Raise ImportError naming the fix if ``version`` is older than ``TORCH_FLOOR``."""
    if _release(version) < _release(TORCH_FLOOR):
        raise ImportError(f"trainer3d needs torch>={TORCH_FLOOR}, this Python has torch {version}; "
                          f"upgrade it: pip install 'torch>={TORCH_FLOOR}'")
