"""Pipeline parallelism: ``stages`` splits the layers into stages (``parallel.pp_layers`` or
balanced) and keeps this rank's; ``schedule`` runs a step's micro-batches through torch's
``torch.distributed.pipelining`` schedules (1F1B, interleaved, GPipe); ``buffers`` holds the
receive buffers of the micro-batches in flight only and ``receive_count`` how many a rank holds at
once (the memory estimate's count); ``losses`` is the record of the step's
losses the schedule fills and the trainer reads; ``bubble`` measures each stage's idle time
and gives the schedule's theoretical bubble.
"""
