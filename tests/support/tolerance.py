"""fp32 comparisons that hold on any CPU.

fp32's rounding scales with the values compared, and the order a kernel sums in depends on the
CPU (AVX2 or AVX-512, MKL's and oneDNN's blocking): a fixed absolute tolerance of 1e-6 is two
ulps of a gradient element of 10, which one machine's order of sums meets and another's misses.
These bounds scale with the reference tensor's largest element instead, with a margin of 10x or
more over what was measured on AVX-512 and AVX2 kernels, while a missing reduction, a wrong
shard or a scale off by 1e-3 is still far outside them.
"""

import torch


def scale_of(want: torch.Tensor) -> float:
    """The reference's largest magnitude (0 for an empty tensor)."""
    return want.detach().abs().max().item() if want.numel() else 0.0


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5, msg=None) -> None:
    """Every element of ``got`` within ``rel`` x the largest magnitude of ``want``."""
    torch.testing.assert_close(got.detach().to(want.dtype), want.detach(), rtol=0, atol=rel * scale_of(want), msg=msg)


def scaled_max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to ``want``'s largest magnitude: the quantity
    ``assert_close_to_scale`` bounds, as a number (for ranks that return it to the test)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if not want.numel():
        return 0.0
    diff = (got.detach().to(want.dtype) - want.detach()).abs().max().item()
    return diff / max(scale_of(want), torch.finfo(torch.float32).tiny)
