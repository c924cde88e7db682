"""trainer3d: train Llama-style language models with 3D parallelism (see README.md)."""

from importlib.metadata import PackageNotFoundError, version

from trainer3d.preflight.requirements import check_torch

try:
    _TORCH = version("torch")  # the installed distribution's: the submitting process imports no torch
except PackageNotFoundError:  # a torch without package metadata (a source tree on PYTHONPATH): ask it
    import torch

    _TORCH = torch.__version__
check_torch(_TORCH)
