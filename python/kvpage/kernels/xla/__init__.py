"""Paged attention in plain XLA ops (the default backend off GPU) and the reference
implementation the kernels are tested against."""
