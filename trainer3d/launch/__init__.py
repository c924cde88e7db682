"""Launch: the submitting process, from a checked config to a running job and back.

``local`` starts one process per rank on this machine through submitit's local executor and
holds the run dir meanwhile; ``slurm`` submits one Slurm job (submitit's ``AutoExecutor``) and
says clearly why not; ``sweep`` the ``-m`` report (one line per point, Slurm points followed
at the end); ``follow`` watches a job through the ranks' heartbeat files, echoes rank 0's
progress and ends the job on a failed or silent rank; ``interrupt`` ends a job's processes
when this process is told to stop; ``local_ranks`` a function on N gloo ranks of this machine,
for benchmarks and tests. What each task runs is trainer3d/rank/ (``TrainTask``), submitted
from here and pickled by name. May import ``rank`` and ``config``.
"""
