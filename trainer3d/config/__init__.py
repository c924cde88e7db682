"""Compose and validate: what a run is, before anything starts.

``schema`` holds the typed dataclasses Hydra's ConfigStore registers (every field documented;
``conf/`` only selects and overrides them), joining and re-exporting the sections kept in
their own modules: ``schema_model`` (``model.*``, rotary scaling), ``schema_parallel``
(``parallel.*``), ``schema_train`` (``train.*``, ``optim.*``) and ``schema_run`` (``data.*``,
``launcher.*``, ``logger.*``, ``checkpoint.*``); ``composed`` their registration in Hydra's
ConfigStore and the check of a composed config's keys, imported where the config is composed
(the schema imports no Hydra: a rank composes nothing); ``knobs`` every field's range or choices;
``validate`` the rules of a layout as a pure function, run in the submitting process and
naming the knob to change, with the rules of one concern each in ``validate_pipeline``
(``parallel.pp*``, and the batch set a refusal proposes), ``validate_data``, ``validate_moe``
and ``validate_optim``; ``jsonfile`` the size-bounded reader of JSON objects the run did
not write (token headers, Hugging Face config and index files); ``rows`` the one reader of
metrics.jsonl, which skips a torn last line as a resume does; ``secrets`` the redaction of
credentials, by key and by value, from every record of a config (.hydra/, markers, wandb);
``defaults_used`` the knobs sizing memory and time a command left at their defaults (the dry
run names them); ``command_line`` the one-line refusal (exit 2) of overrides that do not
compose, with the nearest known keys, shared by every entry point; ``help`` and ``conf_dir`` the ``--help`` page and where conf/ is; ``extras``
the optional packages and the line that says how to install one; ``device`` which device
the ranks run on, decided from the config (its pure rules in ``validate()``, the machine's GPUs
before launch, CUDA inside each rank); ``parent_death`` a process's request to die with its
parent (prctl(2)), which the ranks of a local job and the planner's probe ranks make. May import nothing of trainer3d: every other package
reads the config.
"""
