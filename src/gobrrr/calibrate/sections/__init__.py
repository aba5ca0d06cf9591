"""One calibration section per kernel class: matmul shapes, convolutions, memory-bound paths,
the host, the optimizer, offload, the power limit, and what needs a training step."""
