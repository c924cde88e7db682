"""Launch: turning a validated config into running ranks, and keeping the job honest.

``launch`` submits through submitit (local processes, or in place inside an allocation) and is
each rank's body (``TrainTask``: process group, then ``trainer.Trainer``); ``slurm`` and
``sweep`` the Slurm launcher and ``-m`` reports; ``follow`` watches a running job through the
ranks' ``heartbeat`` files; ``interrupt`` ends a job's processes on the submitter's signals;
``preemption`` is the agreed stop at a step boundary; ``runlock`` one run per run dir;
``rundir`` an unwritable or full run dir refused before Hydra writes to it;
``failure`` a rank's real cause in one line; ``master_port`` the port of rank 0's store;
``threads`` each rank's CPU threads from its affinity mask; ``memory_check`` a run that does not fit refused
before launch; ``device_check`` and ``requirements`` the
machine's devices and torch, checked before launch and in each rank; ``local_ranks`` a
function on N gloo ranks of this machine (benchmarks, tests). May import ``config``, ``cpu``
(``malloc``: CPU ranks keep their freed memory), ``parallel.topology`` and, for
``memory_check``, the dry run's accounting (``memory``, ``parallel.pipeline.stages``); the
engine only through ``trainer``.
"""
