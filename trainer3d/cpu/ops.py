"""The CPU implementation of the model's operators (``torch.ops.trainer3d``, defined in
model/functional.py by their torch composition): the fused kernels of kernels.py where they
take the input (plain contiguous fp32 tensors, the kernels on and built), else that same
composition. Registered for the ``CPU`` dispatch key when this package is imported; every
other device keeps the composition.
"""

import torch

from trainer3d.cpu import kernels
from trainer3d.model.functional import COMPOSITIONS


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    if weight.shape == x.shape[-1:] and kernels.usable(x, weight):
        return kernels.rms_norm_forward(x, weight, eps)
    return COMPOSITIONS["rms_norm_forward"](x, weight, eps)


def _rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                       need_x: bool, need_weight: bool):
    if weight.shape == x.shape[-1:] and grad_y.shape == x.shape and kernels.usable(grad_y, x, weight, rstd):
        return kernels.rms_norm_backward(grad_y, x, weight, rstd, need_x, need_weight)
    return COMPOSITIONS["rms_norm_backward"](grad_y, x, weight, rstd, need_x, need_weight)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    if kernels.rotary_usable(x, cos, sin):
        return kernels.rotary(x, cos, sin, sign)
    return COMPOSITIONS["rotary"](x, cos, sin, sign)


def _swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape == b.shape and kernels.usable(a, b):
        return kernels.swiglu_forward(a, b)
    return COMPOSITIONS["swiglu_forward"](a, b)


def _swiglu_backward(grad_prod: torch.Tensor, a: torch.Tensor, b: torch.Tensor, need_prod: bool, need_inputs: bool):
    if a.shape == b.shape == grad_prod.shape and kernels.usable(grad_prod, a, b):
        return kernels.swiglu_backward(grad_prod, a, b, need_prod, need_inputs)
    return COMPOSITIONS["swiglu_backward"](grad_prod, a, b, need_prod, need_inputs)


LIBRARY = torch.library.Library("trainer3d", "IMPL")
for _name, _impl in {"rms_norm_forward": _rms_norm_forward, "rms_norm_backward": _rms_norm_backward,
                     "rotary": _rotary, "swiglu_forward": _swiglu_forward,
                     "swiglu_backward": _swiglu_backward}.items():
    LIBRARY.impl(_name, _impl, "CPU")
