"""Step-time, memory and communication benchmarks comparing fsdp_composable with DDP and torch FSDP2."""
