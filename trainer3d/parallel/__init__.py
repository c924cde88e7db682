"""Parallelize: the layout applied to the parallelism-agnostic model, one dimension a room.

``topology`` is the one object that knows the layout (``ParallelDims``: rank order TP
fastest, then CP, then DP, then PP; the named DeviceMesh and its groups, with ``timeouts``); it is
built once and passed down, never read from a global. ``parallelize`` is the recipe that
turns the config into this rank's model chunks, optimizer and loss. Each dimension lives in
its own package with its communication beside it: ``tensor/`` (Megatron-style sharded
layers, sequence parallelism, the vocabulary-parallel loss), ``pipeline/`` (stages, the
1F1B/interleaved schedules, the bubble clock), ``zero/`` (data parallelism: the optimizer
contract, flat-buffer ZeRO 0/1 with bucketed reduction and an overlapped gather, FSDP2 for
ZeRO 2/3), ``context/`` (context parallelism: load-balanced sequence shards, ring or
all-gather attention across them). Beside them: ``finalize`` (the gradients after backward: dp reduction, sequence-parallel
and tied-embedding sums), ``clip`` (the global gradient norm over tp, pp and dp, tensor-parallel
replicas counted once, and clipping by it), ``comm`` (collective shims and the ``Collectives`` ZeRO
and clipping talk to, a process group's or shared memory's, trainer3d/cpu/shm.py), ``wgrad``
(low-precision weight gradients into fp32 buffers), ``recompute``, ``compile``, ``tied`` (the
tied embedding's two copies). May import ``config``, ``model``, ``data`` (the cp split of a sequence),
``optim``, ``hf`` (the parameter source) and ``cpu``; never what runs it (``memory``,
``observe``, ``checkpoint``, the trainer, the rank, the launcher).
"""
