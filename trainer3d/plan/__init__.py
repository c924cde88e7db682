"""The layout planner (``python -m trainer3d.plan``): which tp x pp x dp x micro-batch x ZeRO
stage x sequence parallelism x recomputation x virtual stages (x expert parallelism for MoE) fits a model on a cluster, and
which is fastest.

    settings.py    cluster.* and search.* on top of the training schema
    composed.py    their registration in Hydra's ConfigStore, imported where ``plan`` is composed (a rank composes nothing)
    knobs.py       their ranges and choices, checked with the training knobs' before a search
    devices.py     device presets (with their sources) and calibration files
    calibrate.py   --calibrate: this machine's matmul rate, memory bandwidth, collectives
    calibrate_ranks.py  the processes --calibrate measures the node with, their server (torch and the engine, once), their bounded wait
    calibrate_gpu.py  --calibrate on CUDA: the GPU's preset with its matmul rate and bandwidth measured
    step_time.py   the step-time model: the pipeline's slots and bubble, data-parallel communication, optimizer
    micro_batch_time.py  one micro-batch's forward and backward on a pipeline rank, by term
    offload_cost.py  the offloaded optimizer's term
    links.py       which link a group's collectives cross; what overlapping them costs the compute
    block_time.py  one block's forward and backward by term
    moe_cost.py    an MoE block's extra terms: the experts' GEMMs, the all-to-alls, the experts' gradients
    kernels.py     GPU kernels by shape: GEMMs, attention, launches (with their sources)
    probe.py       the engine's ranks on a layout, started here: --calibrate's fixed costs
    search.py      enumerate, validate(), fit (trainer3d/memory/peak.py), time, rank
    expert_search.py  the ep degrees tried, and the ep layouts validate() refuses until ep is built
    evaluate.py    plan.evaluate=true: one given layout, every term, a JSON last line
    report.py      the table and the training commands
    published.py   published large runs and the planner's prediction of each
    predict.py     a running rank's device preset and the predicted step its goodput is split by

May import ``config``, ``model``, ``parallel``, ``memory`` and ``observe`` (goodput's prediction).
"""
