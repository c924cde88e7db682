"""Context parallelism (``parallel.cp``): each sequence split over a group of cp ranks.

Liu et al. 2023 ("Ring Attention with Blockwise Transformers") and Llama 3's report (sec.
3.3.2, all-gather of keys and values for GQA). Every layer but attention works token by
token, so a rank holding a part of the sequence computes its part alone; attention needs
the keys and values of the earlier positions, held by other cp ranks.

The split itself is the data's (trainer3d/data/cp_sharding.py, which the loader reads by):
load-balanced causal sharding — 2·cp chunks, rank i holds chunks i and 2·cp−1−i
(Megatron-Core's layout), so every rank does the same attention work — and the positions
(RoPE) of a rank's tokens. Here:

- ``kernels``: attention of one query block on one key/value block, returning its
  log-sum-exp, its backward, and the merge of partial results through their log-sum-exp;
  which kernel does it for a device and dtype (``block_kernel``).
- ``fused``: the block on CUDA through torch's flash and memory-efficient kernels.
- ``comm``: the exchange of key/value blocks over the cp group: passed around a ring with
  send/recv (overlapped with the current block's compute), or all-gathered at once.
- ``documents``: document masking (data.document_mask) across shards: which chunk pairs of a
  block any document spans (the others are skipped), their masked attention and a merge
  that rows seeing nothing leave unchanged (plain-torch kernels, on any device).
- ``attention``: the exact causal attention across shards as one autograd Function (it
  saves q, k, v, the output and the log-sum-exp through ``ctx.save_for_backward``).
- ``apply``: the wiring into the model (each block's attention core).

The data loader hands each cp rank its chunks (trainer3d/data/loader.py); gradients are
averaged over dp x cp (trainer3d/parallel/topology.py). May import ``config``, ``model``,
``data.cp_sharding`` and ``parallel.topology``.
"""
