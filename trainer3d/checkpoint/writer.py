"""DCP's file writer, with checksums and a full disk reported as such (trainer3d/job/failure.py).

Each data file is hashed on its way to disk and read back once closed
(trainer3d/checkpoint/digest.py); ``digests`` then holds this rank's files, which the
checkpointer gathers into the marker. A file whose bytes on disk are not those written
fails the save, so every published checkpoint was read back intact once.

torch.distributed.checkpoint gathers each rank's write error into a CheckpointException;
torch's zip writer reports a short write as ``unexpected pos`` without the errno, so the
rank whose write failed checks its file system then, while the partial files still fill it.
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Dict

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from trainer3d.checkpoint.digest import HashingStream, file_digest
from trainer3d.job.failure import naming_a_full_disk


class _HashingFileSystem(FileSystem):
    def __init__(self):
        self.written: Dict[str, HashingStream] = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingStream(stream)
            self.written[Path(path).name] = hashing
            yield hashing


class CheckpointWriter(FileSystemWriter):
    def __init__(self, path: str):
        super().__init__(path)
        self.fs = _HashingFileSystem()
        self.digests: Dict[str, dict] = {}

    def write_data(self, plan, planner):
        with naming_a_full_disk(str(self.path)):
            future = super().write_data(plan, planner)
        for result in future.value():
            name = result.storage_data.relative_path
            if name not in self.digests:
                self.digests[name] = self._read_back(name)
        return future

    def _read_back(self, name: str) -> dict:
        on_disk = file_digest(Path(self.path) / name)
        written = self.fs.written[name]
        if written.digest is not None and (written.digest, written.bytes) != (on_disk["sha256"], on_disk["bytes"]):
            raise OSError(f"checkpoint file {Path(self.path) / name} read back differs from what was written "
                          f"({on_disk['bytes']} of {written.bytes} bytes; the file system lost or changed data)")
        return on_disk

    def finish(self, metadata, results) -> None:
        with naming_a_full_disk(str(self.path)):
            super().finish(metadata, results)
