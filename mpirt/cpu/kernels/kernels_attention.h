/* Causal self-attention in float32, forward and backward, one (batch, head) pair after another:
 * the products (six, and the scores once more in the backward), the softmax and its gradient in
 * one call, on register-blocked small GEMMs.
 *
 * Why: NumPy's batched matmul hands the BLAS one (64 x 32) @ (32 x 128)-sized product per pair
 * and query chunk, which runs at a fifth of the linear layers' GEMM rate; here a pair's scores
 * stay in cache from the product through the softmax to the next product, and the tiles above
 * the causal diagonal are skipped.
 *
 * Layout (mpirt/ops/attention.py): qkv (B, T, C + 2 Ck) with C = H D query columns and Ck = Hk D
 * key and value columns each (grouped-query attention: Hk <= H key/value heads, query head h reads
 * key/value head h / (H / Hk)); query head h at column h D, its key and value heads at C + j D and
 * C + Ck + j D (rows C + 2 Ck apart); out and the incoming gradient (B, T, C); lse (B, H, T) the log-sum-exp
 * of each query's scores, the only state kept between forward and backward: the backward
 * computes the scores again (FlashAttention's recomputation), so neither pass writes or reads a
 * (B, H, T, T) array. The backward takes the queries in the NumPy form's chunks (`bounds`). */

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16                                  /* floats per vector */
#define MR 8                                   /* rows per register tile: 2 MR accumulators */
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(x) _mm512_set1_ps(x)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#define MR 6
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(x) _mm256_set1_ps(x)
#else                                          /* any other CPU: the compiler's vectors, no FMA */
#define VW 4
#define MR 4
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VSET1(x) ((vf){x, x, x, x})
#endif

