"""The names layer, torch's FSDP1 and FSDP2 objects, names and auto-wrap policies, translated to ours where they
enter. Nothing here imports a higher layer: the layers, bottom first, are `LAYERS` in
scripts/package_counts.py.
"""
