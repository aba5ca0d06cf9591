"""What a knob does to a real model: the training step (`step`), activation checkpointing,
the fused linear + cross-entropy, optimizer-state storage, CPU offload of the optimizer."""
