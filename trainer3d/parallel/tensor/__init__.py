"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti
et al. 2022): ``layers`` the column/row-parallel linears, the vocabulary-parallel embedding
and how a model's layers are swapped for them; ``comm`` the autograd-aware collectives
between tp ranks (the f/g operators, SP's all-gather and reduce-scatter on the sequence
dim); ``sequence`` the projections behind SP's all-gather, which keep the sequence shard
and gather it again in backward; ``loss`` cross-entropy over a vocabulary split across tp
(padding masked).
"""
