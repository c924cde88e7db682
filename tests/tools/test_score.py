"""trainer3d-score: per-document log-losses held to transformers scoring each document alone.

The model is a tiny random Llama saved by transformers itself (as tests/integration/test_hf.py
makes them); the token file has documents of many lengths, one of them longer than the window
(scored by a sliding window, held to the strided loop of transformers' perplexity guide
written out here) and one holding the end-of-document id inside it (a boundary only the
document index knows). Packed and --no-pack must both give transformers' numbers.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.conftest import ROOT
from tests.support.megatron_files import write_megatron
from tests.support.runs import train_in_ranks
from trainer3d.checkpoint import store
from trainer3d.checkpoint.export import load_full_model, model_config_of
from trainer3d.data.doc_index import index_header_path, index_path, write_doc_index
from trainer3d.data.tokens import TokenizerInfo, read_header, write_token_file
from trainer3d.model.init import fill_parameters
from trainer3d.model.transformer import Transformer
from trainer3d.tools import score

VOCAB, EOS, SEQ = 64, 63, 32
LENGTHS = [1, 2, 9, 30, 17, 32, 70, 5, 12, 3, 25]  # 70 > SEQ: sliding; 32 == SEQ: a window of its own
INNER_EOS_DOC = 4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, rope_theta=10000.0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _documents():
    rng = np.random.default_rng(3)
    docs = [list(rng.integers(0, EOS, n - 1)) + [EOS] for n in LENGTHS]
    docs[INNER_EOS_DOC][5] = EOS  # inside the text: not a boundary
    return docs


def _token_file(tmp_path, docs, index=True):
    path = write_token_file(tmp_path / "docs.bin", np.concatenate(docs), VOCAB, TokenizerInfo("test", "x"), EOS)
    if index:
        write_doc_index(path, np.cumsum([0] + [len(d) for d in docs[:-1]]), read_header(path))
    return path


def _hf_nll(model, ids):
    """-sum log p over a document alone; a longer one by the perplexity guide's strided loop
    (transformers docs/source/en/perplexity.md: stride = max_length / 2, each window scoring
    only what the previous did not)."""
    ids = torch.tensor(ids)[None]
    total, prev_end, n = 0.0, 0, ids.shape[1]
    for begin in range(0, n, SEQ // 2):
        end = min(begin + SEQ, n)
        trg = end - prev_end
        with torch.no_grad():
            logits = model(ids[:, begin:end]).logits[0, :-1]
        nll = F.cross_entropy(logits, ids[0, begin + 1:end], reduction="none").double()
        total += float(nll[-trg:].sum()) if begin else float(nll.sum())
        prev_end = end
        if end == n:
            break
    return total


def _run(capsys, *args):
    assert score.main([str(a) for a in args]) == 0
    return capsys.readouterr()


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_packed_and_alone_equal_transformers_per_document(tmp_path, hf_dir, capsys):
    docs = _documents()
    data = _token_file(tmp_path, docs)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected = [_hf_nll(model, d) for d in docs]
    results = {}
    for mode in ("packed", "alone"):
        out = tmp_path / f"{mode}.jsonl"
        flags = ["--no-pack"] if mode == "alone" else []
        printed = _run(capsys, hf_dir, "--data", data, "--seq-len", SEQ, "--out", out, *flags)
        results[mode] = _lines(out)
        assert [r["doc"] for r in results[mode]] == list(range(len(docs)))
        assert [r["tokens"] for r in results[mode]] == LENGTHS
        assert [r.get("window") for r in results[mode]] == [SEQ if n > SEQ else None for n in LENGTHS]
        assert results[mode][0]["nll"] == 0.0  # a one-token document predicts nothing
        np.testing.assert_allclose([r["nll"] for r in results[mode]], expected, rtol=1e-5, atol=1e-6)
        ppl = math.exp(sum(expected) / sum(n - 1 for n in LENGTHS))
        summary = printed.out.strip().splitlines()[-1]
        assert f"{len(docs)} documents, {sum(LENGTHS) - len(docs)} tokens predicted" in summary
        assert abs(float(summary.split("corpus perplexity ")[1].split()[0]) - ppl) <= 1e-4 * ppl
    np.testing.assert_allclose([r["nll"] for r in results["packed"]], [r["nll"] for r in results["alone"]],
                               rtol=1e-5, atol=1e-6)


def test_a_file_without_index_splits_at_end_of_document_ids_and_says_so(tmp_path, hf_dir, capsys):
    docs = _documents()
    data = _token_file(tmp_path, docs, index=False)
    printed = _run(capsys, hf_dir, "--data", data, "--seq-len", SEQ, "--out", tmp_path / "s.jsonl")
    notes = [line for line in printed.err.splitlines() if "document index" in line]
    assert len(notes) == 1 and "end-of-document id 63" in notes[0]
    split = docs[INNER_EOS_DOC][:6], docs[INNER_EOS_DOC][6:]  # the inner id ends a document here
    lengths = [len(d) for d in docs[:INNER_EOS_DOC]] + [len(split[0]), len(split[1])] + [
        len(d) for d in docs[INNER_EOS_DOC + 1:]]
    assert [r["tokens"] for r in _lines(tmp_path / "s.jsonl")] == lengths


def test_refusals_name_the_file_and_the_fix(tmp_path, hf_dir, capsys, monkeypatch):
    docs = _documents()
    data = _token_file(tmp_path, docs)
    out = tmp_path / "s.jsonl"
    write_token_file(data, np.concatenate(docs[1:]), VOCAB, TokenizerInfo("test", "x"), EOS)  # the index is stale
    with pytest.raises(SystemExit, match=r"docs\.docs\.json: made for other ids.*prepare_data"):
        score.main([str(hf_dir), "--data", str(data), "--out", str(out)])
    with pytest.raises(SystemExit, match=r"--seq-len 65: give 2 \.\. 64"):
        score.main([str(hf_dir), "--data", str(data), "--seq-len", "65", "--out", str(out)])
    index_path(data).unlink()
    index_header_path(data).unlink()
    # the free memory is injected: the refusal, not this machine, is under test
    monkeypatch.setattr(score, "available_memory", lambda: 1000)  # bytes: less than the tiny model's
    with pytest.raises(SystemExit, match=rf"{hf_dir} has [\d,]+ parameters: .* GiB available; run it on a machine"):
        score.main([str(hf_dir), "--data", str(data), "--out", str(out)])
    assert not out.exists()
    assert score.main([str(hf_dir), "--data", str(data), "--out", str(ROOT)]) == 2  # a directory
    assert "score: " in capsys.readouterr().err


def test_a_megatron_dataset_is_scored_by_its_own_index(tmp_path, hf_dir, capsys):
    docs = _documents()
    write_megatron(tmp_path / "web_text_document", [[d] for d in docs])
    prefix, out = str(tmp_path / "web_text_document"), tmp_path / "m.jsonl"
    with pytest.raises(SystemExit, match="Megatron-LM dataset.*give --eos-id"):
        score.main([str(hf_dir), "--data", prefix, "--out", str(out)])
    _run(capsys, hf_dir, "--data", prefix, "--eos-id", EOS, "--seq-len", SEQ, "--out", out)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert [r["tokens"] for r in _lines(out)] == LENGTHS  # the inner end-of-document id cuts nothing
    np.testing.assert_allclose([r["nll"] for r in _lines(out)], [_hf_nll(model, d) for d in docs],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_scores_as_its_own_model_and_refuses_another_tokenizers_data(tmp_path, capsys):
    """A one-step run of a tiny model on a token file, its final checkpoint scored: each document
    equals the checkpoint's weights in a plain Transformer over the document alone (the model's
    own causal attention, no packing); a file of another tokenizer is refused naming both."""
    docs = _documents()
    data = _token_file(tmp_path, docs)
    train_in_ranks(tmp_path / "run", ["parallel=single", "model=tiny", f"model.vocab_size={VOCAB}",
                                      "model.max_seq_len=64", "data=tokens", f"data.path={data}",
                                      "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2",
                                      "train.max_steps=1", "train.eval_every=0", "train.dtype=fp32"], timeout=540)
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    info = store.read_marker(checkpoint)
    model = Transformer(model_config_of(info["config"]))
    tensors = load_full_model(checkpoint)
    fill_parameters(model, lambda name, shape, shard: tensors[name])
    out = tmp_path / "c.jsonl"
    _run(capsys, checkpoint, "--data", data, "--seq-len", SEQ, "--out", out)
    with torch.no_grad():
        ids = [torch.from_numpy(np.asarray(d, dtype=np.int64)) for d in docs if len(d) <= SEQ]
        want = [float(F.cross_entropy(model(i[None])[0, :-1].float(), i[1:], reduction="sum")) for i in ids]
    got = [r["nll"] for r in _lines(out) if r["tokens"] <= SEQ]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    other = write_token_file(tmp_path / "other.bin", np.concatenate(docs), VOCAB, TokenizerInfo("other", "y"), EOS)
    with pytest.raises(SystemExit, match=rf"{other} was made with tokenizer other, but checkpoint {checkpoint} was "
                                         r"trained on data of test: tokenise"):
        score.main([str(checkpoint), "--data", str(other), "--out", str(tmp_path / "o.jsonl")])
