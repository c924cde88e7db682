"""ZeRO-1's parameter all-gather, waited for where the next forward first reads a bucket.

The gathers here are made late on purpose: a work handle that writes its bucket only when
waited for. A forward or a checkpoint that read the parameters without waiting would then
see last step's values everywhere but this rank's own slice, deterministically.
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.harness import dims_for, run_ranks
from tests.support.zero_ranks import make_cfg, train_step
from trainer3d.config.schema import ModelConfig
from trainer3d.cpu.shm import ShmCollectives
from trainer3d.model.transformer import Transformer
from trainer3d.parallel import comm
from trainer3d.parallel.parallelize import build_model_chunks
from trainer3d.parallel.zero.buckets import FlatBuffers
from trainer3d.parallel.zero.param_gather import DeferredGather
from trainer3d.parallel.recompute import checkpoint_layers
from trainer3d.parallel.zero.flat import ShardedOptimizer

MODEL = ModelConfig(dim=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=29, max_seq_len=8,
                    tie_embeddings=True)


class LateWrite:
    """A gather that lands in ``view`` only when waited for, and says so in ``log``."""

    def __init__(self, index, view, values, log):
        self.index, self.view, self.values, self.log = index, view, values, log

    def wait(self):
        self.view.copy_(self.values)
        self.log.append(self.index)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_forward_waits_for_each_bucket_once_in_forward_order_recomputation_included(tied):
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(MODEL, tie_embeddings=tied))
    reference = copy.deepcopy(model)
    checkpoint_layers([model])  # the backward's recomputed forward fires the hooks again
    buffers = FlatBuffers(list(model.parameters()), 300, 1, torch.float32)
    gather = DeferredGather([model], {p: b.index for b in buffers.buckets for p in b.params})
    new = torch.randn(buffers.numel)
    with torch.no_grad():  # the reference holds the gathered values from the start
        FlatBuffers(list(reference.parameters()), 300, 1, torch.float32).param_buffer.copy_(new)
    log = []
    gather.hand_over({b.index: LateWrite(b.index, buffers.param_buffer[b.start:b.end], new[b.start:b.end], log)
                      for b in reversed(buffers.buckets)})
    assert len(buffers.buckets) >= 4
    assert not torch.equal(buffers.param_buffer, new), "the late gathers must not have landed yet"

    tokens = torch.randint(0, MODEL.vocab_size, (2, 8))
    model.head_in_loss = True  # as a chunked loss runs it: the head applied outside its forward
    out = F.linear(model(tokens), model.output.weight).transpose(0, 1)
    out.sum().backward()
    model.head_in_loss = False
    assert torch.equal(out, reference(tokens)), "a module ran on parameters its gather had not written"
    assert log == list(range(len(buffers.buckets)))[::-1], "one wait per bucket, the embedding's first"
    model(tokens)
    assert len(log) == len(buffers.buckets) and gather.pending == {}


def _late_gathers(rank, world):
    """Three ZeRO-1 steps with late gathers and overlap, against the same steps waited at once."""
    for kind in (comm.GroupCollectives, ShmCollectives):  # whichever the dp group's collectives are
        _defer_gathers(kind)
    cfg = make_cfg(world, 1, bucket_mb=0.002, zero_reduce="reduce_scatter")
    out = {}
    for overlap in (True, False):
        dims = dims_for(dp=world)
        model = build_model_chunks(cfg, dims)[0]
        opt = ShardedOptimizer([model], cfg, dims, overlap_gather=overlap)
        norms = [train_step(model, opt, cfg, dims.dp_rank, s).item() for s in range(3)]
        raw = opt.buffers.param_buffer.numpy().copy()  # nothing waited yet: only this rank's slices are new
        views = {v.name: v.tensors["param"].numpy().copy() for v in opt.checkpoint_views() if "param" in v.tensors}
        out[overlap] = (norms, raw, views, len(opt.buffers.buckets))
    return out


def _defer_gathers(kind) -> None:
    """``kind``'s all-gather runs only when its handle is waited for."""
    launch = kind.all_gather
    kind.all_gather = lambda self, output, input: _Deferred(lambda: launch(self, output, input).wait())


class _Deferred:
    def __init__(self, run):
        self.run = run

    def wait(self):
        self.run()


def test_late_gathers_are_waited_for_by_the_next_forward_and_by_a_checkpoint():
    for out in run_ranks(_late_gathers, 2, timeout=180):
        (norms, raw, views, buckets), (norms_sync, raw_sync, views_sync, _) = out[True], out[False]
        assert buckets >= 4
        assert norms == norms_sync, "a forward read parameters before their gather"
        assert not np.array_equal(raw, raw_sync), "the overlapped gathers must still be in flight after step()"
        assert views.keys() == views_sync.keys()
        assert all(np.array_equal(views[n], views_sync[n]) for n in views), "a checkpoint read stale parameters"
