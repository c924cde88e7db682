"""trainer3d: train Llama-style language models with 3D parallelism (see README.md)."""

from importlib.metadata import version

from trainer3d.preflight.requirements import check_torch

check_torch(version("torch"))  # the installed distribution's: the submitting process imports no torch
