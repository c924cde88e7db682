"""Observe: what a running job tells its user.

``metrics`` collects each step's figures on device, reads them at the log interval (the
loop's only host sync) and writes ``metrics.jsonl`` and the progress line; ``telemetry`` the
figures around the math (process memory, communication time, the device's peak rate);
``loggers`` the sinks beside the file (console, wandb, TensorBoard); ``profile`` the
``train.profile`` window's torch.profiler trace and CUDA memory snapshot; ``nonfinite`` the device-side watch
for a non-finite loss or gradient norm; ``spikes`` the loss-spike watch (median/MAD of recent
steps, the decision agreed over the ranks); ``stragglers`` the straggler watch (each rank's
compute against its stage peers', gathered at the log interval); ``evaluate`` the held-out validation loss, forward
only through the same model and pipeline; ``failure`` what a failing rank or a failed write
says about itself, the real cause in one line (a full disk named). May import ``config``,
``model``, ``data``, ``optim`` (the parameter dtypes) and ``parallel``; the trainer calls it,
it never drives the step.
"""
