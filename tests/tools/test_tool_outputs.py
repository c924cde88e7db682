"""Every user tool that writes an output (trainer3d/tools/output.py): one that is a file where a
directory goes, a link to nothing, or one of its own inputs is refused in one line naming the
path, exit non-zero, no traceback, the input untouched; an earlier output is never mixed with
a new one (refused, or replaced whole with --force); plot_metrics and parity read a torn last
metrics.jsonl row as a resume does, and parity never compares runs it did not make.

The tools run in this process through their ``main(argv)`` (each is an argparse command):
what is tested is the check and the publishing, not the interpreter's start."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.support.megatron_files import write_megatron
from tests.support.runs import PARITY, train_in_ranks
from trainer3d.checkpoint import store
from trainer3d.tools import export_model, import_megatron, output, parity, plot_metrics, prepare_data, score


def _run(tool, argv, capsys):
    code = tool.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _metrics(run: Path, rows=3, torn=False) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0}) + "\n" for s in range(rows))
    (run / "metrics.jsonl").write_text(text + ('{"step": 3, "loss": 4.' if torn else ""))
    return run


# tool, argv given (the output path, the scratch dir), whether the output is a directory
TOOLS = {
    "prepare_data": (prepare_data, lambda out, tmp: ["--out", out, _text(tmp)], False),
    "import_megatron": (import_megatron, lambda out, tmp: [_megatron(tmp), "--out", out, "--vocab-size", 100,
                                                           "--eos-id", 0], False),
    "export_model": (export_model, lambda out, tmp: [tmp / "checkpoint", out], True),
    "plot_metrics": (plot_metrics, lambda out, tmp: [_metrics(tmp / "run"), "--out", out], True),
    "parity": (parity, lambda out, tmp: ["parallel.dp=2", "--out", out], True),
    "score": (score, lambda out, tmp: [tmp / "checkpoint", "--data", tmp / "val.bin", "--out", out], False),
}


def _text(tmp: Path) -> Path:
    (tmp / "corpus").mkdir(exist_ok=True)
    (tmp / "corpus" / "a.txt").write_text("hello world\n" * 10)
    return tmp / "corpus"


def _megatron(tmp: Path) -> Path:
    prefix = tmp / "web_text_document"
    if not prefix.with_suffix(".idx").exists():
        write_megatron(prefix, [[[1, 2, 3]], [[4, 5]]], dtype=np.uint16)
    return prefix


def _one_line(err: str, path) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and str(path) in lines[-1], err


@pytest.mark.parametrize("name", TOOLS)
def test_an_output_where_the_other_kind_of_path_is_is_refused(name, tmp_path, capsys):
    """A file where a directory goes, a directory where a file goes."""
    tool, argv, is_dir = TOOLS[name]
    (tmp_path / "checkpoint").mkdir()
    out = tmp_path / ("a-file" if is_dir else "a-dir.bin")
    out.write_text("x") if is_dir else out.mkdir()
    code, err = _run(tool, argv(out, tmp_path), capsys)
    assert code != 0
    _one_line(err, out)
    assert (out.read_text() == "x") if is_dir else not any(out.iterdir())


@pytest.mark.parametrize("name", TOOLS)
def test_a_dangling_link_as_the_output_is_refused(name, tmp_path, capsys):
    tool, argv, _ = TOOLS[name]
    (tmp_path / "checkpoint").mkdir()
    out = tmp_path / "link.bin"
    out.symlink_to(tmp_path / "nowhere")
    code, err = _run(tool, argv(out, tmp_path), capsys)
    assert code != 0 and "does not exist" in err
    _one_line(err, out)
    assert out.is_symlink() and not (tmp_path / "nowhere").exists()


def test_import_megatron_never_writes_over_its_own_dataset(tmp_path, capsys):
    prefix = _megatron(tmp_path)
    before = {p: p.read_bytes() for p in (prefix.with_suffix(".bin"), prefix.with_suffix(".idx"))}
    for out in (prefix.with_suffix(".bin"), prefix.with_suffix(".idx")):
        code, err = _run(import_megatron, [prefix, "--out", out, "--vocab-size", 100, "--eos-id", 0], capsys)
        assert code != 0 and "is also an input" in err, err
    assert {p: p.read_bytes() for p in before} == before


def test_score_never_writes_over_its_data_or_into_its_model(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    data = tmp_path / "val.bin"
    data.write_bytes(b"ids")
    for out in (data, tmp_path / "model" / "scores.jsonl"):
        code, err = _run(score, [tmp_path / "model", "--data", data, "--out", out], capsys)
        assert code == 2
        _one_line(err, out)
    assert data.read_bytes() == b"ids" and not any((tmp_path / "model").iterdir())


def test_prepare_data_never_writes_inside_an_input_directory(tmp_path, capsys):
    corpus = _text(tmp_path)
    code, err = _run(prepare_data, ["--out", corpus / "corpus.bin", corpus], capsys)
    assert code != 0 and "lies inside the input" in err, err
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]


def test_export_never_writes_into_its_checkpoint(tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "piece").write_text("x")
    for out, why in ((checkpoint, "is also an input"), (checkpoint / "hf", "lies inside the input"),
                     (tmp_path, "holds the input")):
        code, err = _run(export_model, [checkpoint, out, "--force"], capsys)
        assert code == 2 and why in err, err
    assert [p.name for p in checkpoint.iterdir()] == ["piece"]


def test_plot_metrics_never_draws_over_an_input(tmp_path, capsys):
    metrics = _metrics(tmp_path / "run") / "metrics.jsonl"
    named_like_a_plot = tmp_path / "plots" / "loss.png"
    named_like_a_plot.parent.mkdir()
    os.replace(metrics, named_like_a_plot)
    code, err = _run(plot_metrics, [named_like_a_plot, "--out", named_like_a_plot.parent], capsys)
    assert code == 2 and "is also an input" in err, err
    assert named_like_a_plot.read_text().startswith('{"step": 0')


def test_plot_metrics_skips_a_torn_last_row_as_a_resume_does(tmp_path, capsys):
    run = _metrics(tmp_path / "run", rows=3, torn=True)
    code, err = _run(plot_metrics, [run, "--out", tmp_path / "plots"], capsys)
    assert code == 0 and "skipped 1 line(s)" in err and "Traceback" not in err, err
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "plots").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_parity_never_compares_runs_it_did_not_make(tmp_path, capsys):
    """An --out holding an earlier check's runs is refused before anything runs; --force
    empties it (the runs it then makes are the only ones it reads: not run here)."""
    out = tmp_path / "parity"
    for name in ("a", "b"):
        _metrics(out / name)
    code, err = _run(parity, ["parallel.dp=2", "--out", out], capsys)
    assert code == 2 and "--force" in err, err
    _one_line(err, out)
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    code, err = _run(parity, ["parallel.dp=2", "--out", out, "--reuse-b", out / "b"], capsys)
    assert code == 2 and "holds the input" in err, err
    assert parity.read_losses(_metrics(tmp_path / "torn", rows=3, torn=True)) == [5.0, 4.0, 3.0]


def test_a_directory_is_published_whole_or_not_at_all(tmp_path):
    """output.new_dir: a failure leaves the earlier directory as it was and no temporary; a
    success replaces it whole (nothing of the earlier one stays)."""
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("earlier")
    (out / "model-00001-of-00002.safetensors").write_text("earlier")
    with pytest.raises(RuntimeError):
        with output.new_dir(out) as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("killed mid-way")
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    with output.new_dir(out) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()


def test_a_file_is_published_whole_or_not_at_all(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("earlier")
    with pytest.raises(RuntimeError):
        with output.new_file(out) as tmp:
            tmp.write_text("ha")
            raise RuntimeError("killed mid-way")
    assert out.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    with output.new_file(out) as tmp:
        tmp.write_text("new")
    assert out.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_export_over_an_earlier_one_is_refused_or_replaces_it_whole(tmp_path, capsys):
    """A sharded trainer3d-format export, then a one-file Hugging Face export into the same
    directory: refused without --force (the earlier files as they were); with it, the directory
    holds exactly what the same export writes into an empty directory (no stale index or shard
    of the earlier one, which transformers would follow)."""
    run = tmp_path / "run"
    train_in_ranks(run, [*PARITY, "train.max_steps=1", "parallel=single", "checkpoint.save_final=true"])  # read below
    checkpoint = store.step_dir(run / "checkpoints", 1)
    out, fresh = tmp_path / "export", tmp_path / "fresh"
    code, err = _run(export_model, [checkpoint, out, "--format", "trainer3d", "--max-shard-gb", 0.0005], capsys)
    assert code == 0, err
    earlier = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in earlier, earlier
    code, err = _run(export_model, [checkpoint, out], capsys)
    assert code == 2 and "--force" in err, err
    assert sorted(p.name for p in out.iterdir()) == earlier
    assert _run(export_model, [checkpoint, out, "--force"], capsys)[0] == 0
    assert _run(export_model, [checkpoint, fresh], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert "model.safetensors.index.json" not in {p.name for p in out.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "fresh", "run"]  # no temporaries left
