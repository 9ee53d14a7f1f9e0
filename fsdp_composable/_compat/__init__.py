"""The compat layer, skins over the core: FSDP1's static methods and communication hooks, FSDP2's per-module
switches. Subfolders: fsdp1/, fsdp2/. Nothing here imports a higher layer: the layers, bottom first, are
`LAYERS` in scripts/package_counts.py.
"""
