"""Checkpoint pieces are made on their tensor's own device (trainer3d/checkpoint/state.py).

``DTensor.from_local`` copies a local tensor whose device differs from its mesh's onto the
mesh's device (torch/distributed/tensor/_api.py); a piece of host state (an offloaded
optimizer's masters and moments) wrapped on a CUDA mesh is then a device copy: a save copies
the host state onto the GPU and a load fills the copy while the host tensors keep their old
values. Without a GPU here, a mesh on the ``meta`` device over the same gloo group shows the
same copy (the local tensor moved to ``meta``, its storage not the host tensor's) — and the
piece maker must refuse it. The resume of offloaded runs itself is checked on CPU ranks by
tests/multirank/test_offload.py and on CUDA by tests/gpu/test_resume_gpu.py.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from trainer3d.checkpoint.state import PieceMaker
from trainer3d.launch.local_ranks import run_ranks


def _pieces_on_meshes(rank, world):
    """This rank's rows [4r, 4r+4) of an 8 x 3 tensor, on a CPU mesh and on a meta mesh."""
    host = torch.arange(12.0) + 100 * rank
    cpu_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    meta_mesh = DeviceMesh.from_group(dist.group.WORLD, "meta")
    # what torch does with a mismatched local tensor: a copy on the mesh's device
    moved = DTensor.from_local(LocalShardsWrapper([host.view(4, 3)], [[4 * rank, 0]]), meta_mesh, [Shard(0)],
                               run_check=False, shape=torch.Size([8, 3]), stride=(3, 1))
    moved_shard = moved.to_local().local_shards()[0]
    piece = PieceMaker(cpu_mesh)(host, (4, 3), None, 0, 12)
    same = piece.to_local().local_shards()[0].data_ptr() == host.data_ptr()
    with pytest.raises(ValueError, match=r"mesh on 'meta'.*Checkpointer\.maker\('cpu'\)") as refused:
        PieceMaker(meta_mesh)(host, (4, 3), None, 0, 12)
    return moved_shard.device.type, same, str(refused.value)


def test_a_piece_is_refused_on_a_mesh_of_another_device():
    for moved_to, aliases_host, message in run_ranks(_pieces_on_meshes, 2, timeout=120):
        assert moved_to == "meta"  # from_local's copy, which the refusal keeps out of a checkpoint
        assert aliases_host  # on its own device's mesh, the piece is the host tensor itself
        assert "on cpu" in message
