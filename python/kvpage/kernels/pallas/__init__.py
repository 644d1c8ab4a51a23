"""Pallas kernels (GPU; interpret mode on CPU): paged attention, int8 matmul, and the
ahead-of-time Triton build check."""
