"""Persist: distributed checkpoints that are atomic, verified and layout-free.

``manager`` is what the trainer calls (save at an interval, resume, retention); ``saver``
writes and publishes one checkpoint, in the loop or in a background thread (``staging``: the
host copies a background save writes from); ``verify`` shares the hashing of a checkpoint's
data among the ranks that load it; ``state``
this rank's part as a DCP state dict, every tensor under its 1-rank name in its full shape
(``chunks``: where this rank's piece sits), so any layout resumes any other; ``store`` the
directories (``step_N.partial`` renamed into place with a sealed marker), discovery and
integrity; ``writer`` and ``digest`` DCP's writer with checksums taken as bytes go to disk;
``metadata`` and ``reader`` the restricted reading of checkpoints that may not be trusted
(an allow-listed unpickler, tensor entries only); ``choose`` which checkpoint a run resumes
and whether it is the same model; ``lineage`` whose it is (run, branch) and what it was
trained on (data identity, samples consumed); ``precision`` resuming across ``train.dtype``; ``export``
a checkpoint's model for use elsewhere; ``stop`` the agreed stop at a step boundary when Slurm
warns the job, so every rank saves at the same step; ``interval`` ``checkpoint.every=auto``
(Young/Daly from measured save costs); ``rollback`` the checkpoint a loss-spike rollback
restores, newer ones set aside. May import ``config``, ``model``, ``data`` (the identity of
the data a checkpoint records), ``optim``, ``hf``, ``parallel`` and ``observe`` (a failed
write's cause in one line). Nothing above it: the loop calls it, and the rank's body acts on a stop.
"""
