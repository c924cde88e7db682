"""What a rank hands DCP (trainer3d/checkpoint/state.py ``Pieces``): views of its own storage,
named by their offsets in the full tensor, which a save reads and a load writes in place.

Host state (an offloaded optimizer's masters and moments, a background save's staged copies)
must stay where it is: a piece that were a copy on another device would make a save copy the
host state there and a load fill the copy while the host tensors keep their old values. The
resume of offloaded runs itself is checked on CPU ranks by tests/multirank/test_offload.py and
on CUDA by tests/gpu/test_resume_gpu.py. One process saves here (``no_dist``): which rank
writes which piece is DCP's (tests/integration/test_checkpoint_resume.py reshards across layouts).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer3d.checkpoint.state import PieceMaker, Pieces
from trainer3d.model.init import TPShard

# Rows [4, 8) of a 12 x 3 tensor (tp rank 1 of 3 along dim 0), flat elements [2, 10) of them:
# a partial first row, two whole rows, a partial last row (trainer3d/checkpoint/chunks.py).
SHARD = TPShard(dim=0, rank=1, size=3, full=12)
START, END = 2, 10


def _piece(local: torch.Tensor) -> Pieces:
    return PieceMaker()(local.view(-1)[START:END], (4, 3), SHARD, START, END)


def test_a_piece_is_the_storage_it_was_made_from():
    host = torch.arange(12.0).view(4, 3)
    piece = _piece(host)
    assert piece.shape == (12, 3) and piece.dtype == host.dtype and piece.device == host.device
    assert len(piece.local_shards()) == 3
    begin, stop = host.untyped_storage().data_ptr(), host.untyped_storage().data_ptr() + host.nbytes
    assert all(begin <= view.data_ptr() < stop and view.device == host.device for view in piece.local_shards())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist: one process on purpose
def test_a_save_writes_the_pieces_at_their_place_and_a_load_fills_the_views(tmp_path):
    local = torch.arange(12.0).view(4, 3) + 100
    dcp.save({"w": _piece(local)}, checkpoint_id=tmp_path, no_dist=True)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"]
    assert metadata.size == (12, 3)  # the full tensor's, not the pieces'
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata.chunks) == \
        [((4, 2), (1, 1)), ((5, 0), (2, 3)), ((7, 0), (1, 1))]
    into = torch.zeros(4, 3)
    dcp.load({"w": _piece(into)}, checkpoint_id=tmp_path, no_dist=True)
    expected = torch.zeros(12)
    expected[START:END] = local.view(-1)[START:END]
    assert torch.equal(into.view(-1), expected)  # the views, filled in place; the rest untouched
