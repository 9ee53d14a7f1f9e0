"""The runtime layer, the state and its root context, hooks, execution order, prefetch, limiter, lazy init, entry
points, no_sync and clipping, unshard/reshard, unshard_params; and the guards that keep the views consistent.
Nothing here imports a higher layer: the layers, bottom first, are `LAYERS` in scripts/package_counts.py.
"""
