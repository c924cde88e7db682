"""The model: one parallelism-agnostic Llama-style definition (``transformer``: RMSNorm,
RoPE, grouped-query attention, SwiGLU; ``functional``: the norm, RoPE and SwiGLU as autograd
Functions that save only what backward needs, their elementwise work as ``torch.ops.trainer3d``
operators defined by their composition), how its parameters are filled (``init``: a source of
values, random or Hugging Face, each rank filling only its slices; ``normal_stream``: any
rectangle of torch.randn's draw), attention within documents (``documents``: the
document-masked attention core, data.document_mask), and what a step costs (``flops``:
PaLM's count). May import
``config``; parallelism is applied from outside
(``parallel/parallelize.py``).
"""

from trainer3d.model.transformer import Transformer, count_parameters, cross_entropy_loss

__all__ = ["Transformer", "count_parameters", "cross_entropy_loss"]
