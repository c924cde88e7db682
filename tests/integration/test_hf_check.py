"""Class: the Hugging Face pre-launch check is complete. Overlapping or stray tensor bytes,
zero heads without head_dim, JSON nested past the parser's recursion, a NaN or Inf in a weight,
a config.json declaring a million layers: each is one line before launch naming the file and
the tensor or key, in bounded memory."""

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_hf import _cfg, _refusal, make_hf
from trainer3d.hf.files import TensorInfo, first_nonfinite, read_header

DEEP = "[" * 100_000 + "]" * 100_000
NORM0, NORM1 = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"


def _split(file: Path):
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(file: Path, header, body: bytes) -> None:
    raw = (header if isinstance(header, bytes) else json.dumps(header).encode())
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _overlap(d: Path):
    header, body = _split(d / "model.safetensors")
    header[NORM1]["data_offsets"] = header[NORM0]["data_offsets"]
    _join(d / "model.safetensors", header, body)


def _trailing(d: Path):
    header, body = _split(d / "model.safetensors")
    _join(d / "model.safetensors", header, body + b"\0" * 64)


def _deep_header(d: Path):
    _, body = _split(d / "model.safetensors")
    _join(d / "model.safetensors", ('{"__metadata__": ' + DEEP + "}").encode(), body)


def _deep_config(d: Path):
    (d / "config.json").write_text('{"hidden_size": ' + DEEP + "}")


def _zero_heads(d: Path):
    config = json.loads((d / "config.json").read_text())
    config.pop("head_dim", None)
    config["num_attention_heads"] = 0
    (d / "config.json").write_text(json.dumps(config))


def _nan_weight(d: Path):
    header, body = _split(d / "model.safetensors")
    begin = header["model.layers.1.mlp.down_proj.weight"]["data_offsets"][0]
    body = bytearray(body)
    body[begin + 4 * 7:begin + 4 * 8] = struct.pack("<f", float("inf"))
    _join(d / "model.safetensors", header, bytes(body))


@pytest.mark.parametrize("spoil,expect", [
    (_overlap, f"model.safetensors: the bytes of {NORM1} overlap those of {NORM0}"),
    (_trailing, "model.safetensors: 64 byte(s) at the end belong to no tensor"),
    (_deep_header, "model.safetensors: the header nests lists or objects deeper than"),
    (_deep_config, "config.json nests lists or objects deeper than"),
    (_zero_heads, "config.json: num_attention_heads=0 must be a positive integer"),
    (_nan_weight, "model.safetensors: model.layers.1.mlp.down_proj.weight holds a NaN or Inf (element 7)"),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_a_bad_hf_directory_is_one_line_before_launch(tmp_path, monkeypatch, capsys, spoil, expect):
    directory = make_hf(tmp_path / "hf")
    spoil(directory)
    line = _refusal(_cfg(directory), monkeypatch, capsys)
    assert expect in line and "model.init_from" in line, line


def test_a_million_layers_are_refused_in_bounded_memory(tmp_path, monkeypatch, capsys):
    directory = make_hf(tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    tracemalloc.start()
    try:
        line = _refusal(_cfg(directory), monkeypatch, capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "config.json implies 9000003 tensors (1000000 layers), the weights hold" in line, line
    assert peak < 64 * 2 ** 20, f"{peak / 2 ** 20:.0f} MiB of Python objects to refuse"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nonfinite_scan_finds_the_first_bad_element_in_any_float_dtype(tmp_path, monkeypatch, dtype, bad):
    monkeypatch.setattr("trainer3d.hf.files.SCAN_ELEMENTS", 1000)  # several chunks
    t = torch.randn(5000, dtype=torch.float32).clamp(-60000, 60000).to(dtype)
    save_file({"a": torch.ones(3, dtype=dtype), "w": t}, str(tmp_path / "x.safetensors"))
    assert first_nonfinite(read_header(tmp_path / "x.safetensors")["w"]) is None
    t[4321] = bad
    t[4999] = bad
    save_file({"a": torch.ones(3, dtype=dtype), "w": t}, str(tmp_path / "x.safetensors"))
    info: TensorInfo = read_header(tmp_path / "x.safetensors")["w"]
    assert first_nonfinite(info) == 4321
