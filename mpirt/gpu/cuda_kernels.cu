// mpirt's CUDA kernels for the CuPy backend, compiled by NVRTC through cupy.RawModule (mpirt/gpu/cuda.py).
//
// One source, compiled once per element type (ELT_KIND 0 float32, 1 bfloat16, 2 float16) and, for the
// attention, per head dimension (HEAD_DIM, 0 = no attention). No CUDA header is included: half values are
// 16-bit integers converted by PTX instructions, so the source compiles wherever NVRTC runs. Arithmetic,
// reductions and statistics are float32; each result is rounded once to the element type.
//
//   gelu_fwd, gelu_bwd        GPT-2's tanh GELU; the backward recomputes the derivative from the input
//   norm_fwd, norm_bwd_dx,    layer norm (center 1) and RMS norm (center 0) over rows of C; the forward
//   norm_bwd_dw               keeps float32 mean and 1/std per row; weight/bias gradients into float32
//   ce_fwd, ce_bwd            softmax cross-entropy per row of V logits: the forward keeps the row's
//                             log-sum-exp only, the backward writes (softmax - onehot) * scale
//   adamw                     AdamW on a float32 master (or float32 parameter) from an ELT gradient,
//                             writing the ELT parameter: one pass, no scratch
//   sumsq                     sum of squares into a float64 total (the global gradient norm)
//   attn_fwd, attn_bwd,       causal flash attention on GPT-2's fused qkv (B, T, 3C), heads of HEAD_DIM:
//   attn_bwd_delta, attn_dq   tensor-core MMA (m16n8k16, float32 accumulation), online softmax, the
//                             per-query log-sum-exp kept; no (T, T) array in either pass

#ifndef ELT_KIND
#define ELT_KIND 1
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 0
#endif

#define INF __int_as_float(0x7f800000)   // (no math.h under NVRTC)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#if ELT_KIND == 0
typedef float elt;
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float from_f32(float v) { return v; }
#else
typedef unsigned short elt;
__device__ __forceinline__ float to_f32(unsigned short h) {
#if ELT_KIND == 1
    return __uint_as_float(((unsigned)h) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}
__device__ __forceinline__ unsigned short from_f32(float f) {
    unsigned short h;
#if ELT_KIND == 1
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}
#endif

__device__ __forceinline__ float ld(const elt* p, long i) { return to_f32(p[i]); }
__device__ __forceinline__ void st(elt* p, long i, float v) { p[i] = from_f32(v); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of v over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();                      // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INF;
    return warp_max(v);
}

// ------------------------------------------------------------------------------------------------------
// GELU (tanh form): y = 0.5 x (1 + t), t = tanh(k (x + a x^3))
// ------------------------------------------------------------------------------------------------------
#define GELU_K 0.7978845608028654f
#define GELU_A 0.044715f

extern "C" __global__ void gelu_fwd(const elt* __restrict__ x, elt* __restrict__ y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = ld(x, i);
        float t = tanhf(GELU_K * (v + GELU_A * v * v * v));
        st(y, i, 0.5f * v * (1.f + t));
    }
}

// gx = g * dy/dx, dy/dx = h (1 + 2 w (1 - h)), h = 0.5 (1 + t), w = k x (1 + 3 a x^2)
extern "C" __global__ void gelu_bwd(const elt* __restrict__ x, const elt* __restrict__ g, elt* __restrict__ gx,
                                    long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = ld(x, i);
        float t = tanhf(GELU_K * (v + GELU_A * v * v * v));
        float h = 0.5f * (1.f + t);
        float w = GELU_K * v * (1.f + 3.f * GELU_A * v * v);
        st(gx, i, ld(g, i) * (h * (1.f + 2.f * w * (1.f - h))));
    }
}

