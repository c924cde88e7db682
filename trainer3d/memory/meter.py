"""Count the activation memory autograd keeps for backward: live bytes now, peak over a step.

1F1B's point is bounded activation memory: a stage holds at most (stages - its index)
micro-batches' saved activations, whatever grad_accum is, where GPipe holds all of them
until its first backward (Narayanan et al. 2021, sec. 2.2; PipeDream-Flush). This meter
makes that measurable on any device: ``torch.autograd.graph.saved_tensors_hooks`` sees
every tensor an op saves for backward; each is counted once per storage while any saved
reference to it lives (autograd drops them when it frees the graph after backward).
Parameters are not activations and are left out.

    meter = SavedActivationMeter(model.parameters())
    with meter:
        loss = model(x).sum(); loss.backward()
    meter.peak_bytes
"""

import weakref
from typing import Dict, Iterable, List

import torch


class _Saved:
    """What autograd keeps instead of the tensor while the meter is on; its death is the release."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class LiveStorages:
    """Storages counted once each while any reference to them lives: ``hold`` one more
    reference (the storage's bytes join the live total on its first), ``release`` one."""

    def __init__(self):
        self._live: Dict[int, List[int]] = {}  # storage address -> [bytes, live references]
        self.live_bytes = 0
        self.peak_bytes = 0

    def __contains__(self, key: int) -> bool:
        return key in self._live

    def hold(self, key: int, nbytes: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[1] += 1

    def release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._live[key]


class SavedActivationMeter:
    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages = LiveStorages()  # what autograd saved, by storage
        self._hooks = None

    @property
    def live_bytes(self) -> int:
        return self.storages.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.storages.peak_bytes

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or tensor.device.type == "meta" or key == 0:
            return tensor
        self.storages.hold(key, storage.nbytes())
        # detached: a saved output (SDPA's out and log-sum-exp) would otherwise hold its own
        # grad_fn, a node -> saved -> tensor -> node cycle that only running the node breaks
        # (torch/autograd/graph.py, ``saved_tensors_hooks``: "the return value of pack_hook
        # cannot hold a reference to the input tensor"); a zero-bubble weight step never runs
        # the nodes between its intermediates, so their graph would outlive the step.
        saved = _Saved(tensor.detach())
        weakref.finalize(saved, self.storages.release, key)
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
