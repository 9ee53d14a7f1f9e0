"""The base layer, records every layer shares: public enums, configs and errors, unit configs, the registry,
state machines, per-unit switches, gradient records, safety switches, copy refusal, param-major index
arithmetic, contiguous strides. Nothing here imports a higher layer: the layers, bottom first, are `LAYERS` in
scripts/package_counts.py.
"""
