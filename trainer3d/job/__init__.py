"""CPU ranks' malloc settings (``host_malloc``), bound for the CPU-only package (issue 38, item 1);
nothing else runs here. May import nothing of trainer3d.
"""
