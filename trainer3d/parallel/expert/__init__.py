"""Mixture-of-experts blocks under a layout (model/moe.py holds the block itself).

- ``tokens``: which ranks share a micro-batch's tokens (sequence and context parallelism),
  so the balance loss is the micro-batch's in every layout, and the scale its gradient
  starts backward from.
- ``balance``: aux_free's routing bias, updated after each step from the global batch's
  expert counts, and named for the checkpoint.

Experts are replicated on every rank (expert parallelism is not built yet). May import
``config``, ``model`` and ``parallel.topology``.
"""
