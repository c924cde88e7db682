"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti
et al. 2022): ``layers`` the column/row-parallel linears, the vocabulary-parallel embedding
and how a model's layers are swapped for them; ``comm`` the autograd-aware collectives
between tp ranks (the f/g operators, SP's all-gather and reduce-scatter on the sequence
dim); ``loss`` cross-entropy over a vocabulary split across tp (padding masked).
"""
