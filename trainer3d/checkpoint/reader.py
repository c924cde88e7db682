"""DCP's file reader and load planner, made safe for checkpoints that may not be trusted.

``dcp.load`` reads ``.metadata`` through its storage reader; FileSystemReader would unpickle
it with plain ``pickle``, so this reader hands DCP the checked metadata of
trainer3d/checkpoint/metadata.py instead. DCP's default planner turns a non-tensor entry back
into an object with ``torch.load(weights_only=False)`` (arbitrary code); the checked metadata
holds no such entries, and this planner refuses them as well, should one ever be planned.

    dcp.load(state, storage_reader=CheckpointReader(path), planner=TensorOnlyLoadPlanner())
"""

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from trainer3d.checkpoint import metadata as checked


class CheckpointReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        meta = checked.read(self.path)
        if meta.storage_meta is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        raise checked.MetadataError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, "
                                    "which this engine never writes; refusing to unpickle it")
