"""The rank: what runs in each rank's own process, around the training loop.

``task`` is what submitit runs in every task (``TrainTask``: the torch.distributed
environment, then ``body``: the process group with an explicit timeout, the layout, the
planner's predicted step, then ``trainer.Trainer``; a rank started in place runs the same;
``task`` imports no torch, as the submitting process pickles ``TrainTask``); ``heartbeat`` the
file each rank rewrites every second, which the submitting process follows; ``owner`` the
watch that stops a local job's ranks when the process that started them is gone;
``preemption`` what the ranks do after the agreed stop (trainer3d/checkpoint/stop.py):
requeue through submitit or exit; ``runlock`` one run per run dir (rank 0 takes it where no
submitting process holds it); ``resume`` the command that resumes a stopped run;
``master_port`` the port of rank 0's store; ``job_token`` the mark a local job's processes
carry. The submitting process (trainer3d/launch/) reads the heartbeat, the lock, the token
and the resume command from here. May import ``trainer``, ``plan``, ``checkpoint``,
``observe``, ``parallel``, ``cpu`` (CPU ranks' malloc settings) and ``config``.
"""
