"""mpirt: a model-parallel training runtime on plain MPI, NumPy and CuPy."""
from mpirt.tensor import Tensor, Function, no_grad, enable_grad, is_grad_enabled

__all__ = ["Tensor", "Function", "no_grad", "enable_grad", "is_grad_enabled"]
__version__ = "0.1.0"