typedef float vf __attribute__((vector_size(4 * VW)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* One mr x (nv VW) tile of c = alpha_i * sum_p a(i, p) b[p, :] (+ c when acc), a(i, p) at
 * a[i ars + p acs], rows of b ldb apart, of c ldc apart, alpha_i = alpha * (rs ? rs[i] : 1).
 * mr and nv are constants at every call (tile_dispatch), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, idx kk, const float *a,
                                                       idx ars, idx acs, const float *b, idx ldb, float *c,
                                                       idx ldc, const float *rs, float alpha, int acc) {
    vf s[MR][2];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) s[i][v] = (vf){0};
    for (idx p = 0; p < kk; p++) {
        const float *bp = b + p * ldb, *ap = a + p * acs;
        vf b0 = vload(bp), b1 = nv > 1 ? vload(bp + VW) : b0;
        for (int i = 0; i < mr; i++) {
            vf ai = VSET1(ap[i * ars]);
            s[i][0] = VFMA(ai, b0, s[i][0]);
            if (nv > 1) s[i][1] = VFMA(ai, b1, s[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float f = rs ? alpha * rs[i] : alpha;
        for (int v = 0; v < nv; v++) {
            vf r = s[i][v] * VSET1(f);
            if (acc) r += vload(c + i * ldc + v * VW);
            vstore(c + i * ldc + v * VW, r);
        }
    }
}

static void tile_dispatch(int mr, int nv, idx kk, const float *a, idx ars, idx acs, const float *b, idx ldb,
                          float *c, idx ldc, const float *rs, float alpha, int acc) {
#define TILE_CASE(m)                                                                   \
    case m:                                                                            \
        if (nv == 2) tile(m, 2, kk, a, ars, acs, b, ldb, c, ldc, rs, alpha, acc);      \
        else tile(m, 1, kk, a, ars, acs, b, ldb, c, ldc, rs, alpha, acc);              \
        break;
    switch (mr) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if MR > 4
        TILE_CASE(5) TILE_CASE(6)
#endif
#if MR > 6
        TILE_CASE(7) TILE_CASE(8)
#endif
    }
#undef TILE_CASE
}

/* c (m x n) = alpha_i * a (m x kk) b (kk x n) (+ c when acc), strides as in tile(); columns past
 * the last whole vector go one by one. */
static void small_gemm(idx m, idx n, idx kk, const float *a, idx ars, idx acs, const float *b, idx ldb, float *c,
                       idx ldc, const float *rs, float alpha, int acc) {
    for (idx i = 0; i < m; i += MR) {
        int mr = m - i < MR ? (int)(m - i) : MR;
        const float *ai = a + i * ars, *ri = rs ? rs + i : NULL;
        float *ci = c + i * ldc;
        idx j = 0;
        for (; j + 2 * VW <= n; j += 2 * VW) tile_dispatch(mr, 2, kk, ai, ars, acs, b + j, ldb, ci + j, ldc, ri, alpha, acc);
        for (; j + VW <= n; j += VW) tile_dispatch(mr, 1, kk, ai, ars, acs, b + j, ldb, ci + j, ldc, ri, alpha, acc);
        for (; j < n; j++)
            for (int r = 0; r < mr; r++) {
                float s = 0;
                for (idx p = 0; p < kk; p++) s += ai[r * ars + p * acs] * b[p * ldb + j];
                float f = ri ? alpha * ri[r] : alpha;
                ci[r * ldc + j] = acc ? ci[r * ldc + j] + s * f : s * f;
            }
    }
}

static inline idx round_up(idx x, idx to) { return (x + to - 1) / to * to; }

/* dst (cols x rows) = scale * transpose(src (rows x cols), rows ld apart), in blocks of 16 rows:
 * each store a whole vector (row by row, the strided stores ran at a tenth of the speed). */
static void transpose_scaled(const float *src, idx ld, idx rows, idx cols, float scale, float *dst) {
    idx j0 = 0;
    for (; j0 + 16 <= rows; j0 += 16)
        for (idx d = 0; d < cols; d++)
            for (int j = 0; j < 16; j++) dst[d * rows + j0 + j] = src[(j0 + j) * ld + d] * scale;
    for (; j0 < rows; j0++)
        for (idx d = 0; d < cols; d++) dst[d * rows + j0] = src[j0 * ld + d] * scale;
}

/* The largest of a[0..n), n >= 1, in 16 partial maxima (vectorised; a NaN need not win, it
 * reaches the output through the exponent anyway). */
static inline float row_max_f32(const float *a, idx n) {
    float acc[16], m = a[0];
    for (int l = 0; l < 16; l++) acc[l] = a[0];
    idx j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) acc[l] = a[j + l] > acc[l] ? a[j + l] : acc[l];
    for (; j < n; j++) m = a[j] > m ? a[j] : m;
    for (int l = 0; l < 16; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

/* Forward for pairs [bh0, bh1) of B x H: out, and lse (B, H, T) = rowmax(S) + log(rowsum(E)) per
 * query, all the backward needs to rebuild the probabilities. A tile of MR queries' scores lives
 * in a small workspace from the product through the softmax to the product with V and is then
 * dropped: nothing of size T x T is written. Returns 0, or -1 when the workspace could not be
 * allocated. */
int attention_forward_f32(const float *qkv, float *lse, float *out, idx bh0, idx bh1, idx heads, idx kv_heads,
                          idx t, idx c, double scale) {
    idx d = c / heads, ld = c + 2 * kv_heads * d, group = heads / kv_heads;
    float *kt = malloc(sizeof(float) * (d * t + MR * t + MR));  /* scale K^T (D, T), packed; E tile; r */
    if (!kt) return -1;
    float *e = kt + d * t, *r = e + MR * t;
    for (idx bh = bh0; bh < bh1; bh++) {
        idx b = bh / heads, h = bh % heads;
        const float *q = qkv + b * t * ld + h * d, *k = qkv + b * t * ld + c + h / group * d, *v = k + kv_heads * d;
        float *l = lse + bh * t, *o = out + b * t * c + h * d;
        transpose_scaled(k, ld, t, d, (float)scale, kt);
        for (idx i0 = 0; i0 < t; i0 += MR) {
            idx mr = t - i0 < MR ? t - i0 : MR;
            idx keys = round_up(i0 + mr, VW) < t ? round_up(i0 + mr, VW) : t;  /* the tile's causal width */
            small_gemm(mr, keys, d, q + i0 * ld, ld, 1, kt, t, e, t, NULL, 1.0f, 0);
            for (idx i = 0; i < mr; i++) {
                idx last = i0 + i;                              /* keys [0, last] */
                float *ei = e + i * t, mx = row_max_f32(ei, last + 1);
#pragma omp simd
                for (idx j = 0; j <= last; j++) ei[j] = exp_f32(ei[j] - mx);
                for (idx j = last + 1; j < i0 + mr; j++) ei[j] = 0;  /* the product below reads them */
                float sum = row_sum_f32(ei, last + 1);
                r[i] = 1.0f / sum;
                l[last] = mx + logf(sum);
            }
            /* O = r (E V): keys beyond the tile's last query are zero in E */
            small_gemm(mr, d, i0 + mr, e, t, 1, v, ld, o + i0 * c, c, r, 1.0f, 0);
        }
    }
    free(kt);
    return 0;
}

/* Backward for (batch, key/value head) pairs [bk0, bk1) of B x Hk: writes the columns of dqkv
 * (B, T, C + 2 Ck) of the pair's key and value head and of its query heads from the incoming
 * gradient g (B, T, C); a pair's query heads run one after another (the first writes dK and dV,
 * the others add), so pairs split over threads never write the same columns. Per query chunk (`bounds`, the last, which sees every key, first: it
 * writes dK and dV, the others add), tile by tile: the scores again, P = exp(S - lse) (the
 * forward's probabilities to rounding), dP = dO V^T, dS = P (dP - rowdot) with rowdot = dO . O
 * per query (= rowsum(dP P)); then dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. Returns 0,
 * or -1 when the workspace could not be allocated. */
int attention_backward_f32(const float *qkv, const float *lse, const float *out, const float *g, float *dqkv,
                           idx bk0, idx bk1, idx heads, idx kv_heads, idx t, idx c, double scale, const idx *bounds,
                           idx chunks) {
    idx d = c / heads, ld = c + 2 * kv_heads * d, group = heads / kv_heads, widest = 0;
    for (idx n = 0; n < chunks - 1; n++)
        widest = bounds[n + 1] - bounds[n] > widest ? bounds[n + 1] - bounds[n] : widest;
    float *kt = malloc(sizeof(float) * (2 * d * t + t + 2 * widest * t));
    if (!kt) return -1;
    float *vt = kt + d * t, *rd = vt + d * t, *pc = rd + t, *ds = pc + widest * t;  /* P and dS of a chunk */
    for (idx bk = bk0; bk < bk1; bk++) {
        idx b = bk / kv_heads, kh = bk % kv_heads;
        const float *k = qkv + b * t * ld + c + kh * d, *v = k + kv_heads * d;
        float *dk = dqkv + b * t * ld + c + kh * d, *dv = dk + kv_heads * d;
        transpose_scaled(k, ld, t, d, (float)scale, kt);
        transpose_scaled(v, ld, t, d, 1.0f, vt);
        for (idx h = kh * group; h < (kh + 1) * group; h++) {
            const float *q = qkv + b * t * ld + h * d;
            const float *l = lse + (b * heads + h) * t, *gi = g + b * t * c + h * d, *o = out + b * t * c + h * d;
            float *dq = dqkv + b * t * ld + h * d;
            for (idx i = 0; i < t; i++) rd[i] = row_dot_f32(gi + i * c, o + i * c, d);
            for (idx n = chunks - 2; n >= 0; n--) {
                idx q0 = bounds[n], q1 = bounds[n + 1], first = n == chunks - 2 && h == kh * group;
                for (idx i0 = q0; i0 < q1; i0 += MR) {          /* P and dS rows, tile by tile */
                    idx mr = q1 - i0 < MR ? q1 - i0 : MR;
                    idx keys = round_up(i0 + mr, VW) < q1 ? round_up(i0 + mr, VW) : q1;
                    float *pi0 = pc + (i0 - q0) * t, *dsi = ds + (i0 - q0) * t;
                    small_gemm(mr, keys, d, q + i0 * ld, ld, 1, kt, t, pi0, t, NULL, 1.0f, 0);
                    small_gemm(mr, keys, d, gi + i0 * c, c, 1, vt, t, dsi, t, NULL, 1.0f, 0);
                    for (idx i = i0; i < i0 + mr; i++) {
                        float *pr = pc + (i - q0) * t, *dr = ds + (i - q0) * t, li = l[i], ri = rd[i];
#pragma omp simd
                        for (idx j = 0; j <= i; j++) {
                            float pj = exp_f32(pr[j] - li);
                            pr[j] = pj;
                            dr[j] = pj * (dr[j] - ri);
                        }
                        for (idx j = i + 1; j < q1; j++) pr[j] = dr[j] = 0;  /* read by the products below */
                    }
                }
                /* dQ rows of the chunk: keys up to each tile's last query */
                for (idx i0 = q0; i0 < q1; i0 += MR) {
                    idx mr = q1 - i0 < MR ? q1 - i0 : MR;
                    small_gemm(mr, d, i0 + mr, ds + (i0 - q0) * t, t, 1, k, ld, dq + i0 * ld, ld, NULL, (float)scale, 0);
                }
                /* dK and dV of keys [0, q1): key j gets queries i >= max(j, q0) of the chunk */
                for (idx j0 = 0; j0 < q1; j0 += MR) {
                    idx mr = q1 - j0 < MR ? q1 - j0 : MR, from = j0 > q0 ? j0 : q0;
                    small_gemm(mr, d, q1 - from, ds + (from - q0) * t + j0, 1, t, q + from * ld, ld, dk + j0 * ld, ld,
                               NULL, (float)scale, !first);
                    small_gemm(mr, d, q1 - from, pc + (from - q0) * t + j0, 1, t, gi + from * c, c, dv + j0 * ld, ld,
                               NULL, 1.0f, !first);
                }
            }
        }
    }
    free(kt);
    return 0;
}
