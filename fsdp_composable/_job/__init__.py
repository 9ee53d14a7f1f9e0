"""The job layer, the main job: python -m fsdp_composable, its demo training and checkpoints. Nothing here
imports a higher layer: the layers, bottom first, are `LAYERS` in scripts/package_counts.py.
"""