// ------------------------------------------------------------------------------------------------------
// layer norm / RMS norm over rows of C, one warp a row (blocks of 4 warps)
// ------------------------------------------------------------------------------------------------------
extern "C" __global__ void norm_fwd(const elt* __restrict__ x, const elt* __restrict__ w, const elt* __restrict__ b,
                                    elt* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                                    int rows, int C, float eps, int center, int has_w, int has_b) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const elt* xr = x + (long)row * C;
    float mu = 0.f;
    if (center) {
        float s = 0.f;
        for (int c = lane; c < C; c += 32) s += ld(xr, c);
        mu = warp_sum(s) / C;
    }
    float var = 0.f;
    for (int c = lane; c < C; c += 32) {
        float d = ld(xr, c) - mu;
        var += d * d;
    }
    const float r = 1.f / sqrtf(warp_sum(var) / C + eps);
    elt* yr = y + (long)row * C;
    for (int c = lane; c < C; c += 32) {
        float v = (ld(xr, c) - mu) * r;
        if (has_w) v *= ld(w, c);
        if (has_b) v += ld(b, c);
        st(yr, c, v);
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// dx = r (gxh - [center] mean(gxh) - xh mean(gxh xh)), gxh = g w, xh = (x - mean) r
extern "C" __global__ void norm_bwd_dx(const elt* __restrict__ g, const elt* __restrict__ x, const elt* __restrict__ w,
                                       const float* __restrict__ mean, const float* __restrict__ rstd,
                                       elt* __restrict__ gx, int rows, int C, int center, int has_w) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const elt* xr = x + (long)row * C;
    const elt* gr = g + (long)row * C;
    const float mu = mean[row], r = rstd[row];
    float s1 = 0.f, s2 = 0.f;
    for (int c = lane; c < C; c += 32) {
        float gh = has_w ? ld(gr, c) * ld(w, c) : ld(gr, c);
        s1 += gh;
        s2 += gh * (ld(xr, c) - mu) * r;
    }
    const float m1 = center ? warp_sum(s1) / C : 0.f, m2 = warp_sum(s2) / C;
    elt* out = gx + (long)row * C;
    for (int c = lane; c < C; c += 32) {
        float gh = has_w ? ld(gr, c) * ld(w, c) : ld(gr, c);
        st(out, c, r * (gh - m1 - (ld(xr, c) - mu) * r * m2));
    }
}

// gw[c] += sum_rows g xh, gb[c] += sum_rows g over a slab of rows per block (float32 atomics)
extern "C" __global__ void norm_bwd_dw(const elt* __restrict__ g, const elt* __restrict__ x,
                                       const float* __restrict__ mean, const float* __restrict__ rstd,
                                       float* __restrict__ gw, float* __restrict__ gb, int rows, int C, int slab) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int r0 = blockIdx.y * slab, r1 = min(rows, r0 + slab);
    float sw = 0.f, sb = 0.f;
    for (int r = r0; r < r1; ++r) {
        float gv = ld(g, (long)r * C + c);
        sw += gv * (ld(x, (long)r * C + c) - mean[r]) * rstd[r];
        sb += gv;
    }
    if (gw) atomicAdd(gw + c, sw);
    if (gb) atomicAdd(gb + c, sb);
}

// ------------------------------------------------------------------------------------------------------
// softmax cross-entropy, one block a row of V logits; targets < 0 mark ignored rows (loss 0, gradient 0)
// ------------------------------------------------------------------------------------------------------
extern "C" __global__ void ce_fwd(const elt* __restrict__ logits, const long long* __restrict__ targets,
                                  float* __restrict__ loss, float* __restrict__ lse, int V) {
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    const elt* x = logits + row * V;
    float m = -INF, s = 0.f;                     // online max and sum of exp(x - m)
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float v = ld(x, j);
        if (v > m) {
            s = s * expf(m - v) + 1.f;
            m = v;
        } else if (v != -INF) {                     // (a -inf first seen with m = -inf: exp(NaN))
            s += expf(v - m);
        }
    }
    const float mm = block_max(m, scratch);          // the row maximum; each thread's sum rescaled to it
    const float total = block_sum(m == -INF ? 0.f : s * expf(m - mm), scratch);
    if (threadIdx.x == 0) {
        const float l = mm + logf(total);
        const long long t = targets[row];
        lse[row] = l;
        loss[row] = t < 0 ? 0.f : l - ld(x, t);
    }
}

// glogits = (exp(x - lse) - onehot) * scale[0] * (target >= 0)
extern "C" __global__ void ce_bwd(const elt* __restrict__ logits, const long long* __restrict__ targets,
                                  const float* __restrict__ lse, const float* __restrict__ scale,
                                  elt* __restrict__ glogits, int V) {
    const long row = blockIdx.x;
    const long long t = targets[row];
    const float l = lse[row], k = t < 0 ? 0.f : scale[0];
    const elt* x = logits + row * V;
    elt* gx = glogits + row * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float p = expf(ld(x, j) - l);
        st(gx, j, (j == t ? p - 1.f : p) * k);
    }
}

