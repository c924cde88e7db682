"""The user tools, installed as commands (pyproject.toml ``[project.scripts]``) and runnable as
``python -m trainer3d.tools.<name>`` or, from a checkout, ``python tools/<name>.py``:

    prepare_data     trainer3d-prepare-data      text -> a token file (docs/data.md)
    import_megatron  trainer3d-import-megatron   a Megatron-LM indexed dataset -> a token file
    sample           trainer3d-sample            text from a checkpoint or an export
    export_model     trainer3d-export-model      a checkpoint -> a Hugging Face directory
    plot_metrics     trainer3d-plot-metrics      curves of runs (the ``plot`` extra)
    plot_schedule    trainer3d-plot-schedule     pipeline schedules' timelines (the ``plot`` extra)
    parity           trainer3d-parity            two layouts' per-step losses compared
    score            trainer3d-score             per-document log-losses of a token file under a model
    gpu_check        trainer3d-gpu-check         a GPU node's first check: the GPU tier, resume, MFU, the planner

Each is a ``main(argv=None) -> int`` over argparse; the developer's benchmarks stay in tools/bench/.
Every output a tool (or a benchmark) writes goes through ``output``: never one of its inputs,
one line for a wrong path, written beside the target and published whole.
May import ``config``, ``model``, ``data``, ``hf``, ``checkpoint``, ``plan`` (gpu_check) and
``parallel`` (plot_schedule draws parallel/pipeline/timeline.py's action lists).
"""
