/* The kernels for one element type T (see kernels.c). Arrays are C-contiguous unless a stride
 * says otherwise; `rows` x `n` is a 2-D block of rows; a NULL pointer is an output not wanted
 * or an input absent (no weight, no bias). */

/* Sums in LANES fixed partial sums, added in a fixed order: vectorised, and the same bits wherever
 * the row sits in memory (a simd reduction peels for alignment, so its order, and its rounding,
 * would depend on the address: runs must repeat exactly). */
static inline T SUFFIX(row_sum)(const T *a, idx n) {
    T acc[LANES] = {0}, s = 0;
    idx j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l];
    for (; j < n; j++) s += a[j];
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

static inline T SUFFIX(row_dot)(const T *a, const T *b, idx n) {
    T acc[LANES] = {0}, s = 0;
    idx j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    for (; j < n; j++) s += a[j] * b[j];
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* Layer norm (center = 1) and RMS norm (center = 0) forward: xhat = (x - mean) * rstd with
 * rstd = 1/sqrt(mean((x - mean)^2) + eps), the mean taken as 0 for RMS norm; y = xhat * w + b
 * (w and b optional). */
void SUFFIX(norm_forward)(const T *x, const T *w, const T *b, T *xhat, T *rstd, T *y, idx rows, idx n,
                          double eps, int center) {
    for (idx i = 0; i < rows; i++) {
        const T *xi = x + i * n;
        T *hi = xhat + i * n, *yi = y + i * n;
        T mean = center ? SUFFIX(row_sum)(xi, n) / (T)n : (T)0;
#pragma omp simd
        for (idx j = 0; j < n; j++) hi[j] = xi[j] - mean;
        T r = (T)1 / SQRT(SUFFIX(row_dot)(hi, hi, n) / (T)n + (T)eps);
        rstd[i] = r;
#pragma omp simd
        for (idx j = 0; j < n; j++) {
            T h = hi[j] * r, s = w ? h * w[j] : h;
            hi[j] = h;
            yi[j] = b ? s + b[j] : s;
        }
    }
}

/* The norms' backward over a block of rows: gx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))
 * with gh = g * w (mean(gh) taken as 0 for RMS norm, center = 0); gw += sum_rows(g * xhat),
 * gb += sum_rows(g). */
void SUFFIX(norm_backward)(const T *g, const T *xhat, const T *rstd, const T *w, T *gx, T *gw, T *gb,
                           idx rows, idx n, int center) {
    for (idx i = 0; i < rows; i++) {
        const T *gi = g + i * n, *hi = xhat + i * n;
        if (gw) {
#pragma omp simd
            for (idx j = 0; j < n; j++) gw[j] += gi[j] * hi[j];
        }
        if (gb) {
#pragma omp simd
            for (idx j = 0; j < n; j++) gb[j] += gi[j];
        }
        if (!gx) continue;
        T *oi = gx + i * n;
#pragma omp simd
        for (idx j = 0; j < n; j++) oi[j] = w ? gi[j] * w[j] : gi[j];
        T a = center ? SUFFIX(row_sum)(oi, n) / (T)n : (T)0;
        T c = SUFFIX(row_dot)(oi, hi, n) / (T)n, r = rstd[i];
#pragma omp simd
        for (idx j = 0; j < n; j++) oi[j] = r * (oi[j] - a - hi[j] * c);
    }
}

/* GPT-2's tanh GELU: y = x h, h = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), u = k (x + a x^3);
 * with d, also dy/dx = h (1 + 2 w (1 - h)), w = k x (1 + 3 a x^2). */
void SUFFIX(gelu)(const T *x, T *y, T *d, idx n) {
    const T k = (T)0.7978845608028654, a = (T)0.044715;
    if (d) {
#pragma omp simd
        for (idx i = 0; i < n; i++) {
            T v = x[i], v2 = v * v;
            T h = (T)1 / ((T)1 + EXP((T)-2 * k * v * ((T)1 + a * v2)));
            y[i] = v * h;
            d[i] = h * ((T)1 + (T)2 * k * v * ((T)1 + (T)3 * a * v2) * ((T)1 - h));
        }
    } else {
#pragma omp simd
        for (idx i = 0; i < n; i++) {
            T v = x[i], v2 = v * v;                     /* as above, to the bit (recomputation) */
            y[i] = v * ((T)1 / ((T)1 + EXP((T)-2 * k * v * ((T)1 + a * v2))));
        }
    }
}

/* Causal softmax of one query chunk, unnormalised, in place. `s` holds `mats` matrices (stride
 * `mat_stride`) of `rows` x `cols` scores (row stride `ld`); row i is query q0 + i and sees keys
 * j <= q0 + i. Each row becomes E = exp(s - rowmax) on its keys and 0 above them;
 * rinv[m * stat_stride + i] = 1 / rowsum(E), lse[m * stat_stride + i] = rowmax + log(rowsum(E)). */
void SUFFIX(causal_softmax)(T *s, T *rinv, T *lse, idx mats, idx mat_stride, idx rows, idx cols, idx ld, idx q0,
                            idx stat_stride) {
    for (idx m = 0; m < mats; m++) {
        for (idx i = 0; i < rows; i++) {
            T *si = s + m * mat_stride + i * ld;
            idx keys = q0 + i + 1 < cols ? q0 + i + 1 : cols;
            T mx = si[0];
#pragma omp simd reduction(max : mx)
            for (idx j = 1; j < keys; j++) mx = si[j] > mx ? si[j] : mx;
#pragma omp simd
            for (idx j = 0; j < keys; j++) si[j] = EXP(si[j] - mx);
            for (idx j = keys; j < cols; j++) si[j] = 0;
            T sum = SUFFIX(row_sum)(si, keys);
            rinv[m * stat_stride + i] = (T)1 / sum;
            lse[m * stat_stride + i] = mx + LOG(sum);
        }
    }
}

/* The probabilities again from the scores in place: P = exp(s - lse[row]) on each row's keys, 0
 * above them; `s` and the rows as in causal_softmax, lse[m * stat_stride + i]. */
void SUFFIX(causal_probs)(T *s, const T *lse, idx mats, idx mat_stride, idx rows, idx cols, idx ld, idx q0,
                          idx stat_stride) {
    for (idx m = 0; m < mats; m++) {
        for (idx i = 0; i < rows; i++) {
            T *si = s + m * mat_stride + i * ld, l = lse[m * stat_stride + i];
            idx keys = q0 + i + 1 < cols ? q0 + i + 1 : cols;
#pragma omp simd
            for (idx j = 0; j < keys; j++) si[j] = EXP(si[j] - l);
            for (idx j = keys; j < cols; j++) si[j] = 0;
        }
    }
}

/* The attention's score gradient in place: ds = e * (ds - rd[row]), `ds` contiguous (mats, rows,
 * cols), `e` strided as in causal_softmax. */
void SUFFIX(softmax_grad)(T *ds, const T *e, const T *rd, idx mats, idx mat_stride, idx rows, idx cols, idx ld) {
    for (idx m = 0; m < mats; m++) {
        for (idx i = 0; i < rows; i++) {
            T *di = ds + (m * rows + i) * cols;
            const T *ei = e + m * mat_stride + i * ld;
            T r = rd[m * rows + i];
#pragma omp simd
            for (idx j = 0; j < cols; j++) di[j] = ei[j] * (di[j] - r);
        }
    }
}

/* One AdamW step in place, in the order of mpirt.optim.adamw_update's NumPy form (so float64
 * results agree to the last bit): p *= decay; m = beta1 m + (1 - beta1) g;
 * v = beta2 v + (1 - beta2) g^2; p -= m / (sqrt(v) + eps_c2) * step_size. */
void SUFFIX(adamw)(T *p, const T *g, T *m, T *v, idx n, double decay, double beta1, double beta2,
                   double eps_c2, double step_size) {
    const T d = (T)decay, b1 = (T)beta1, b2 = (T)beta2, e = (T)eps_c2, a = (T)step_size;
    const T c1 = (T)(1.0 - beta1), c2 = (T)(1.0 - beta2);
#pragma omp simd
    for (idx i = 0; i < n; i++) {
        T gi = g[i];
        T mi = m[i] * b1 + gi * c1;
        T vi = v[i] * b2 + gi * gi * c2;
        m[i] = mi;
        v[i] = vi;
        T pi = decay != 1.0 ? p[i] * d : p[i];
        p[i] = pi - mi / (SQRT(vi) + e) * a;
    }
}
