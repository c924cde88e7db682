"""Apply the layout to the parallelism-agnostic model.

``build_model_chunks`` is the whole recipe, in order:
1. build the full model on the meta device (no memory);
2. pipeline: keep only this rank's stage(s) (parallel/pipeline/stages.py);
3. tensor parallel: swap Linear/Embedding layers for sharded ones (parallel/tensor/layers.py);
   expert parallel: each MoE block keeps this rank's slice of its experts, fed by all-to-all
   (parallel/expert/dispatch.py);
4. cast to the dtype the parameters are stored in (still on meta, so nothing is held in a
   wider dtype first: ``train.dtype``, or fp32 under FSDP, whose parameters are the master
   weights — optim/mixed_precision.py), materialise on this rank's device and fill from the
   parameter source: the layout-independent random init, or ``model.init_from``'s Hugging
   Face weights, each producing only this rank's slices (nothing at all when resuming).
   ZeRO-2/3 (FSDP2) does this last instead, after step 8: the meta-device model is sharded
   over dp, then only this rank's shards are allocated and filled (parallel/zero/fsdp.py,
   ``shard_and_materialise``; on the host with ``parallel.offload_optimizer``, where FSDP2
   keeps them), so no rank holds the whole model at any time;
5. context parallelism: each block's attention core reads the other cp ranks' keys and
   values (parallel/context/apply.py), when cp > 1; document masking: each block's core
   attends within documents (model/documents.py), with ``data.document_mask``;
6. per-layer activation checkpointing, if asked;
7. bf16/fp16: the linear layers compute through ``parallel/wgrad.py``'s ``linear``, whose
   backward accumulates weight gradients into the optimizer's fp32 buffer;
8. torch.compile of each transformer block, if asked; under a zero-bubble schedule of the
   model's elementwise operators instead (parallel/compile.py).
``build_optimizer`` then wraps the chunks in the data-parallel optimizer (ZeRO stages 0/1:
parallel/zero/flat.py, 2/3: parallel/zero/fsdp.py; offloaded: parallel/zero/offload.py,
parallel/zero/fsdp_offload.py; expert parallel: parallel/expert/optimizer.py).
"""

from typing import Callable, List, Optional

import torch
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.hf.source import HFSource
from trainer3d.model.init import ParameterSource, RandomInit, fill_parameters
from trainer3d.model.moe import moe_blocks
from trainer3d.model.transformer import Transformer
from trainer3d.model.documents import apply_document_mask
from trainer3d.parallel.compile import apply_compile
from trainer3d.parallel.context.apply import apply_context_parallel
from trainer3d.parallel.expert.dispatch import apply_expert_parallel
from trainer3d.parallel.expert.optimizer import ExpertParallelOptimizer
from trainer3d.parallel.zero.fsdp import FSDPOptimizer, shard_and_materialise
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.optim.mixed_precision import param_dtype
from trainer3d.parallel.recompute import checkpoint_layers
from trainer3d.parallel.pipeline.stages import split_into_stages
from trainer3d.parallel.tensor.layers import apply_tensor_parallel
from trainer3d.parallel.tied import share_embedding
from trainer3d.parallel.tensor.loss import chunked_loss_fn, vocab_parallel_loss_fn
from trainer3d.parallel.tensor.loss_sum import head_loss_sum, logits_loss_sum
from trainer3d.parallel.wgrad import route_linear_layers
from trainer3d.parallel.zero.flat import ReplicatedOptimizer, ShardedOptimizer
from trainer3d.parallel.zero.fsdp_offload import OffloadedFSDPOptimizer
from trainer3d.parallel.zero.offload import OffloadedOptimizer
from trainer3d.parallel.topology import ParallelDims


def build_meta_chunks(cfg: Config, dims: ParallelDims) -> List[nn.Module]:
    """Steps 1-3: this rank's chunks, split and tensor-parallel, still on the meta device
    (the dry run reads their shapes without allocating anything)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    chunks = split_into_stages(model, cfg, dims) if dims.pp > 1 else [model]
    if dims.tp > 1:
        for chunk in chunks:
            apply_tensor_parallel(chunk, cfg, dims)
    apply_expert_parallel(chunks, dims)
    return chunks


def parameter_source(cfg: Config) -> ParameterSource:
    """Where the initial values come from: ``model.init_from``'s weights, else the random init."""
    if cfg.model.init_from:
        return HFSource(cfg.model.init_from, cfg.model)
    return RandomInit(cfg.model, cfg.train.seed)


def materialise_device(cfg: Config, dims: ParallelDims) -> torch.device:
    """Where the parameters are allocated: the rank's device, but the host under FSDP with the
    optimizer offloaded (``CPUOffloadPolicy`` keeps the shards there)."""
    if cfg.parallel.zero_stage >= 2 and cfg.parallel.offload_optimizer:
        return torch.device("cpu")
    return dims.device


