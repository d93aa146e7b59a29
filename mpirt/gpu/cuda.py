"""Fused CUDA kernels for the CuPy backend: GELU, layer/RMS norm, softmax cross-entropy, AdamW, the
gradients' sum of squares and a causal flash attention on tensor cores (``cuda_kernels.cu``).

The source is compiled by NVRTC through ``cupy.RawModule`` on first use, once per element type
(float32, bfloat16, float16) and, for the attention, per head dimension; CuPy caches the binaries
on disk (``CUPY_CACHE_DIR``), so later processes load them. Every function here takes and returns
CuPy arrays; the ops call them when :func:`takes` (or :func:`attention_takes`) says the arrays fit
and run their xp forms otherwise: NumPy, float64, strided arrays, ``MPIRT_KERNELS=numpy``.

Launch shapes are pure functions (:func:`grid_1d`, :func:`rows_grid`, :func:`attention_grid`,
:func:`attention_bwd_smem`), so they are tested without a GPU; the kernels themselves are checked
against NumPy float64 by ``bench/gpu_check.sh`` on a GPU.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

import mpirt.core.backend as B

SOURCE = Path(__file__).with_name("cuda_kernels.cu")
ELT_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}   # the source's ELT_KIND per dtype
HALF_KINDS = ("bfloat16", "float16")                        # the attention's tensor-core types
HEAD_DIMS = (32, 64, 96, 128)   # the backward splits dQ's D/8 column tiles over 4 warps; 128: registers
THREADS = 256                                               # elementwise and per-row-block kernels
MAX_BLOCKS = 8192                                           # grid-stride kernels: enough to fill any GPU
ROWS_PER_BLOCK = 4                                          # norms: one warp a row, 4 warps a block
NORM_SLAB = 64                                              # norms' weight gradient: rows per block
ATTN_THREADS = 128                                          # attention: 4 warps
ATTN_KEYS = 64                                              # keys per backward block, queries per forward block
MAX_GRID_Y = 65535                                          # CUDA's limit on a grid's second dimension

_modules: dict = {}


def disabled() -> bool:
    """``MPIRT_KERNELS=numpy`` (or ``off``, ``0``) turns the CUDA kernels off as it does the C ones."""
    return os.environ.get("MPIRT_KERNELS", "").strip().lower() in ("numpy", "off", "0")


def takes(*arrays) -> bool:
    """Whether the kernels take these arrays: the CuPy backend, kernels not disabled, every array
    (None skipped) a C-contiguous CuPy array of one dtype among :data:`ELT_KINDS`."""
    arrays = [a for a in arrays if a is not None]
    if B.name != "cupy" or disabled() or not arrays:
        return False
    dtype = arrays[0].dtype
    return (str(dtype) in ELT_KINDS and all(B.is_device_array(a) and a.dtype == dtype and a.flags.c_contiguous
                                            for a in arrays))


def attention_takes(qkv, n_head: int) -> bool:
    """Whether the flash attention takes this (B, T, 3C) ``qkv``: a half dtype, a head dimension in
    :data:`HEAD_DIMS`, 16-byte aligned rows (its tiles load 8 halves at a time), B x heads within
    a grid's second dimension."""
    if not takes(qkv) or str(qkv.dtype) not in HALF_KINDS or qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        return False
    return (qkv.shape[-1] // (3 * n_head) in HEAD_DIMS and aligned(qkv)
            and qkv.shape[0] * n_head <= MAX_GRID_Y)


def aligned(a) -> bool:
    """Whether device array ``a`` starts on a 16-byte boundary (the attention's vector loads)."""
    return a.data.ptr % 16 == 0


