"""Training and validation tokens.

    tokens.py     token files: the header (``read_header``, ``TokenHeader``), the streaming
                  writer (``TokenWriter``)
    tokenfile.py  ``TokenFile.open`` (memory-mapped, checked; a Megatron dataset in place)
    verify.py     the full scan (checksum, max id), once per version of a file
    corpus.py     the built-in corpus (this Python's standard library, byte-level)
    shuffle.py    a seeded bijection of range(n), one element at a time
    sampler.py    which windows each step reads: blending, shuffling, the validation split
    sources.py    the run's token files, weights and spans, from cfg.data
    loader.py     this rank's batches (only what it feeds), read ahead of the step; drill batches
    skips.py      the run dir's skipped_steps.json: the steps a run passes over, and why
    cp_sharding.py  the load-balanced split of a sequence over cp ranks: the positions each
                  rank reads (the loader) and attends from (parallel/context/)
    documents.py  the inputs of tools/prepare_data.py, streamed as documents
    doc_index.py  a token file's document index (<name>.docs): where each document starts,
                  written by prepare_data and import_megatron, checked against its token file
    segments.py   which document each input token of a window belongs to (data.document_mask)
    prepare.py    tools/prepare_data.py's engine: documents -> tokenizer -> token file
    chat.py       prepare_data --chat: conversations rendered with the tokenizer's chat template in
                  Jinja2's sandbox, the assistant's tokens found by prefix rendering
    loss_mask.py  the loss mask beside a token file (<name>.mask): written, checked, memory-mapped;
                  IGNORE_INDEX, the target the loss skips (data.loss_mask)
    chat_sample.py  the built-in conversations (chat_sample.jsonl) and their byte-level ChatML
                  tokenizer, rendered once into the cache (data=chat_sample)
    identity.py   what the run's data is, cheaply (header digests, sizes), as checkpoints record it
    megatron.py   a Megatron-LM indexed dataset (.bin + .idx), checked: read in place as a token
                  file's ids (``DocumentStream``), or written as one (tools/import_megatron.py)

Other code reads a token file's facts through ``read_header(path)``: ``vocab_size``,
``max_id``, ``eos_id``, ``tokenizer.path`` (the tokenizer.json to copy beside an exported
model) and ``tokenizer.sha256``. The checks of a run's data before launch are
trainer3d/preflight/data_checks.py. May import ``config``.
"""

from trainer3d.data.corpus import BYTE_LEVEL, BYTE_VOCAB, EOF_TOKEN, byte_tokens, stdlib_corpus
from trainer3d.data.tokenfile import TokenFile
from trainer3d.data.tokens import TokenFileError, TokenHeader, TokenizerInfo, TokenWriter, read_header, write_token_file

# Only numpy-level modules are imported here, so tools/prepare_data.py starts without torch;
# the trainer imports trainer3d.data.loader itself.
__all__ = ["BYTE_LEVEL", "BYTE_VOCAB", "EOF_TOKEN", "TokenFile", "TokenFileError", "TokenHeader", "TokenWriter",
           "TokenizerInfo", "byte_tokens", "read_header", "stdlib_corpus", "write_token_file"]
