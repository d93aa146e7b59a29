"""The CUDA kernels' CPU-side parts (mpirt/kernels/cuda.py, cuda_kernels.cu): the source compiles for
every element type and head dimension with no register spills in the attention, the launch shapes,
the selection logic and the fallbacks. The kernels' numbers are checked on a GPU by bench/gpu_check.sh
(parts ops, optim, gpt, attention); here NumPy runs every op, so the xp forms must be chosen."""
import re
import shutil
import subprocess

import numpy as np
import pytest

import mpirt.backend as B
from mpirt import ops
from mpirt.kernels import cuda
from mpirt.precision import float32_compute
from mpirt.tensor import Function, Tensor

NVCC = shutil.which("nvcc")


def _compile(kind: int, head_dim: int, tmp_path):
    """ptxas's resource report of the source built for sm_90 (Hopper) with these macros."""
    out = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-std=c++17", f"-DELT_KIND={kind}", f"-DHEAD_DIM={head_dim}",
                          "-Xptxas", "-v", "-o", str(tmp_path / f"k{kind}_{head_dim}.cubin"), str(cuda.SOURCE)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels")
@pytest.mark.parametrize("dtype", list(cuda.ELT_KINDS))
def test_source_compiles_for_every_dtype_and_head_dim(dtype, tmp_path):
    kind = cuda.ELT_KINDS[dtype]
    dims = cuda.HEAD_DIMS if dtype in cuda.HALF_KINDS else (0,)
    for d in dims:
        report = _compile(kind, d, tmp_path)
        entries = dict(re.findall(r"Compiling entry function '(\w+)'.*?\n.*?\n\s+(\d+) bytes stack frame, "
                                  r"(?:\d+) bytes spill stores", report, flags=re.S))
        expected = {"gelu_fwd", "gelu_bwd", "norm_fwd", "norm_bwd_dx", "norm_bwd_dw", "ce_fwd", "ce_bwd", "adamw", "sumsq"}
        if d:
            expected |= {"attn_fwd", "attn_bwd", "attn_bwd_delta", "attn_dq"}
        assert expected <= set(entries), (d, sorted(entries))
        spills = re.findall(r"Compiling entry function '(attn_\w+)'.*?\n.*?\n\s+\d+ bytes stack frame, (\d+) bytes spill "
                            r"stores", report, flags=re.S)
        assert all(int(n) == 0 for _, n in spills), (d, spills)   # registers, not local memory


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
