"""The CUDA kernels' CPU-side parts (mpirt/gpu/cuda.py, cuda_kernels.cu): the source compiles for
every element type and head dimension through NVRTC, as CuPy compiles it on a GPU (the NVRTC wheel
of the dev extra; no GPU is needed to compile), with no register spills in the attention; the
launch shapes, the selection logic and the fallbacks. The kernels' numbers are checked on a GPU by
bench/gpu_check.sh (parts ops, optim, gpt, attention); here NumPy runs every op, so the xp forms
must be chosen."""
import ctypes
import glob
import os
import re

import numpy as np
import pytest

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.gpu import cuda
from mpirt.core.precision import float32_compute
from mpirt.core.tensor import Function, Tensor

KERNELS = {"gelu_fwd", "gelu_bwd", "norm_fwd", "norm_bwd_dx", "norm_bwd_dw", "ce_fwd", "ce_bwd", "adamw", "sumsq"}
ATTENTION = {"attn_fwd", "attn_bwd", "attn_bwd_delta", "attn_dq"}


def nvrtc_compile(options: list[str]) -> tuple[int, str]:
    """(result code, log) of NVRTC compiling the kernels' source with ``options``."""
    import nvidia.cuda_nvrtc
    lib = ctypes.CDLL(glob.glob(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib", "libnvrtc.so*"))[0])
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), cuda.SOURCE.read_bytes(), b"cuda_kernels.cu", 0, None, None) == 0
    try:
        rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*[o.encode() for o in options]))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("dtype", list(cuda.ELT_KINDS))
def test_source_compiles_under_nvrtc_for_every_dtype_and_head_dim(dtype):
    for d in cuda.HEAD_DIMS if dtype in cuda.HALF_KINDS else (0,):
        rc, log = nvrtc_compile(["--gpu-architecture=sm_90", "--ptxas-options=-v", *cuda.compile_options(dtype, d)])
        assert rc == 0, log
        spills = dict(re.findall(r"Compiling entry function '(\w+)'[^\n]*\n[^\n]*\n[^\n]*?\d+ bytes stack frame, "
                                 r"(\d+) bytes spill stores", log))
        assert (KERNELS | (ATTENTION if d else set())) <= set(spills), (d, sorted(spills))
        assert all(int(n) == 0 for n in spills.values()), (d, spills)   # registers, not local memory


def test_head_dims_outside_the_list_do_not_compile():
    rc, log = nvrtc_compile(["--gpu-architecture=sm_90", *cuda.compile_options("bfloat16", 48)])
    assert rc != 0 and "multiple of 32" in log


def test_launch_shapes():
    assert cuda.grid_1d(1) == 1 and cuda.grid_1d(cuda.THREADS + 1) == 2
    assert cuda.grid_1d(10 ** 10) == cuda.MAX_BLOCKS
    assert cuda.rows_grid(8192) == 8192 // cuda.ROWS_PER_BLOCK and cuda.rows_grid(5) == 2
    assert cuda.attention_grid(8, 1024, 16) == (16, 128)
    assert cuda.attention_grid(2, 1000, 4) == (16, 8)       # a partial last block of queries / keys
    # attn_bwd's shared memory: D=128 is 95,744 bytes of tiles + 256 of statistics, within Hopper's
    # 227 KB per block (and over the 48 KB default, so the launcher raises the limit)
    assert cuda.attention_bwd_smem(128) == 96000
    assert all(48 * 1024 < cuda.attention_bwd_smem(d) <= 227 * 1024 for d in (96, 128))
    assert all(d % 32 == 0 and d <= 128 for d in cuda.HEAD_DIMS)


def test_selection_on_numpy_and_when_disabled(monkeypatch):
    a = np.zeros((4, 96), dtype=np.float32)
    assert B.name == "numpy"
    assert not cuda.takes(a) and not cuda.attention_takes(np.zeros((1, 8, 3 * 64), np.float32), 1)
    monkeypatch.setattr(B, "name", "cupy")                  # the dtype/layout rules alone
    monkeypatch.setattr(B, "is_device_array", lambda x: True)
    assert cuda.takes(a, None, a[0])
    assert not cuda.takes(a, a.astype(np.float64))          # one dtype
    assert not cuda.takes(a.astype(np.float64))             # float64: the xp forms
    assert not cuda.takes(a[:, ::2])                        # strided
    monkeypatch.setenv("MPIRT_KERNELS", "numpy")
    assert cuda.disabled() and not cuda.takes(a)


@float32_compute
class _Probe(Function):
    """Records the dtypes its passes see; says it runs half arrays itself for 2-row inputs."""
    seen: list = []

    def runs_half(self, x):
        return x.shape[0] == 2

    def forward(self, x):
        type(self).seen.append(("forward", str(x.dtype)))
        return x * 2

    def backward(self, g):
        type(self).seen.append(("backward", str(g.dtype)))
        return (g * 2,)


def test_runs_half_keeps_half_arrays_both_ways():
    for rows, want in ((2, "bfloat16"), (3, "float32")):   # the kernel's case, then the upcast one
        _Probe.seen = []
        x = Tensor(np.ones((rows, 4), dtype="bfloat16"), requires_grad=True)
        y = _Probe.apply(x)
        y.backward(np.ones((rows, 4), dtype="bfloat16"))
        assert _Probe.seen == [("forward", want), ("backward", want)]
        assert str(y.dtype) == "bfloat16" and str(x.grad.dtype) == "bfloat16"


def test_ops_take_the_xp_forms_on_numpy():
    """With NumPy the GPU branches stay off: each op keeps what its xp form saves."""
    x = Tensor(np.random.default_rng(0).standard_normal((2, 8, 3 * 64)).astype(np.float32), requires_grad=True)
    y = ops.causal_self_attention(x, n_head=1)
    assert y._ctx.on_gpu is False
    h = Tensor(np.ones((4, 64), np.float32), requires_grad=True)
    assert ops.gelu(h)._ctx.d is not None
    assert ops.layer_norm(h, Tensor(np.ones(64, np.float32)), Tensor(np.zeros(64, np.float32)))._ctx.x2 is None
