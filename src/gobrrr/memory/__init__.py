"""The memory model: the step's allocations replayed through a model of CUDA's caching
allocator (`replay`, `allocator`), with what kernels allocate inside themselves (`scratch/`)."""
