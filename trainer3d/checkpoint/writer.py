"""DCP's file writer, with a full disk reported as such (trainer3d/failure.py).

torch.distributed.checkpoint gathers each rank's write error into a CheckpointException;
torch's zip writer reports a short write as ``unexpected pos`` without the errno, so the
rank whose write failed checks its file system then, while the partial files still fill it.
"""

from torch.distributed.checkpoint import FileSystemWriter

from trainer3d.failure import naming_a_full_disk


class CheckpointWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        with naming_a_full_disk(str(self.path)):
            return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        with naming_a_full_disk(str(self.path)):
            super().finish(metadata, results)
