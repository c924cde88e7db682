#!/usr/bin/env python
"""Data preparation throughput: tokens/s with 1 and N workers, and peak memory, on a generated corpus.

    python tools/bench/prepare.py                      # 1 GB of JSON Lines, 1 and 2 workers
    python tools/bench/prepare.py --gb 0.1 --workers 4

Generates ``--gb`` of synthetic text (documents of words drawn from a 20,000-word
vocabulary with Zipf-like frequencies) as one JSON Lines file in a temp dir, trains a
byte-level BPE of ``--vocab`` ids on its first ``--train-mb`` MB, then runs
``tools/prepare_data.py --tokenizer ...`` on the whole file with 1 and with ``--workers``
processes. For each run it prints the wall time, tokens/s, the speed-up over 1 worker,
tokens per CPU-second (user + system time of the tool and its workers: what the
throughput would be per core without other load) and the peak memory of the whole process
tree, sampled every 0.1 s from /proc: the sum of RSS (counts pages shared by forked workers
once per process) and the sum of PSS (shared pages split between their processes); and the
1-minute load average at the end of the run (other work on the machine slows wall time).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer3d.data import read_header  # noqa: E402


def generate(path: Path, n_bytes: int, seed: int = 0) -> int:
    """Write ~n_bytes of JSON Lines documents; return the bytes written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(20_000)])
    freq = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    written = 0
    with open(path, "w") as f:
        while written < n_bytes:
            lengths = rng.integers(100, 1500, size=512)  # words per document
            picks = rng.choice(len(words), size=int(lengths.sum()), p=freq / freq.sum())
            for doc in np.split(words[picks], np.cumsum(lengths)[:-1]):
                line = json.dumps({"text": " ".join(doc)}) + "\n"
                f.write(line)
                written += len(line)
    return written


def head(src: Path, dst: Path, n_bytes: int) -> None:
    """The first lines of ``src`` up to ~n_bytes (the tokenizer's training sample)."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        for line in f:
            out.write(line)
            n_bytes -= len(line)
            if n_bytes <= 0:
                return


def _tree(pid: int) -> list:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return pids


def _kib(path: str, key: str) -> int:
    try:
        for line in open(path):
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(cmd) -> dict:
    """Run ``cmd``; wall seconds, CPU seconds (user + system, workers included) and peak summed
    RSS / PSS (bytes) of its process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = {"rss": 0, "pss": 0}

    def sample():
        while proc.poll() is None:
            pids = _tree(proc.pid)
            peak["rss"] = max(peak["rss"], 1024 * sum(_kib(f"/proc/{p}/status", "VmRSS:") for p in pids))
            peak["pss"] = max(peak["pss"], 1024 * sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids))
            time.sleep(0.1)
    started = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    seconds = time.perf_counter() - started
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak["cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"bench_prepare: {' '.join(map(str, cmd))} failed:\n{out}")
    return {"seconds": seconds, **peak, "stdout": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (default 1.0)")
    parser.add_argument("--workers", type=int, default=2, help="N, the second run's workers (default 2)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    parser.add_argument("--train-mb", type=float, default=20.0, help="MB of the corpus the BPE trains on")
    parser.add_argument("--dir", help="work directory (default: a temp dir, removed at the end)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        started = time.perf_counter()
        size = generate(tmp / "corpus.jsonl", int(args.gb * 1e9))
        print(f"generated {size / 1e9:.2f} GB of JSON Lines in {time.perf_counter() - started:.0f} s")
        head(tmp / "corpus.jsonl", tmp / "sample.jsonl", int(args.train_mb * 1e6))
        tool = [sys.executable, str(ROOT / "tools" / "prepare_data.py")]
        trained = run_measured([*tool, "--out", tmp / "sample.bin", "--train-tokenizer", args.vocab,
                                tmp / "sample.jsonl"])
        tokenizer = tmp / "sample.tokenizer.json"
        print(f"trained a BPE of {args.vocab} ids on {(tmp / 'sample.jsonl').stat().st_size / 1e6:.0f} MB "
              f"in {trained['seconds']:.0f} s")
        print(f"{'workers':>7} {'seconds':>8} {'tokens':>14} {'tokens/s':>11} {'speed-up':>8} "
              f"{'tokens/cpu-s':>12} {'peak RSS':>9} {'peak PSS':>9}  load avg")
        base = None
        for workers in dict.fromkeys((1, args.workers)):
            out = tmp / f"w{workers}.bin"
            m = run_measured([*tool, "--out", out, "--tokenizer", tokenizer, "--workers", workers,
                              tmp / "corpus.jsonl"])
            n = read_header(out).n_tokens
            rate = n / m["seconds"]
            base = base or rate
            print(f"{workers:>7} {m['seconds']:>8.1f} {n:>14,} {rate:>11,.0f} {rate / base:>7.2f}x "
                  f"{n / m['cpu']:>12,.0f} {m['rss'] / 2**20:>5.0f} MiB {m['pss'] / 2**20:>5.0f} MiB  "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
