"""The oldest torch trainer3d runs on, checked when the package is imported.

2.9 is the first release whose ``init_device_mesh`` takes ``backend_override`` (pytorch PR
#159371), through which each mesh dimension gets its own timeout (trainer3d/topology.py).
The rest is older: ``torch.distributed.pipelining`` (2.4), ``fully_shard`` under
``torch.distributed.fsdp`` (2.6), SDPA's ``enable_gqa`` (2.5). pyproject.toml's
``torch>=`` must say the same (tests/test_requirements.py).
"""

from typing import Tuple

TORCH_FLOOR = "2.9"


def _release(version: str) -> Tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu' or '2.10.0a0+git1234'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(version: str) -> None:
    """Raise ImportError naming the fix if ``version`` is older than ``TORCH_FLOOR``."""
    if _release(version) < _release(TORCH_FLOOR):
        raise ImportError(f"trainer3d needs torch>={TORCH_FLOOR}, this Python has torch {version}; "
                          f"upgrade it: pip install 'torch>={TORCH_FLOOR}'")
