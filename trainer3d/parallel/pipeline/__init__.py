"""Pipeline parallelism: ``stages`` splits the layers into stages (``parallel.pp_layers`` or
balanced) and keeps this rank's; ``schedule`` runs a step's micro-batches through torch's
``torch.distributed.pipelining`` schedules (1F1B, interleaved, GPipe) and hands the losses
to the trainer; ``bubble`` measures each stage's idle time and gives the schedule's
theoretical bubble.
"""
