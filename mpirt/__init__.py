"""mpirt: a model-parallel training runtime on plain MPI, NumPy and CuPy."""
from mpirt.core.tensor import Tensor, Function, no_grad, enable_grad, is_grad_enabled

from mpirt.version import __version__
import mpirt.models  # noqa: F401,E402  (the bundled models register in mpirt.core.modeling)

__all__ = ["Tensor", "Function", "no_grad", "enable_grad", "is_grad_enabled", "__version__"]
