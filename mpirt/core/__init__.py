"""Numerics: arrays on NumPy or CuPy (backend), the autograd (tensor), ops, modules (nn), optimizers,
mixed precision, recomputation, and the interface every model implements (modeling)."""
