"""Differentiable ops over Tensors, each one :class:`mpirt.core.tensor.Function`.

``basic`` holds elementwise ops (SwiGLU among them) and reductions, ``shape`` views and joins,
``linalg`` matmul and the fused linear layers, ``nn`` the fused neural-network ops, ``norm`` RMS
normalisation, ``dropout`` dropout, ``attention`` causal self-attention (and the attention block
that ring attention runs too), ``rotary`` rotary position embeddings and ``moe`` a mixture of experts' grouped SwiGLU (:func:`mpirt.core.ops.moe.grouped_swiglu`).
"""
from mpirt.core.ops.basic import add, sub, mul, div, neg, pow, exp, log, tanh, relu, swiglu, sum, mean, max
from mpirt.core.ops.shape import reshape, transpose, getitem, concat, split
from mpirt.core.ops.linalg import matmul, linear, linear_transposed
from mpirt.core.ops.fused import gelu, softmax, log_softmax, layer_norm, embedding, cross_entropy
from mpirt.core.ops.norm import rms_norm
from mpirt.core.ops.dropout import dropout
from mpirt.core.ops.attention import causal_self_attention
from mpirt.core.ops.rotary import rotary_embedding

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "tanh", "relu", "swiglu", "sum", "mean", "max",
    "reshape", "transpose", "getitem", "concat", "split", "matmul", "linear", "linear_transposed",
    "gelu", "softmax", "log_softmax", "layer_norm", "rms_norm", "embedding", "cross_entropy", "dropout",
    "causal_self_attention", "rotary_embedding",
]
