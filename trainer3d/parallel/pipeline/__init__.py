"""Pipeline parallelism: ``stages`` splits the layers into stages (``parallel.pp_layers`` or
balanced) and keeps this rank's, ``placement`` says which stages each rank runs (in order, or
in a V); ``schedule`` runs a step's micro-batches through torch's
``torch.distributed.pipelining`` schedules (1F1B, interleaved, GPipe, and the zero-bubble
zb1p, zbv, dualpipev, whose weight step ``weight_grad`` puts through the gradient path);
``buffers`` holds the receive buffers of the micro-batches in flight only and ``receive_count``
how many a rank holds at once (the memory estimate's count); ``losses`` is the record of the
step's losses the schedule fills and the trainer reads; ``bubble`` measures each stage's idle
time and gives the schedule's theoretical bubble; ``timeline`` takes torch's action lists and
runs them with unit costs (the zero-bubble bubble, the planner's and the tests').
"""
