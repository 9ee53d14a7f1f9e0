"""The grads layer, a unit's gradients: exposure as .grad, presence flags (agreed on the host off the CPU),
reductions, CPU offload copies, communication hooks' call-out, the gradient scaler. Nothing here imports a
higher layer: the layers, bottom first, are `LAYERS` in scripts/package_counts.py.
"""
