"""The flat layer, the flat buffers: FlatParameter and FlatParamHandle, their rank-major layout and copies, their
layout as per-parameter pieces, their checkpoint collectives. Nothing here imports a higher layer: the layers,
bottom first, are `LAYERS` in scripts/package_counts.py.
"""
