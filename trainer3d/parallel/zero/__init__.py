"""Data parallelism with ZeRO (Rajbhandari et al. 2020). ``optimizer`` is the contract every
stage implements (the trainer and the checkpointer see only it); ``flat`` stages 0 and 1 on
flat fp32 buffers; ``buckets`` those buffers and the bucketed gradient reduction that
overlaps backward; ``param_gather`` stage 1's parameter all-gather overlapped with the next
forward; ``offload`` stages 0 and 1 with the optimizer state and step on the host
(``parallel.offload_optimizer``), whose AdamW step is ``host_kernel``'s compiled kernel
(host_adamw.cpp); ``fsdp`` stages 2 and 3 through FSDP2's ``fully_shard`` (pp = 1 only);
``fsdp_offload`` stages 2 and 3 with the shards and the step on the host (FSDP2's ``CPUOffloadPolicy``);
``host_scalars`` the clip divisor and fp16 skip flag both offloaded steps read on the host.
"""
