"""Mixture-of-experts blocks under a layout (model/moe.py holds the block itself).

- ``tokens``: which ranks share a micro-batch's tokens (sequence and context parallelism),
  so the balance loss is the micro-batch's in every layout, and the scale its gradient
  starts backward from.
- ``balance``: aux_free's routing bias, updated after each step from the global batch's
  expert counts, and named for the checkpoint.
- ``dispatch``: expert parallelism (``parallel.ep``): each block keeps this rank's slice of
  its experts, and the routed tokens reach them and come back by all-to-all over the ep group.
- ``optimizer``: the ZeRO 0/1 optimizer of an expert-parallel layout: the dense parameters
  over dp x cp, the expert slices over the expert-dp group, one gradient norm.

Without ep, experts are replicated on every rank. May import ``config``, ``model``,
``parallel.topology``, ``parallel.clip`` and ``parallel.zero``.
"""
