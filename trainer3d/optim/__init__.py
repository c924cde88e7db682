"""The optimizer's arithmetic, apart from how its state is sharded.

``schedule`` the learning rate as a pure function of the step and AdamW's parameter groups;
``adamw`` the AdamW update on flat fp32 buffers (every ZeRO stage steps through it);
``clip`` the global gradient norm over tp, pp and dp (tensor-parallel replicas counted
once) and clipping by it; ``mixed_precision`` the parameter dtypes and fp16's dynamic loss
scale. Where the state lives and how it is reduced is ``parallel/zero/``'s. May import
``config``, ``model`` (shard descriptions) and the topology; nothing else of ``parallel``.
"""
