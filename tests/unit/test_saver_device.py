"""The background checkpoint thread makes the rank's device its current one before DCP runs
in it (trainer3d/checkpoint/saver.py, ``Background``). CUDA's current device belongs to the
thread and a new thread starts on device 0, where DCP's file writer then takes its stream
(torch/distributed/checkpoint/filesystem.py, ``_OverlappingCpuLoader``): a context on GPU 0
for every rank. Without a GPU here, ``torch.cuda.set_device`` is replaced by a recorder — the
one part that cannot run on CPU; the thread, DCP's save and the publication are the real
ones. tests/gpu/test_resume_gpu.py checks the contexts themselves on two GPUs.
"""

import threading

import torch

from trainer3d.checkpoint import store
from trainer3d.checkpoint.saver import Background, SaveGroups, SaveJob, SaveReport


def _save_in_background(tmp_path, device: torch.device, monkeypatch) -> list:
    """One real background save of a tiny state on ``device``'s rank; what ``set_device`` was
    called with: (thread name, device, whether DCP had written any data file yet)."""
    partial = store.partial_dir(tmp_path, 3)
    calls = []

    def record(dev) -> None:
        calls.append((threading.current_thread().name, torch.device(dev), any(partial.glob("*.distcp"))))

    monkeypatch.setattr(torch.cuda, "set_device", record)
    background = Background(SaveGroups(None, None), 0, lambda text: None, device)
    job = SaveJob(3, {"w": torch.arange(12.0).view(3, 4)}, tmp_path, {"step": 3}, keep=2, known_bad=[])
    background.start(job, SaveReport(3, job.final, stall_s=0.0))
    report = background.wait("the test", timeout_s=120)
    assert report.path == job.final and (job.final / ".metadata").is_file()
    return calls


def test_the_save_thread_sets_the_rank_cuda_device_before_dcp_writes(tmp_path, monkeypatch):
    """Rank on cuda:1: the save's own thread sets cuda:1, once, before any data file exists."""
    calls = _save_in_background(tmp_path, torch.device("cuda", 1), monkeypatch)
    assert calls == [("trainer3d-checkpoint-3", torch.device("cuda", 1), False)]


def test_a_cpu_rank_sets_no_cuda_device(tmp_path, monkeypatch):
    assert _save_in_background(tmp_path, torch.device("cpu"), monkeypatch) == []


def test_a_cuda_device_without_an_index_is_the_creating_thread_s_current_one(tmp_path, monkeypatch):
    """``torch.device("cuda")`` names no GPU and ``torch.cuda.set_device`` refuses it: the save
    thread takes the device current where the saver was made (here reported as 2)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    calls = _save_in_background(tmp_path, torch.device("cuda"), monkeypatch)
    assert calls == [("trainer3d-checkpoint-3", torch.device("cuda", 2), False)]