// ------------------------------------------------------------------------------------------------------
// AdamW (torch's): w = w (1 - lr wd); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// w -= (lr c2 / c1) m / (sqrt(v) + eps c2); g = grad * gscale; param = w rounded to ELT
// ------------------------------------------------------------------------------------------------------
// (param and master are one array for a float32 parameter: neither is __restrict__)
extern "C" __global__ void adamw(elt* param, float* master, const elt* __restrict__ grad,
                                 float* __restrict__ m, float* __restrict__ v, long n, float gscale, float decay,
                                 float beta1, float beta2, float eps_c2, float step_size) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float g = ld(grad, i) * gscale;
        const float mi = m[i] * beta1 + g * (1.f - beta1);
        const float vi = v[i] * beta2 + (g * g) * (1.f - beta2);
        const float w = master[i] * decay - mi / (sqrtf(vi) + eps_c2) * step_size;
        m[i] = mi;
        v[i] = vi;
        master[i] = w;
        st(param, i, w);
    }
}

extern "C" __global__ void sumsq(const elt* __restrict__ x, long n, double* __restrict__ total) {
    __shared__ float scratch[32];
    float s = 0.f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = ld(x, i);
        s += v * v;
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) atomicAdd(total, (double)s);
}

// ------------------------------------------------------------------------------------------------------
// causal flash attention (half types, HEAD_DIM a multiple of 32 up to 128: the backward splits dQ's D/8
// column tiles over its 4 warps, and D = 128 takes 255 registers there)
// ------------------------------------------------------------------------------------------------------
#if HEAD_DIM > 0 && ELT_KIND > 0
#define D HEAD_DIM
static_assert(D % 32 == 0 && D <= 128, "HEAD_DIM must be a multiple of 32, at most 128");
#define KP (D + 8)      // padded row (elements) of a row-major [key or query][d] tile: conflict-free fragments
#define TP64 72         // padded row of a [d][64] transposed tile
#define TP32 40         // padded row of a [d][32] transposed tile

typedef unsigned u32;

// two floats rounded into one register of two halves, lo in the low 16 bits (the lower column)
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if ELT_KIND == 1
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// c (16x8 f32) += a (16x16, row) b (16x8, col). Fragments (g = lane / 4, q = lane % 4):
// a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..); b0 (k 2q.., n g), b1 (k 2q+8.., n g);
// c0,c1 (g, 2q, 2q+1), c2,c3 (g+8, 2q, 2q+1)
__device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
#if ELT_KIND == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ u32 ld32(const elt* p) { return *(const u32*)p; }

// A fragment of rows [0, 16) x columns [0, 16) of a row-major tile with row stride `stride` (elements)
__device__ __forceinline__ void frag_a(u32* a, const elt* tile, int stride, int g, int q) {
    const elt* p = tile + g * stride + 2 * q;
    a[0] = ld32(p);
    a[1] = ld32(p + 8 * stride);
    a[2] = ld32(p + 8);
    a[3] = ld32(p + 8 * stride + 8);
}

// B fragment (k 16 x n 8) stored n-major: element (k, n) at tile[n * stride + k]
__device__ __forceinline__ void frag_b(u32* b, const elt* tile, int stride, int g, int q) {
    const elt* p = tile + g * stride + 2 * q;
    b[0] = ld32(p);
    b[1] = ld32(p + 8);
}

// rows [r0, r0 + n) of `src` (row stride `ld` elements, D columns) into a row-major tile (stride KP) where
// `tile` is set and a transposed tile tr[d * tstride + row] where `tr` is set; rows at or past T are zeros
__device__ __forceinline__ void load_rows(elt* tile, elt* tr, int tstride, const elt* src, long ld, int r0, int n,
                                          int T) {
    for (int i = threadIdx.x; i < n * (D / 8); i += blockDim.x) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < T) v = *(const uint4*)(src + (long)(r0 + r) * ld + c);
        if (tile) *(uint4*)(tile + r * KP + c) = v;
        if (tr) {
            const elt* e = (const elt*)&v;
#pragma unroll
            for (int j = 0; j < 8; ++j) tr[(c + j) * tstride + r] = e[j];
        }
    }
}

