"""Placeholder for the CPU ranks' malloc settings (``host_malloc``), which move to the CPU-only
package (issue 38, item 1). May import nothing of trainer3d.
"""
