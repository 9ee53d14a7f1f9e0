"""The init layer, policies and _get_submodule_to_states(), construction, placement, meta init, the sharding plan
and memory model. Nothing here imports a higher layer: the layers, bottom first, are `LAYERS` in
scripts/package_counts.py.
"""