// Forward: block = 4 warps x 16 queries (64), key tiles of 64. out (B, T, C), lse (B, H, T) float32
// (natural log of the scaled scores' row sum of exp, as the CPU forms keep it).
extern "C" __global__ void __launch_bounds__(128) attn_fwd(const elt* __restrict__ qkv, elt* __restrict__ out,
                                                           float* __restrict__ lse, int T, int H, float scale_log2) {
    __shared__ __align__(16) elt Ks[64 * KP];
    __shared__ __align__(16) elt Vt[D * TP64];
    const int C = H * D;
    const long row3 = 3L * C;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const elt* base = qkv + (long)b * T * row3 + h * D;
    const int qw = blockIdx.x * 64 + warp * 16;          // this warp's first query
    const int r0 = qw + g, r1 = qw + g + 8;              // this thread's two query rows
    u32 qa[D / 16][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const int c = kc * 16 + 2 * q;
        qa[kc][0] = r0 < T ? ld32(base + r0 * row3 + c) : 0u;
        qa[kc][1] = r1 < T ? ld32(base + r1 * row3 + c) : 0u;
        qa[kc][2] = r0 < T ? ld32(base + r0 * row3 + c + 8) : 0u;
        qa[kc][3] = r1 < T ? ld32(base + r1 * row3 + c + 8) : 0u;
    }
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = -INF, m1 = -INF, l0 = 0.f, l1 = 0.f;
    const int kend = min(blockIdx.x * 64 + 64, T);      // keys [0, kend) are seen by some query here
    for (int k0 = 0; k0 < kend; k0 += 64) {
        __syncthreads();
        load_rows(Ks, nullptr, 0, base + C, row3, k0, 64, T);
        load_rows(nullptr, Vt, TP64, base + 2 * C, row3, k0, 64, T);   // V transposed: Vt[d][key]
        __syncthreads();
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                u32 bf[2];
                frag_b(bf, Ks + nt * 8 * KP + kc * 16, KP, g, q);
                mma(s[nt], qa[kc], bf);
            }
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = k0 + nt * 8 + 2 * q + e;
                const float v0 = key > r0 ? -INF : s[nt][e] * scale_log2;
                const float v1 = key > r1 ? -INF : s[nt][2 + e] * scale_log2;
                s[nt][e] = v0;
                s[nt][2 + e] = v1;
                mx0 = fmaxf(mx0, v0);
                mx1 = fmaxf(mx1, v1);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float a0 = exp2f(m0 - mx0), a1 = exp2f(m1 - mx1);   // 0 on the first tile (m = -inf)
        m0 = mx0;
        m1 = mx1;
        u32 pa[4][4];
        float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float p00 = exp2f(s[nt][0] - m0), p01 = exp2f(s[nt][1] - m0);
            const float p10 = exp2f(s[nt][2] - m1), p11 = exp2f(s[nt][3] - m1);
            ls0 += p00 + p01;
            ls1 += p10 + p11;
            pa[nt >> 1][(nt & 1) * 2] = pack2(p00, p01);          // a0 / a2: row g
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack2(p10, p11);      // a1 / a3: row g + 8
        }
        l0 = l0 * a0 + ls0;
        l1 = l1 * a1 + ls1;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            o[dt][0] *= a0;
            o[dt][1] *= a0;
            o[dt][2] *= a1;
            o[dt][3] *= a1;
        }
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                u32 bf[2];
                frag_b(bf, Vt + dt * 8 * TP64 + kc * 16, TP64, g, q);
                mma(o[dt], pa[kc], bf);
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    elt* ob = out + (long)b * T * C + h * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + 2 * q;
        if (r0 < T) *(u32*)(ob + (long)r0 * C + c) = pack2(o[dt][0] * i0, o[dt][1] * i0);
        if (r1 < T) *(u32*)(ob + (long)r1 * C + c) = pack2(o[dt][2] * i1, o[dt][3] * i1);
    }
    if (q == 0) {
        if (r0 < T) lse[(long)bh * T + r0] = (m0 + log2f(l0)) * LN2;
        if (r1 < T) lse[(long)bh * T + r1] = (m1 + log2f(l1)) * LN2;
    }
}

