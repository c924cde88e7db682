"""The weight-gradient step (W) of the zero-bubble schedules, through trainer3d's gradient path.

Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism") split a stage's
backward in two: I, the gradient of the stage's input (sent upstream at once), and W, the
gradients of its weights, run later to fill what would be a bubble. torch 2.13 does I with
``stage_backward_input`` (torch/distributed/pipelining/_backward.py): an ``autograd.grad`` to
the stage inputs with ``retain_graph``, whose pre-hooks keep the gradients reaching the
"intermediate" nodes that lead to both the inputs and the weights. Its W,
``stage_backward_weight``, takes ``autograd.grad`` from those intermediates to the weights'
``AccumulateGrad`` nodes and adds the result into ``.grad`` itself. ``autograd.grad`` captures
a gradient without running the ``AccumulateGrad`` node, so:

- the post-accumulate-grad hooks never fire: the ZeRO buckets (parallel/zero/buckets.py)
  count each parameter's micro-batches with them, and would launch nothing inside backward;
- a low-precision parameter without ``.grad`` gets the bf16 gradient assigned to ``.grad``,
  which no hook moves into the fp32 buffer: the gradient would be missed;
- wgrad.py's linear layers return no weight gradient (they accumulate into the fp32 view
  themselves), which ``autograd.grad`` without ``allow_unused`` refuses.

``backward_weight`` runs the same graph with ``autograd.backward(..., inputs=weights)``
instead: the engine runs each weight's ``AccumulateGrad`` node, so ``.grad`` accumulates as in
an ordinary backward (into the fp32 flat buffer's view), the bucket hook fires once per
parameter and micro-batch, and wgrad.py's sink sees its weight's node executed and
accumulates. The I step never runs those nodes (``autograd.grad`` to the inputs), so nothing
is counted or accumulated twice. The first stage has no input gradient to compute: torch
runs its whole backward at W (``backward_weight_one_chunk``), an ordinary ``autograd.backward``.

Recomputation (``train.activation_checkpointing``, parallel/recompute.py): torch's non-reentrant
checkpoint recomputes a block once per backward call that unpacks its saved tensors, keyed by the
call's graph task (torch/utils/checkpoint.py ``unpack_hook``), and W makes one call per parameter
group (a block has several: each projection and norm whose path meets the stage input's at its own
node), so each group's call would recompute every block it reaches again. W's calls therefore run
under one ``torch.utils.checkpoint.GraphExecGroup`` (pytorch/pytorch#166536, the API added for
zero-bubble schedules): a block is recomputed once in W. The groups' calls cover disjoint parts of
the graph (torch merges groups that share an intermediate or a weight path), as the group
requires. I is a separate call and recomputes once more: W runs the intermediates I ran again, so
one group over both would unpack their saved tensors twice, which it refuses; sharing that
recomputation would also hold each block's recomputed activations from I to W.
tests/unit/test_weight_grad.py counts a block's recomputations in I and in W.

Memory: the graph I retained lives until W. The nodes W runs free their saved tensors as they
run (no ``retain_graph``); the ones it never runs (the attention kernel and RoPE, which lead
to no weight) go when W drops the intermediates, the graph's last reference (I detached the
stage output). A micro-batch's activations are therefore held from its forward to its W,
and none outlive the step (trainer3d/memory/in_flight.py counts them so).
"""

from typing import Any, Dict, Iterable, List

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import GraphExecGroup
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc


def backward_weight(weights: Iterable[nn.Parameter], param_groups: List[Dict[str, Any]]) -> None:
    """Accumulate the weights' gradients from the intermediates' saved gradients (see the module
    docstring); ``param_groups`` as ``stage_backward_input`` returns them (consumed)."""
    param_of = {}
    for weight in weights:
        node = _get_grad_fn_or_grad_acc(weight)
        if node is not None:
            param_of[node] = weight
    grouped = {n for group in param_groups for n in group["params"]}
    if param_of.keys() - grouped:
        # torch's grouping leaves out a weight whose gradient path never meets the stage input's
        # (``get_param_groups``: "the assert will only be true if the input tensor requires
        # gradients"): refuse rather than drop its gradient.
        missed = [tuple(param_of[n].shape) for n in param_of.keys() - grouped]
        raise RuntimeError(f"zero-bubble weight step: {len(missed)} weight(s) of shapes {missed} are not "
                           "reached from the stage input; use parallel.pp_schedule=1f1b or interleaved_1f1b")
    with GraphExecGroup():  # a recomputed block: once for all the groups' calls (module docstring)
        for group in param_groups:
            _group_backward(group, param_of)


def _group_backward(group: Dict[str, Any], param_of: Dict[Any, nn.Parameter]) -> None:
    """One parameter group's weight gradients, from its intermediates' gradients saved in I."""
    edges, grads = [], []
    for grads_tuple, intermediate in zip(group.get("grads") or (), group["intermediates"]):
        for i, grad in enumerate(grads_tuple):
            if grad is not None:
                edges.append(GradientEdge(intermediate, i))
                grads.append(grad)
    handles = []
    try:
        if len(group["intermediates"]) > 1:
            # An intermediate below another would otherwise also receive the upper one's
            # gradient again: each gets exactly what it received in I (as torch's W does).
            for grads_tuple, intermediate in zip(group["grads"], group["intermediates"]):
                handles.append(intermediate.register_prehook(lambda _, saved=grads_tuple: saved))
        del group["intermediates"]  # the pre-hook -> group -> intermediates cycle
        if edges:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=[param_of[n] for n in group["params"]])
        group.pop("grads", None)
    finally:
        for handle in handles:
            handle.remove()
