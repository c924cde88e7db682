"""Mixture-of-experts blocks under a layout (model/moe.py holds the block itself).

- ``tokens``: which ranks share a micro-batch's tokens (sequence and context parallelism),
  so the balance loss is the micro-batch's in every layout, and the scale its gradient
  starts backward from.

Experts are replicated on every rank (expert parallelism is not built yet). May import
``config``, ``model`` and ``parallel.topology``.
"""
