"""The state layer, state dicts and optimizer state, and the routing of torch's state-dict, optimizer and clip
APIs. Nothing here imports a higher layer: the layers, bottom first, are `LAYERS` in
scripts/package_counts.py.
"""
