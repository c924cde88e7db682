"""Host copies of this rank's checkpointed state, taken while the loop waits, written later.

A save in the background (trainer3d/checkpoint/saver.py) must not read the live tensors:
the next optimizer step changes them while the files are still being written. So the loop
stops only long enough to copy each tensor into a host buffer of its own: page-locked
(pinned) memory on CUDA, where the copies are issued without blocking and waited for once
at the end (a device-to-host copy at PCIe/NVLink-C2C speed), plain memory on CPU (one
memcpy). The buffers are kept and reused by the next save: at most one save is in flight,
and it has finished with them before the next one stages (torchtitan stages into pinned
memory the same way, torchtitan/components/checkpoint.py, ``async_with_pinned_mem``).
"""

from typing import Dict

import torch


class Staging:
    """``stage(key, tensor)`` -> a host copy of ``tensor`` in the buffer kept for ``key``;
    ``done()`` once every tensor of a save was staged (waits for the device's copies)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: Dict[str, torch.Tensor] = {}

    def __call__(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pinned)
            self.buffers[key] = buf
        buf.copy_(tensor.detach(), non_blocking=self.pinned)
        return buf

    def done(self) -> None:
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def bytes(self) -> int:
        """Host memory the buffers hold (the size of this rank's share of a checkpoint)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
