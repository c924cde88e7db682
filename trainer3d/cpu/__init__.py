"""CPU ranks: what makes training on a laptop's or a test machine's cores keep pace, kept out
of the model's math and the parallel engine (neither needs it to be right; a GPU run never
reaches it).

``ops`` registers the fused fp32 kernels of ``kernels`` (RMSNorm, RoPE, SwiGLU; plain C++ in
kernels.cpp) as the CPU implementation of the model's operators (model/functional.py); it runs
when this package is imported. ``shm`` is ZeRO's dp collectives through shared memory among the
CPU ranks of one host (``ShmCollectives``, one implementation of parallel/comm.py's
``Collectives``), with the barrier of ``shm_barrier`` (shm_barrier.cpp). ``malloc`` keeps freed
memory in a CPU rank's heap. ``build`` is the package's one way to build C++ (also for
ZeRO-Offload's host AdamW, parallel/zero/host_kernel.py); ``build_dir`` its lock, which dies
with its holder, and the check that no one else could have written a build before it is loaded. docs/performance.md has what each
buys. ``TRAINER3D_CPU_KERNELS=0`` turns the kernels off, ``TRAINER3D_SHM_COLLECTIVES=0`` the
shared-memory collectives.

May import ``model`` (the operators it implements) and torch; nothing above it.
"""

from trainer3d.cpu import ops  # noqa: F401 - registers the CPU kernels of the model's operators
