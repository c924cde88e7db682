"""Document masking: attention that stays inside each document, positions that restart at each.

A window packs several documents end to end (trainer3d/data/segments.py gives each input
token its document's segment number). ``DocumentAttention`` replaces a block's attention
core: token i attends to token j <= i only when both are of one segment, and its rotary
position is its offset from its segment's first token, as if each document ran alone
(Llama 3's pre-training, Dubey et al. 2024 sec. 3.2: "an attention mask that prevents
self-attention between different documents within the same sequence"; Megatron-LM's
``--reset-attention-mask --reset-position-ids``).

``Segments`` holds the current micro-batch's segments, one object shared by every block of
a rank's chunks; the trainer (or a pipeline stage, per micro-batch, trainer3d/parallel/pipeline/
schedule.py) sets it before the forward and again before a backward that recomputes it.

How attention reads it:

- on CPU (and as the reference everywhere), an additive mask (batch, 1, seq, seq) in the
  activation dtype (0 where allowed, -inf elsewhere) for torch's SDPA. It is built once per
  micro-batch and saved by SDPA by reference in every block (torch's CPU flash kernel keeps
  the mask it is given as it is; a bool mask it would convert to a new float tensor per
  block), so a micro-batch keeps batch x seq^2 x itemsize bytes for it
  (trainer3d/memory/activations.py counts them).
- on CUDA, FlexAttention (torch.nn.attention.flex_attention) with a block mask made from the
  segments (``create_block_mask``): blocks of 128 x 128 that no document spans are skipped,
  and the mask is a few bytes per block, nothing dense in seq^2 (torchtitan's
  ``FlexAttention`` with ``mask_mod=document_mask``, torchtitan/models/attention.py).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from trainer3d.model.transformer import CausalAttention, kv_expanded, repeat_kv


class Segments:
    """The micro-batch's segments, (batch, seq) ints, and what attention makes of them (cached)."""

    def __init__(self):
        self.ids: Optional[torch.Tensor] = None
        self._cache: Dict[Tuple, torch.Tensor] = {}

    def set(self, ids: torch.Tensor) -> None:
        self.ids, self._cache = ids, {}

    def _require(self) -> torch.Tensor:
        if self.ids is None:
            raise RuntimeError("data.document_mask: no segments set for this micro-batch")
        return self.ids

    def window_ids(self, device: torch.device) -> torch.Tensor:
        """(batch, seq) int32, a copy of its own: the ids context parallelism's attention saves for
        backward (trainer3d/parallel/context/documents.py), not a view of the whole step's segments."""
        key = ("ids", device)
        if key not in self._cache:
            self._cache[key] = self._require().to(device=device, dtype=torch.int32, copy=True)
        return self._cache[key]

    def positions(self, device: torch.device) -> torch.Tensor:
        """(batch, seq) int64: each token's offset from its segment's first token."""
        key = ("positions", device)
        if key not in self._cache:
            ids = self._require().to(device)
            idx = torch.arange(ids.shape[-1], device=device).expand_as(ids)
            first = torch.ones_like(ids, dtype=torch.bool)
            first[:, 1:] = ids[:, 1:] != ids[:, :-1]
            starts = torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=-1).values
            self._cache[key] = idx - starts
        return self._cache[key]

    def additive_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(batch, 1, seq, seq): 0 where token i may attend to j (j <= i, one segment), -inf elsewhere."""
        key = ("mask", dtype, device)
        if key not in self._cache:
            ids = self._require().to(device)
            seq = ids.shape[-1]
            allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(
                seq, seq, dtype=torch.bool, device=device).tril()
            self._cache[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, float("-inf"))
        return self._cache[key]

    def block_mask(self, device: torch.device):
        """FlexAttention's block mask of the segments (CUDA)."""
        key = ("block", device)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask  # see _flex_attention
            ids = self._require().to(device)

            def document_causal(b, h, q_idx, kv_idx):
                return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

            batch, seq = ids.shape
            self._cache[key] = create_block_mask(document_causal, batch, None, seq, seq, device=device)
        return self._cache[key]


_FLEX = {}


def _flex():
    """torch's FlexAttention, imported where it runs: its module imports torch._dynamo (1-2 s of
    CPU at every rank's start), which a run without document masking on CUDA never uses."""
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


def _flex_attention():
    """FlexAttention compiled once (uncompiled it runs a dense reference implementation)."""
    if "fn" not in _FLEX:
        flex_attention = _flex()
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """The CPU path and the reference: SDPA with the dense additive document mask."""
    heads = q.shape[1]
    if kv_expanded(q.device.type, q.dtype, heads, k.shape[1]):
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    mask = segments.additive_mask(q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != heads)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                            compiled: bool = True) -> torch.Tensor:
    """The CUDA path: FlexAttention over the segments' block mask (grouped K/V taken as they are).
    ``compiled=False`` runs torch's eager reference of it (any device: the CPU test of the mask)."""
    fn = _flex_attention() if compiled else _flex()
    return fn(q, k, v, block_mask=segments.block_mask(q.device), enable_gqa=k.shape[1] != q.shape[1])


class DocumentAttention(CausalAttention):
    """Causal attention within each document of a sequence held whole."""

    EAGER_PARTS = ("_positions", "_attend")
    """What train.compile leaves eager (trainer3d/parallel/compile.py ``leave_eager``)."""

    def __init__(self, segments: Segments):
        super().__init__()
        self.segments = segments
        # The segments' caches are Python state, which dynamo would guard on and re-trace per
        # micro-batch: under train.compile the rest of the block compiles around these two
        # (EAGER_PARTS). Functions, not bound methods: a deep copy of the block
        # (parallel/pipeline/stages.py copies the model for each chunk of an interleaved rank)
        # must read its own segments (model/moe.py does the same).
        self._positions = DocumentAttention._segment_positions
        self._attend = DocumentAttention._document_attention

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """(batch, seq): each sequence its own positions (model/transformer.py ``Attention`` rotates per token)."""
        return self._positions(self, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attend(self, q, k, v)

    def _segment_positions(self, device: torch.device) -> torch.Tensor:
        return self.segments.positions(device)

    def _document_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cuda":
            return flex_document_attention(q, k, v, self.segments)
        return masked_sdpa(q, k, v, self.segments)


def apply_document_mask(chunks: List[nn.Module]) -> Segments:
    """Give every block of ``chunks`` the document-masked attention, all reading one ``Segments``
    (also kept as each chunk's ``document_segments``, where the trainer finds it)."""
    segments = Segments()
    for chunk in chunks:
        for block in chunk.layers.values():
            block.attention.core = DocumentAttention(segments)
        chunk.document_segments = segments
    return segments


def segments_of(chunks: List[nn.Module]) -> Optional[Segments]:
    """The ``Segments`` the chunks' blocks read (None without document masking)."""
    return getattr(chunks[0], "document_segments", None) if chunks else None
