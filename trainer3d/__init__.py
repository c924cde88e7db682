"""trainer3d: train Llama-style language models with 3D parallelism (see README.md)."""

import torch

from trainer3d.preflight.requirements import check_torch

check_torch(torch.__version__)
