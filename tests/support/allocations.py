"""Peak bytes of the tensors a region of code allocates, seen op by op (tests' meter for a
transient such as Muon's step buffers, trainer3d/memory/muon_step.py).

Every aten op's outputs pass through a ``TorchDispatchMode``
(torch/utils/_python_dispatch.py); an output whose storage is none of the op's inputs' is a
new allocation, counted at its storage's size while any tensor on that storage (the output,
or a view of it made later) lives. What existed before the region (parameters, the flat
buffers and their views) is never counted, nor what a kernel allocates inside itself.

    with AllocationMeter() as meter:
        opt.step(lr)
    meter.peak_bytes
"""

import weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer3d.memory.meter import LiveStorages


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class AllocationMeter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.storages = LiveStorages()  # what the region allocated, by storage

    @property
    def live_bytes(self) -> int:
        return self.storages.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.storages.peak_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key not in self.storages and (key in inputs or key == 0):
                continue  # a view of, or an in-place op on, something from before the region
            self.storages.hold(key, t.untyped_storage().nbytes())
            weakref.finalize(t, self.storages.release, key)
        return out
