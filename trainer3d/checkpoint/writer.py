"""DCP's file writer, with checksums and a full disk reported as such (trainer3d/observe/failure.py).

Each data file is written past the page cache where the file system allows it
(trainer3d/checkpoint/direct.py), hashed on its way to disk and, once DCP has synced and
closed it, read back from the storage rather than the page cache (trainer3d/checkpoint/digest.py);
``digests`` then holds this rank's files, which the checkpointer gathers into the marker. A
file whose bytes on storage are not those written fails the save, so every published
checkpoint was read back intact once.

torch.distributed.checkpoint gathers each rank's write error into a CheckpointException;
torch's zip writer reports a short write as ``unexpected pos`` without the errno, so the
rank whose write failed checks its file system then, while the partial files still fill it.

DCP writes each tensor with ``torch.save``, whose zip records carry a CRC-32 of their bytes
by default; torch's own reader never checks it (a flipped byte loads silently), and the
XXH3-128 of each whole file is checked at write, read-back and load here. So the writer
turns the CRC off for its files (``torch.serialization.set_crc32_options``): a fifth of a
background save's CPU time (docs/checkpoints.md, measured by tools/bench/checkpoint.py).
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Dict

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from trainer3d.checkpoint.digest import FILE_HASH, HashingStream, file_digest
from trainer3d.checkpoint.direct import DirectFile
from trainer3d.observe.failure import naming_a_full_disk


class _HashingFileSystem(FileSystem):
    def __init__(self):
        self.written: Dict[str, HashingStream] = {}

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = DirectFile.open(Path(path))
        hashing = HashingStream(stream)
        self.written[Path(path).name] = hashing
        try:
            yield hashing
        except BaseException:
            getattr(stream, "abort", stream.close)()
            raise
        stream.close()


@contextmanager
def _without_zip_crc():
    """torch.save without its records' CRC-32 meanwhile (a process-wide setting: the loop's
    thread saves nothing with torch.save while a checkpoint is written)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class CheckpointWriter(FileSystemWriter):
    def __init__(self, path: str):
        super().__init__(path)
        self.fs = _HashingFileSystem()
        self.digests: Dict[str, dict] = {}

    def write_data(self, plan, planner):
        with naming_a_full_disk(str(self.path)), _without_zip_crc():
            future = super().write_data(plan, planner)
        for result in future.value():
            name = result.storage_data.relative_path
            if name not in self.digests:
                self.digests[name] = self._read_back(name)
        return future

    def _read_back(self, name: str) -> dict:
        on_disk = file_digest(Path(self.path) / name, from_storage=self.sync_files)
        written = self.fs.written[name]
        if written.digest is not None and (written.digest, written.bytes) != (on_disk[FILE_HASH], on_disk["bytes"]):
            raise OSError(f"checkpoint file {Path(self.path) / name} read back differs from what was written "
                          f"({on_disk['bytes']} of {written.bytes} bytes; the file system lost or changed data)")
        return on_disk

    def finish(self, metadata, results) -> None:
        with naming_a_full_disk(str(self.path)):
            super().finish(metadata, results)
