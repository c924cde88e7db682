#!/usr/bin/env python
"""How long ``model.init_from`` takes and how much host memory each rank needs, against the
checkpoint's size.

    python tools/bench/hf_import.py --make /tmp/llama-1b      # a random Llama-3.2-1B-shaped model, bf16 shards
    python tools/bench/hf_import.py /tmp/llama-1b --tp 2 --pp 2 --dtype bf16

``--make`` writes random weights with the shapes of Llama 3.2 1B (1.24B parameters, tied
embeddings, Llama-3 rope scaling) as bf16 safetensors shards with an index, one shard in
memory at a time. The measurement starts one process per rank of the layout, all at once
as a launch would, each running the trainer's own build (``build_model_chunks``: meta
model, stage split, tensor-parallel layers, materialisation, filling from the safetensors
slices) without a process group, and reports per rank: its parameters, the time the build
took, its peak resident memory (the kernel's high-water mark) above what the process held
before the build (torch imported), and after the build its resident memory split into
anonymous (the parameters it holds) and file-backed. The weights are read through mmap,
so the peak also counts the file pages a rank touched: shared, reclaimable page cache, not
memory the rank owns; a row-parallel slice touches the pages of every row of a tensor.
"""

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer3d.config.schema import Config  # noqa: E402
from trainer3d.tools import output  # noqa: E402
from trainer3d.hf.check import apply_init_from  # noqa: E402
from trainer3d.hf.mapping import hf_shapes, model_config  # noqa: E402
from trainer3d.parallel.parallelize import build_model_chunks  # noqa: E402
from trainer3d.memory.states import planning_dims  # noqa: E402

# Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json).
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}
GiB = 2 ** 30


def make(out: Path, shard_bytes: int = 500 * 2 ** 20) -> None:
    """Random bf16 weights of LLAMA_1B's shapes, written shard by shard."""
    out.mkdir(parents=True, exist_ok=True)
    shapes = hf_shapes(model_config(LLAMA_1B))
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=generator) * 0.02).to(torch.bfloat16) for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        total += sum(t.numel() * 2 for t in tensors.values())
        print(f"wrote {file} ({len(names)} tensors)", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(LLAMA_1B, indent=2))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss_split() -> tuple:
    """(anonymous, file-backed) resident bytes now: the process's own memory vs mapped file pages."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))


def _rank(directory: str, tp: int, pp: int, dtype: str, rank: int, results) -> None:
    torch.set_num_threads(1)
    cfg = Config()
    cfg.model.init_from = directory
    cfg = apply_init_from(cfg)
    cfg.parallel.tp, cfg.parallel.pp, cfg.train.dtype = tp, pp, dtype
    dims = dataclasses.replace(planning_dims(cfg, rank), device=torch.device("cpu"))
    before, anon_before = _peak_rss(), _rss_split()[0]
    started = time.perf_counter()
    chunks = build_model_chunks(cfg, dims)
    seconds = time.perf_counter() - started
    params = {p.data_ptr(): p for chunk in chunks for p in chunk.parameters()}.values()
    nbytes = sum(p.numel() * p.element_size() for p in params)
    anon, mapped = _rss_split()
    results.put((rank, dims.coords, sum(p.numel() for p in params), nbytes, seconds, before, _peak_rss(),
                 anon - anon_before, mapped))


def measure(directory: Path, tp: int, pp: int, dtype: str) -> None:
    files = sorted(directory.glob("*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    world = tp * pp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    started = time.perf_counter()
    procs = [ctx.Process(target=_rank, args=(str(directory), tp, pp, dtype, r, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    wall = time.perf_counter() - started
    print(f"{directory}: {len(files)} safetensors file(s), {file_bytes / GiB:.2f} GiB; "
          f"tp={tp} pp={pp}, {dtype} parameters, {world} ranks at once on {mp.cpu_count()} cores")
    print(f"{'rank':>4} {'(pp,dp,tp)':>10} {'params':>8} {'param GiB':>9} {'build s':>8} {'RSS before':>10} "
          f"{'peak RSS':>9} {'peak-before':>11} {'/ file':>6} {'anon added':>10} {'file pages':>10}")
    for rank, coords, numel, nbytes, seconds, before, peak, anon, mapped in rows:
        print(f"{rank:>4} {str(tuple(coords)):>10} {numel / 1e6:>7.0f}M {nbytes / GiB:>9.2f} {seconds:>8.1f} "
              f"{before / GiB:>10.2f} {peak / GiB:>9.2f} {(peak - before) / GiB:>11.2f} "
              f"{(peak - before) / file_bytes:>6.2f} {anon / GiB:>10.2f} {mapped / GiB:>10.2f}")
    print("(GiB; anon added: the process's own memory the build added; file pages: safetensors pages "
          "still mapped after it, page cache shared between ranks)")
    print(f"all ranks built in {wall:.1f} s wall (process start and imports included)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, nargs="?")
    parser.add_argument("--make", type=Path, help="write a random Llama-3.2-1B-shaped bf16 checkpoint here")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    args = parser.parse_args(argv)
    if args.make:
        try:
            out = output.check(args.make, directory=True)
        except output.OutputError as err:
            print(f"hf_import: {err}", file=sys.stderr)
            return 2
        with output.new_dir(out) as tmp:
            make(tmp)
    if args.directory:
        measure(args.directory, args.tp, args.pp, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