// delta[b, h, t] = dO . O over the head's D columns (FlashAttention's rowsum(dP * P)), one warp a row
extern "C" __global__ void attn_bwd_delta(const elt* __restrict__ dout, const elt* __restrict__ out,
                                          float* __restrict__ delta, int B, int T, int H) {
    const long row = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (long)B * T * H) return;
    const int h = row % H;
    const long bt = row / H;                              // b * T + t
    const long off = bt * H * D + h * D;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += ld(dout, off + d) * ld(out, off + d);
    s = warp_sum(s);
    if (lane == 0) {
        const long b = bt / T, t = bt % T;
        delta[(b * H + h) * T + t] = s;
    }
}

#define BWD_SMEM_ELTS (2 * 64 * KP + D * TP64 + 2 * 32 * KP + 2 * D * TP32 + 32 * TP64)

// Backward: block = 4 warps x 16 keys (64 keys), query tiles of 32 from the block's first key on.
// dK, dV accumulate in registers and are written once (times scale for dK); dQ is added into dq_acc
// (B, H, T, D) float32 with atomics, scaled and rounded by attn_dq.
extern "C" __global__ void __launch_bounds__(128) attn_bwd(const elt* __restrict__ qkv, const elt* __restrict__ dout,
                                                           const float* __restrict__ lse,
                                                           const float* __restrict__ delta,
                                                           float* __restrict__ dq_acc, elt* __restrict__ dqkv,
                                                           int T, int H, float scale_log2, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    elt* Ks = (elt*)smem;              // [64][KP]
    elt* Vs = Ks + 64 * KP;            // [64][KP]
    elt* Kt = Vs + 64 * KP;            // [D][TP64]
    elt* Qs = Kt + D * TP64;           // [32][KP]
    elt* Os = Qs + 32 * KP;            // dO [32][KP]
    elt* Qt = Os + 32 * KP;            // [D][TP32]
    elt* Ot = Qt + D * TP32;           // dO^T [D][TP32]
    elt* Ss = Ot + D * TP32;           // dS [32 queries][TP64 keys]
    float* lse_s = (float*)(Ss + 32 * TP64);
    float* dl_s = lse_s + 32;
    const int C = H * D;
    const long row3 = 3L * C;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const elt* base = qkv + (long)b * T * row3 + h * D;
    const elt* dob = dout + (long)b * T * C + h * D;
    const int k0 = blockIdx.x * 64;
    const int kr0 = k0 + warp * 16 + g, kr1 = kr0 + 8;  // this thread's two key rows
    load_rows(Ks, Kt, TP64, base + C, row3, k0, 64, T);
    load_rows(Vs, nullptr, 0, base + 2 * C, row3, k0, 64, T);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
    const elt* Kw = Ks + warp * 16 * KP;
    const elt* Vw = Vs + warp * 16 * KP;
    for (int q0 = k0; q0 < T; q0 += 32) {
        __syncthreads();                                 // the previous tile's readers are done
        load_rows(Qs, Qt, TP32, base, row3, q0, 32, T);
        load_rows(Os, Ot, TP32, dob, C, q0, 32, T);
        if (threadIdx.x < 32) {
            const int t = q0 + threadIdx.x;
            lse_s[threadIdx.x] = t < T ? lse[(long)bh * T + t] * LOG2E : INF;
            dl_s[threadIdx.x] = t < T ? delta[(long)bh * T + t] : 0.f;
        }
        __syncthreads();
        float st[4][4], dp[4][4];                        // S^T and dP^T: 16 keys x 32 queries
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
            st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            u32 ka[4], va[4];
            frag_a(ka, Kw + kc * 16, KP, g, q);
            frag_a(va, Vw + kc * 16, KP, g, q);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                u32 bf[2];
                frag_b(bf, Qs + nt * 8 * KP + kc * 16, KP, g, q);
                mma(st[nt], ka, bf);                     // S^T = K Q^T
                frag_b(bf, Os + nt * 8 * KP + kc * 16, KP, g, q);
                mma(dp[nt], va, bf);                     // dP^T = V dO^T
            }
        }
        u32 pa[2][4], sa[2][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            float p[4], ds[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int qc = nt * 8 + 2 * q + e, t = q0 + qc;
                const float l2 = lse_s[qc], dl = dl_s[qc];
                p[e] = kr0 <= t ? exp2f(st[nt][e] * scale_log2 - l2) : 0.f;
                p[2 + e] = kr1 <= t ? exp2f(st[nt][2 + e] * scale_log2 - l2) : 0.f;
                ds[e] = p[e] * (dp[nt][e] - dl);
                ds[2 + e] = p[2 + e] * (dp[nt][2 + e] - dl);
                Ss[qc * TP64 + warp * 16 + g] = from_f32(ds[e]);       // dS stored [query][key] for dQ
                Ss[qc * TP64 + warp * 16 + g + 8] = from_f32(ds[2 + e]);
            }
            pa[nt >> 1][(nt & 1) * 2] = pack2(p[0], p[1]);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack2(p[2], p[3]);
            sa[nt >> 1][(nt & 1) * 2] = pack2(ds[0], ds[1]);
            sa[nt >> 1][(nt & 1) * 2 + 1] = pack2(ds[2], ds[3]);
        }
