"""Hugging Face Llama and Mixtral checkpoints in and out.

- ``mapping``: the one table between trainer3d and transformers' Llama — parameter names and
  config.json fields — read in both directions;
- ``mixtral``: what Mixtral adds (the router, per-expert weights stored transposed, model.moe's
  config.json fields, the sliding window);
- ``files``: reading an untrusted safetensors directory (JSON and safetensors headers only,
  sizes bounded, index entries confined to the directory) and writing a sharded one;
- ``check``: ``model.init_from`` before launch — the model section from config.json, every
  refusal as one line naming the field or file;
- ``source``: the parameter source each rank fills its own slices from (``safe_open`` +
  ``get_slice``, never the whole model);
- ``export``: a trained model as a directory ``LlamaForCausalLM.from_pretrained`` loads.

Nothing here imports transformers: the formats are JSON and safetensors. May import
``config``, ``model`` and ``data`` (the byte-level vocabulary of an export).
"""
