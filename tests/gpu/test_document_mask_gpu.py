"""data.document_mask on CUDA: FlexAttention with a block mask made from the documents
(trainer3d/model/documents.py), held to the CPU path (SDPA with the dense additive mask) on the
same device, forward and backward, and the whole model's masked loss held to each document
run alone. Marked ``gpu``; skips without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from trainer3d.config.schema import ModelConfig
from trainer3d.model.documents import Segments, apply_document_mask, flex_document_attention, masked_sdpa
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "runs where one is)")]


def _segments(lengths_per_row, device):
    rows = [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
            for lengths in lengths_per_row]
    segments = Segments()
    segments.set(torch.stack(rows).to(device))
    return segments


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_document_attention_matches_the_dense_mask(dtype, tol):
    torch.manual_seed(0)
    seq = 1024
    segments = _segments([[5, 300, 1, 200, 518], [seq]], "cuda")
    q = torch.randn(2, 8, seq, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, seq, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, seq, 64, device="cuda", dtype=dtype, requires_grad=True)
    out = flex_document_attention(q, k, v, segments)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    want = masked_sdpa(q, k, v, segments)
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * 10)


def test_the_masked_model_on_cuda_is_each_document_run_alone():
    torch.manual_seed(1)
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=101, max_seq_len=256)
    masked, plain = Transformer(cfg), Transformer(cfg)
    init_parameters(masked, cfg, 0)
    init_parameters(plain, cfg, 0)
    masked, plain = masked.cuda(), plain.cuda()
    lengths = [7, 120, 1, 128]
    tokens = torch.randint(0, cfg.vocab_size, (1, 257), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments = apply_document_mask([masked])
    segments.set(_segments([lengths], "cuda").ids)
    total = F.cross_entropy(masked(inputs).reshape(-1, cfg.vocab_size).float(), targets.reshape(-1),
                            reduction="sum")
    reference, at = 0.0, 0
    for n in lengths:
        out = plain(inputs[:, at:at + n])
        reference = reference + F.cross_entropy(out.reshape(-1, cfg.vocab_size).float(), targets[0, at:at + n],
                                                reduction="sum")
        at += n
    torch.testing.assert_close(total, reference, rtol=1e-4, atol=0)


def test_cp_document_masked_blocks_on_cuda_equal_sdpa_with_the_mask():
    """Under context parallelism a document-masked block runs the plain-torch kernel on the ranks'
    device (trainer3d/parallel/context/documents.py): every rank of cp=2 simulated in this process
    on the GPU, forward and backward, against SDPA on the whole sequence with the mask."""
    from tests.support.cp_documents import cp_blocks_against_sdpa

    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        worst, computed = cp_blocks_against_sdpa(torch.device("cuda"), dtype)
        assert worst < tol, (dtype, worst)
        assert computed == {0: 4, 1: 5}, computed
