"""trainer3d/memory/meter.py: the meter observes saved tensors without changing how long they live.

A zero-bubble weight step (parallel/pipeline/weight_grad.py) runs only the nodes between its
intermediates and the weights; the rest of the retained graph (SDPA above the projections) is
freed when the step drops its last reference, never run. A pack hook that holds the tensor an
op saves of its own output would keep that node alive through a node -> saved -> tensor -> node
cycle (torch/autograd/graph.py, ``saved_tensors_hooks``)."""

import torch

from trainer3d.memory.meter import SavedActivationMeter


def test_a_graph_dropped_without_backward_frees_its_saved_outputs():
    x = torch.randn(1000, requires_grad=True)
    with SavedActivationMeter() as meter:
        y = x.exp()  # exp saves its own output (1000 fp32 = 4,000 B)
        z = y * 3.0  # saves no tensor: multiplies by a number
        assert meter.live_bytes == 4000
        del y, z  # the graph is dropped without running it
    assert meter.live_bytes == 0 and meter.peak_bytes == 4000


def test_backward_through_the_meter_is_torchs():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    ((x @ w).exp().sum()).backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with SavedActivationMeter([w]) as meter:  # parameters are not counted
        y = (x @ w).exp()  # saves x (512 B) and its output (128 B)
        assert meter.live_bytes == 8 * 16 * 4 + 8 * 4 * 4
        y.sum().backward()
    assert meter.live_bytes == 0
    torch.testing.assert_close((x.grad, w.grad), want, rtol=0, atol=0)