def grid_1d(n: int) -> int:
    """Blocks of :data:`THREADS` for a grid-stride loop over ``n`` elements."""
    return max(1, min(MAX_BLOCKS, -(-n // THREADS)))


def rows_grid(rows: int) -> int:
    """Blocks for one warp a row, :data:`ROWS_PER_BLOCK` rows a block."""
    return max(1, -(-rows // ROWS_PER_BLOCK))


def attention_grid(batch: int, t: int, n_head: int) -> tuple[int, int]:
    """(blocks over the sequence, blocks over batch x heads) of both attention passes: 64 queries
    a forward block, 64 keys a backward block."""
    return -(-t // ATTN_KEYS), batch * n_head


def attention_bwd_smem(head_dim: int) -> int:
    """Dynamic shared memory (bytes) of ``attn_bwd``: K and V (64 rows), K^T, Q and dO (32 rows),
    Q^T and dO^T, dS (32 x 64), in 2-byte elements with the kernel's paddings, then 64 floats
    (the query tile's log-sum-exp and delta). Mirrors the layout at the top of ``attn_bwd``."""
    row, t64, t32 = head_dim + 8, 72, 40
    elements = 2 * 64 * row + head_dim * t64 + 2 * 32 * row + 2 * head_dim * t32 + 32 * t64
    return 2 * elements + 64 * 4


def compile_options(dtype, head_dim: int = 0) -> tuple[str, ...]:
    """NVRTC options of the module for ``dtype`` (and the attention's ``head_dim``, 0: none)."""
    return "-std=c++17", f"-DELT_KIND={ELT_KINDS[str(dtype)]}", f"-DHEAD_DIM={head_dim}"


def _kernel(dtype, name: str, head_dim: int = 0):
    """Kernel ``name`` of the module compiled for ``dtype`` (and ``head_dim``); modules are built once."""
    import cupy
    key = (str(dtype), head_dim)
    module = _modules.get(key)
    if module is None:
        module = _modules[key] = cupy.RawModule(code=SOURCE.read_text(), options=compile_options(dtype, head_dim))
    return module.get_function(name)


def _i32(v) -> np.int32:
    return np.int32(v)


def _f32(v) -> np.float32:
    return np.float32(v)


# --- GELU -------------------------------------------------------------------------------------------
def gelu_forward(x):
    """GPT-2's tanh GELU of ``x``, a fresh array of its dtype."""
    y = B.xp.empty_like(x)
    _kernel(x.dtype, "gelu_fwd")((grid_1d(x.size),), (THREADS,), (x, y, np.int64(x.size)))
    return y


def gelu_backward(x, g):
    """``g * gelu'(x)``, the derivative recomputed from ``x``."""
    gx = B.xp.empty_like(x)
    _kernel(x.dtype, "gelu_bwd")((grid_1d(x.size),), (THREADS,), (x, g, gx, np.int64(x.size)))
    return gx


# --- layer norm / RMS norm --------------------------------------------------------------------------
def _or_dummy(a, like):
    """``a``, or a one-element array of ``like``'s dtype standing for a missing weight or bias."""
    return a if a is not None else B.xp.zeros(1, dtype=like.dtype)


def norm_forward(x2, weight, bias, eps: float, center: bool):
    """Layer norm (``center``) or RMS norm of the rows of (N, C) ``x2``: ``(y, mean, rstd)``, the
    statistics (N,) float32 (the mean is 0 without ``center``)."""
    xp = B.xp
    rows, c = x2.shape
    y = xp.empty_like(x2)
    mean, rstd = xp.empty(rows, dtype=np.float32), xp.empty(rows, dtype=np.float32)
    _kernel(x2.dtype, "norm_fwd")((rows_grid(rows),), (32 * ROWS_PER_BLOCK,),
                                  (x2, _or_dummy(weight, x2), _or_dummy(bias, x2), y, mean, rstd, _i32(rows), _i32(c),
                                   _f32(eps), _i32(center), _i32(weight is not None), _i32(bias is not None)))
    return y, mean, rstd


def norm_backward(g2, x2, weight, mean, rstd, want_x: bool, want_w: bool, want_b: bool, center: bool):
    """The norm's gradients ``(gx, gw, gb)`` (None where not wanted) from the output gradient
    ``g2`` and the saved input and statistics; ``gw``, ``gb`` summed over rows in float32 and
    rounded once to the weight's dtype."""
    xp = B.xp
    rows, c = x2.shape
    gx = gw = gb = None
    if want_x:
        gx = xp.empty_like(x2)
        _kernel(x2.dtype, "norm_bwd_dx")((rows_grid(rows),), (32 * ROWS_PER_BLOCK,),
                                         (g2, x2, _or_dummy(weight, x2), mean, rstd, gx, _i32(rows), _i32(c),
                                          _i32(center), _i32(weight is not None)))
    if want_w or want_b:
        sums = xp.zeros((2, c), dtype=np.float32)
        slab = max(NORM_SLAB, -(-rows // MAX_GRID_Y))
        grid = (-(-c // THREADS), max(1, -(-rows // slab)))
        _kernel(x2.dtype, "norm_bwd_dw")(grid, (THREADS,), (g2, x2, mean, rstd, sums[0], sums[1], _i32(rows), _i32(c),
                                                            _i32(slab)))
        out_dtype = weight.dtype if weight is not None else x2.dtype
        gw = sums[0].astype(out_dtype) if want_w else None
        gb = sums[1].astype(out_dtype) if want_b else None
    return gx, gw, gb


# --- softmax cross-entropy --------------------------------------------------------------------------
def cross_entropy_forward(x, targets):
    """Per-row loss and log-sum-exp (both (N,) float32) of (N, V) logits ``x``; ``targets`` (N,)
    int64, negative where a row is ignored (its loss 0)."""
    xp = B.xp
    n, v = x.shape
    loss, lse = xp.empty(n, dtype=np.float32), xp.empty(n, dtype=np.float32)
    if n:
        _kernel(x.dtype, "ce_fwd")((n,), (THREADS,), (x, targets, loss, lse, _i32(v)))
    return loss, lse


def cross_entropy_backward(x, targets, lse, scale):
    """``(softmax(x) - onehot(targets)) * scale[0]`` in ``x``'s dtype, 0 on ignored rows;
    ``scale`` a one-element float32 device array (the upstream gradient over the count: no host
    read)."""
    n, v = x.shape
    gx = B.xp.empty_like(x)
    if n:
        _kernel(x.dtype, "ce_bwd")((n,), (THREADS,), (x, targets, lse, scale, gx, _i32(v)))
    return gx


# --- optimizer --------------------------------------------------------------------------------------
def adamw(param, master, grad, exp_avg, exp_avg_sq, *, grad_scale, decay, beta1, beta2, eps_c2, step_size) -> None:
    """One AdamW step in place (:func:`mpirt.core.optim.adamw_update`'s formula and constants): the
    float32 ``master`` (the float32 parameter itself when ``param`` is float32) and moments from
    ``grad * grad_scale``; ``param`` is written rounded from the master."""
    n = master.size
    _kernel(param.dtype, "adamw")((grid_1d(n),), (THREADS,),
                                  (param, master, grad, exp_avg, exp_avg_sq, np.int64(n), _f32(grad_scale),
                                   _f32(decay), _f32(beta1), _f32(beta2), _f32(eps_c2), _f32(step_size)))


def sum_squares(arrays):
    """The sum of squares of all ``arrays`` as a one-element float64 device array (float32 per
    block, float64 across blocks and arrays); no host synchronisation."""
    total = B.xp.zeros(1, dtype=np.float64)
    for a in arrays:
        if a.size:
            _kernel(a.dtype, "sumsq")((min(grid_1d(a.size), 1024),), (THREADS,), (a, np.int64(a.size), total))
    return total


# --- causal flash attention -------------------------------------------------------------------------
def attention_forward(qkv, n_head: int):
    """Causal attention of (B, T, 3C) ``qkv``: ``(out, lse)``, out (B, T, C) in qkv's dtype, lse
    (B, H, T, 1) float32 (each query's log-sum-exp of its scaled scores)."""
    xp = B.xp
    b, t, c3 = qkv.shape
    c = c3 // 3
    d = c // n_head
    out = xp.empty((b, t, c), dtype=qkv.dtype)
    lse = xp.empty((b, n_head, t, 1), dtype=np.float32)
    if b and t:
        _kernel(qkv.dtype, "attn_fwd", d)(attention_grid(b, t, n_head), (ATTN_THREADS,),
                                          (qkv, out, lse, _i32(t), _i32(n_head), _f32(math.log2(math.e) / math.sqrt(d))))
    return out, lse


def attention_backward(qkv, out, lse, g, n_head: int):
    """The gradient (B, T, 3C) of the attention's ``qkv`` from the output gradient ``g`` (B, T, C),
    with the forward's ``out`` and ``lse``."""
    xp = B.xp
    b, t, c3 = qkv.shape
    c = c3 // 3
    d = c // n_head
    if not aligned(g):                                      # a view into a larger buffer: copy
        g = g.copy()
    dqkv = xp.empty_like(qkv)
    if not (b and t):
        return dqkv
    scale = 1.0 / math.sqrt(d)
    delta = xp.empty((b, n_head, t), dtype=np.float32)
    rows = b * t * n_head
    _kernel(qkv.dtype, "attn_bwd_delta", d)((rows_grid(rows),), (32 * ROWS_PER_BLOCK,),
                                            (g, out, delta, _i32(b), _i32(t), _i32(n_head)))
    dq_acc = xp.zeros((b, n_head, t, d), dtype=np.float32)
    kernel = _kernel(qkv.dtype, "attn_bwd", d)
    smem = attention_bwd_smem(d)
    kernel.max_dynamic_shared_size_bytes = smem
    kernel(attention_grid(b, t, n_head), (ATTN_THREADS,),
           (qkv, g, lse, delta, dq_acc, dqkv, _i32(t), _i32(n_head), _f32(scale * math.log2(math.e)), _f32(scale)),
           shared_mem=smem)
    _kernel(qkv.dtype, "attn_dq", d)((grid_1d(dq_acc.size),), (THREADS,),
                                     (dq_acc, dqkv, _i32(b), _i32(t), _i32(n_head), _f32(scale)))
    return dqkv
