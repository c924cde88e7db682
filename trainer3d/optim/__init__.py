"""The optimizer's arithmetic, apart from how its state is sharded.

``schedule`` the learning rate as a pure function of the step and AdamW's parameter groups;
``adamw`` the AdamW update on flat fp32 buffers (every ZeRO stage steps through it);
``mixed_precision`` the parameter dtypes and fp16's dynamic loss scale. Where the state lives
and how it is reduced is ``parallel/zero/``'s, and so is the global gradient norm, a reduction
over the layout (``parallel/clip.py``). May import ``config`` and ``model``.
"""
