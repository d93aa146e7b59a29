"""Differentiable ops over Tensors, each one :class:`mpirt.tensor.Function`.

``basic`` holds elementwise ops and reductions, ``shape`` views and joins, ``linalg`` matmul and the
fused linear layer, ``nn`` the fused neural-network ops, ``dropout`` dropout and ``attention``
causal self-attention.
"""
from mpirt.ops.basic import add, sub, mul, div, neg, pow, exp, log, tanh, relu, sum, mean, max
from mpirt.ops.shape import reshape, transpose, getitem, concat, split
from mpirt.ops.linalg import matmul, linear
from mpirt.ops.nn import gelu, softmax, log_softmax, layer_norm, embedding, cross_entropy
from mpirt.ops.dropout import dropout
from mpirt.ops.attention import causal_self_attention

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "tanh", "relu", "sum", "mean", "max",
    "reshape", "transpose", "getitem", "concat", "split", "matmul", "linear",
    "gelu", "softmax", "log_softmax", "layer_norm", "embedding", "cross_entropy", "dropout",
    "causal_self_attention",
]