def build_model_chunks(cfg: Config, dims: ParallelDims, initialise: bool = True) -> List[nn.Module]:
    """This rank's model chunks (one per pipeline stage it runs; one when pp == 1).

    ``initialise=False`` (a resumed run: the checkpoint fills every parameter) draws or reads
    nothing; parameters are zeroed, because the padded vocabulary's tail rows are in no
    checkpoint and must stay zero."""
    chunks = build_meta_chunks(cfg, dims)
    source = parameter_source(cfg) if initialise else None
    sharded = cfg.parallel.zero_stage >= 2
    for chunk in chunks:
        chunk.to(dtype=param_dtype(cfg))
        if not sharded:
            chunk.to_empty(device=materialise_device(cfg, dims))
            for block in moe_blocks([chunk]):  # a resume loads the bias over it
                block.reset_bias(materialise_device(cfg, dims))
            if source is None:
                for param in chunk.parameters():
                    param.detach().zero_()
            else:
                fill_parameters(chunk, source)
    share_embedding(chunks)  # a V's first and last stage on this rank: one tied Parameter
    if cfg.data.document_mask:
        apply_document_mask(chunks)
    apply_context_parallel(chunks, dims, cfg.parallel.cp_attention)  # document-masked after apply_document_mask
    if cfg.train.activation_checkpointing:
        checkpoint_layers(chunks)
    if param_dtype(cfg) != torch.float32:
        route_linear_layers(chunks)
    if cfg.train.compile:
        apply_compile(chunks, dims.pp, cfg.parallel.pp_schedule, cfg.train.compile_backend)
    if sharded:  # refuses pp > 1, as validate() does before launch
        shard_and_materialise(chunks[0], cfg, dims, source, materialise_device(cfg, dims))
    return chunks


def build_optimizer(chunks: List[nn.Module], cfg: Config, dims: ParallelDims) -> ZeroOptimizer:
    """The optimizer of ``parallel.zero_stage`` over this rank's chunks."""
    stage = cfg.parallel.zero_stage
    if cfg.optim.name == "muon" and (stage >= 2 or cfg.parallel.offload_optimizer):
        # validate() refuses these with the reason (config/validate_optim.py); a caller that
        # skipped it gets no AdamW in Muon's place
        raise ValueError("optim.name=muon runs on parallel.zero_stage 0/1 without offload_optimizer")
    if dims.topo.ep > 1:
        if stage >= 2 or cfg.optim.name == "muon":
            # validate() refuses these with the reason (config/validate_moe.py)
            raise ValueError("parallel.ep > 1 runs on parallel.zero_stage 0/1 with AdamW")
        return ExpertParallelOptimizer(chunks, cfg, dims, sharded=stage == 1)
    if cfg.parallel.offload_optimizer and stage < 2:
        return OffloadedOptimizer(chunks, cfg, dims, sharded=stage == 1)
    if stage == 0:
        return ReplicatedOptimizer(chunks, cfg, dims)
    if stage == 1:
        return ShardedOptimizer(chunks, cfg, dims)
    if cfg.parallel.offload_optimizer:
        return OffloadedFSDPOptimizer(chunks, cfg, dims)
    return FSDPOptimizer(chunks, cfg, dims)


def build_loss_fn(cfg: Config, dims: ParallelDims, chunks: Optional[List[nn.Module]] = None) -> Callable:
    """(last stage's output, targets) -> mean token loss, vocabulary-parallel when tp > 1
    (parallel/tensor/loss.py).

    Given this rank's ``chunks`` and ``train.loss_chunk_tokens`` > 0, the chunk holding the
    head returns its hidden states (``head_in_loss``) and the loss applies the head chunk by
    chunk, never holding the whole logits; otherwise (no chunks: the model returns logits)
    the loss reads whole logits."""
    heads = [chunk for chunk in chunks or () if getattr(chunk, "output", None) is not None]
    if heads and cfg.train.loss_chunk_tokens > 0:
        heads[-1].head_in_loss = True
        return chunked_loss_fn(cfg, dims, heads[-1].output)
    return vocab_parallel_loss_fn(cfg, dims)


def build_eval_loss_fn(cfg: Config, dims: ParallelDims, chunks: List[nn.Module]) -> Callable:
    """(last stage's output, targets) -> the sum of the token losses whose target counts
    (evaluation's partial batch: parallel/tensor/loss_sum.py), reading the output as the
    training loss of ``build_loss_fn`` (called first) does: hidden states where the head runs
    in the loss, logits otherwise."""
    vocab, rows = cfg.model.vocab_size, cfg.train.loss_chunk_tokens
    heads = [chunk for chunk in chunks if getattr(chunk, "head_in_loss", False)]
    if heads:
        head = heads[-1].output
        return lambda hidden, targets: head_loss_sum(hidden, head, targets, vocab, dims, rows)
    return lambda logits, targets: logits_loss_sum(logits, targets, vocab, dims,
                                                   rows if rows > 0 else targets.numel())
