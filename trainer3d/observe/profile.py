"""A window of steps traced for the user's own tools (``train.profile=[first, end]``).

Every rank records steps ``first .. end-1`` with ``torch.profiler`` and writes
``<run_dir>/profile/trace_rank<r>.json``: the Chrome trace format (a JSON object whose
``traceEvents`` hold each operator, kernel and communication call, inside one span per
step named ``trainer3d step <n>``), which Perfetto
(ui.perfetto.dev), ``chrome://tracing`` and TensorBoard's profile plugin open. On CUDA the
same window also records the caching allocator's history
(``torch.cuda.memory._record_memory_history``) and writes
``<run_dir>/profile/memory_rank<r>.pickle`` (``_dump_snapshot``), which PyTorch's memory
viewer (pytorch.org/memory_viz) draws: every allocation with its stack, over time.
torchtitan offers the same pair (its ``profiling.enable_profiling`` and
``enable_memory_snapshot``). Outside the window nothing is recorded and nothing costs.
"""

from pathlib import Path
from typing import List, Optional

import torch


class StepProfiler:
    """``before(step)`` and ``after(step)`` around every step; ``close()`` when the loop ends."""

    def __init__(self, window: List[int], run_dir: str, rank: int, device: torch.device):
        self.first, self.end = (window[0], window[1]) if window else (None, None)
        self.dir = Path(run_dir) / "profile"
        self.rank, self.cuda = rank, device.type == "cuda"
        self._prof: Optional[torch.profiler.profile] = None
        self._span = None

    @property
    def trace_path(self) -> Path:
        return self.dir / f"trace_rank{self.rank}.json"

    @property
    def memory_path(self) -> Path:
        return self.dir / f"memory_rank{self.rank}.pickle"

    def before(self, step: int) -> None:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
        if self._prof is not None:  # each step a named span in the trace
            self._span = torch.profiler.record_function(f"trainer3d step {step}")
            self._span.__enter__()

    def after(self, step: int) -> None:
        if self._prof is None:
            return
        self._span.__exit__(None, None, None)
        if step + 1 >= self.end:
            self.close()

    def close(self) -> None:
        """Write what the window recorded (also for a run stopped inside it)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        written = [self.trace_path]
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.memory_path))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(self.memory_path)
        if self.rank == 0:
            print(f"trainer3d: profiled steps {self.first}..{self.end - 1}: {', '.join(map(str, written))} "
                  "(open the trace in ui.perfetto.dev, the memory snapshot in pytorch.org/memory_viz)", flush=True)