#pragma unroll
        for (int kc = 0; kc < 2; ++kc) {
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                u32 bf[2];
                frag_b(bf, Ot + dt * 8 * TP32 + kc * 16, TP32, g, q);
                mma(dv[dt], pa[kc], bf);                 // dV += P^T dO
                frag_b(bf, Qt + dt * 8 * TP32 + kc * 16, TP32, g, q);
                mma(dk[dt], sa[kc], bf);                 // dK += dS^T Q
            }
        }
        __syncthreads();                                 // dS complete in shared memory
        // dQ (32 x D) += dS (32 x 64 keys) K (64 x D): warp w takes D/32 column tiles of 8
        float dq[2][D / 32][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int j = 0; j < D / 32; ++j) dq[mt][j][0] = dq[mt][j][1] = dq[mt][j][2] = dq[mt][j][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                u32 a[4];
                frag_a(a, Ss + mt * 16 * TP64 + kc * 16, TP64, g, q);
#pragma unroll
                for (int j = 0; j < D / 32; ++j) {
                    u32 bf[2];
                    frag_b(bf, Kt + (warp * (D / 32) + j) * 8 * TP64 + kc * 16, TP64, g, q);
                    mma(dq[mt][j], a, bf);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int t0 = q0 + mt * 16 + g, t1 = t0 + 8;
#pragma unroll
            for (int j = 0; j < D / 32; ++j) {
                const int d = (warp * (D / 32) + j) * 8 + 2 * q;
                if (t0 < T) {
                    atomicAdd(dq_acc + ((long)bh * T + t0) * D + d, dq[mt][j][0]);
                    atomicAdd(dq_acc + ((long)bh * T + t0) * D + d + 1, dq[mt][j][1]);
                }
                if (t1 < T) {
                    atomicAdd(dq_acc + ((long)bh * T + t1) * D + d, dq[mt][j][2]);
                    atomicAdd(dq_acc + ((long)bh * T + t1) * D + d + 1, dq[mt][j][3]);
                }
            }
        }
    }
    elt* db = dqkv + (long)b * T * row3 + h * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + 2 * q;
        if (kr0 < T) {
            *(u32*)(db + (long)kr0 * row3 + C + c) = pack2(dk[dt][0] * scale, dk[dt][1] * scale);
            *(u32*)(db + (long)kr0 * row3 + 2 * C + c) = pack2(dv[dt][0], dv[dt][1]);
        }
        if (kr1 < T) {
            *(u32*)(db + (long)kr1 * row3 + C + c) = pack2(dk[dt][2] * scale, dk[dt][3] * scale);
            *(u32*)(db + (long)kr1 * row3 + 2 * C + c) = pack2(dv[dt][2], dv[dt][3]);
        }
    }
}

// dqkv's query columns = dq_acc * scale, rounded once
extern "C" __global__ void attn_dq(const float* __restrict__ dq_acc, elt* __restrict__ dqkv, int B, int T, int H,
                                   float scale) {
    const long n = (long)B * H * T * D;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const int d = i % D;
        const long bht = i / D, t = bht % T, bh = bht / T, b = bh / H, h = bh % H;
        st(dqkv, (b * T + t) * 3L * H * D + h * D + d, dq_acc[i] * scale);
    }
}
#endif
