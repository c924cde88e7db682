"""Preflight: the checks a run passes in the submitting process before any rank starts.

``refusal`` runs them in order and words a refusal (one line per problem naming the knob or
file, exit status 2); ``memory_check`` a run whose estimated peak does not fit the devices or
the host; ``data_checks`` everything knowable about the token files (vocabulary, ids, enough
windows for the steps); ``rundir`` the directories the ranks write, probed with a synced write
(and the Hydra callback that refuses a run dir before Hydra writes to it); ``requirements``
the oldest torch trainer3d runs on, checked when the package is imported. The config's own
rules are ``config.validate``'s, the device rules ``config.device``'s. May import ``config``,
``data``, ``memory`` and ``parallel`` (the pipeline's stages the estimate sums).
"""
