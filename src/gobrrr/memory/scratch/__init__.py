"""What kernels allocate inside themselves: attention's, norms' and reductions' workspaces."""
