#!/usr/bin/env python
"""The planner against published large training runs: for each run of
trainer3d/plan/published.py (Megatron-LM 2021 Table 1, Korthikanti et al. 2022, MT-NLG 530B,
BLOOM 176B, Llama 3 405B; held out: H100 runs of MosaicML and torchtitan), its published layout evaluated as ``plan.evaluate=true`` would,
the published throughput against the predicted one, and whether the layout fits.

    python tools/bench/published_runs.py              # the markdown table of docs/planning.md
    python tools/bench/published_runs.py --commands   # each run's plan.evaluate=true command

Nothing runs on a GPU: the figures are the sources', the predictions the planner's.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer3d.plan.published import RUNS, SHORT, Check, check, command  # noqa: E402


def layout(c: Check) -> str:
    r = c.run
    parts = [f"tp{r.tp}" + (f" cp{r.cp}" if r.cp > 1 else "") + f" pp{r.pp} dp{r.gpus // (r.tp * r.cp * r.pp)}", f"micro {r.micro}", f"batch {r.global_batch}"]
    parts += (["SP"] if r.sp else []) + (["recompute"] if r.recompute else []) + [r.attention]
    parts += [f"ZeRO-{r.zero_stage} (FSDP)"] if r.zero_stage >= 2 else []
    return ", ".join(parts)


def published(c: Check) -> str:
    unit = {"tflops_recompute": "TFLOP/s", "iteration_s": "s/iteration", "model_tflops": "model TFLOP/s",
            "tokens_per_s": "tokens/s/GPU"}[c.run.unit]
    return f"{c.run.published:g} {unit}"


def row(c: Check) -> str:
    fits = "yes" if c.fits else f"no ({c.peak_bytes / 2 ** 30:.0f} GiB)"
    return (f"| {SHORT[c.run.source]} | {c.run.name} | {layout(c)} | {c.run.gpus} {c.run.gpu} | {published(c)} | {c.published:,.1f} | "
            f"{c.predicted:,.1f} | {c.error:+.1%} | {fits} |")


HEAD = ("| source | run | published layout | GPUs | published | tokens/s/GPU published | predicted | error | fits |\n"
        "|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commands", action="store_true", help="print each run's plan.evaluate=true command")
    args = parser.parse_args()
    if args.commands:
        for run in RUNS:
            print(f"# {run.name}\n{command(run)}")
        return
    print(HEAD)
    for run in RUNS:
        print(row(check(run)))
    print("\nSources:\n" + "\n".join(f"- {short}: {full}" for full, short in SHORT.items()))


if __name__ == "__main__":
    main()
