"""Memory, counted in bytes before a run and measured in it.

``states`` the model states a rank holds (parameters, gradient buckets, optimizer shards:
the ZeRO paper's formulas and the engine's exact bytes); ``activations`` what autograd saves
per layer and per stage, term by term (docs/memory.md derives each); ``in_flight`` how many
micro-batches each stage holds at once under its pipeline schedule; ``moe`` a mixture-of-experts
block's terms and the model states under expert parallelism; ``peak`` a rank's peak
over a step under its pipeline schedule; ``muon_step`` the buffers of Muon's step (its tp
gather and Newton-Schulz); ``staged`` the host copy a background checkpoint
keeps; ``dry_run`` prints it all for ``dry_run=true``;
``meter`` measures saved activations with ``saved_tensors_hooks`` (what the estimate is held
to). May import ``config``, ``model`` and ``parallel`` (to build meta-device chunks and
stage plans); nothing imports it on a rank's hot path but ``meter``.
"""
