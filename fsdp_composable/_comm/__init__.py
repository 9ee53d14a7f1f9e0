"""The comm layer, collectives and their communication device, streams and events, rank-agreement headers,
tracing labels, tensor-parallel meshes and placements. Nothing here imports a higher layer: the layers, bottom
first, are `LAYERS` in scripts/package_counts.py.
"""
