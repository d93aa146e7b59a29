/* mpirt's fused CPU kernels: one pass over the data where NumPy needs several.
 *
 * Compiled on the machine that runs them (mpirt/kernels/__init__.py: cc -O3 -march=native
 * -fopenmp-simd) and called through ctypes, which releases the GIL, so mpirt's thread pools run
 * row blocks of one call side by side. The kernels of kernels_body.h exist for float and double
 * (it is included once per type); the attention's (kernels_attention.h) for float only. No
 * -ffast-math: NaN and inf must reach the output as they would through NumPy (the loss scaler
 * and the non-finite checks rely on it), and a sum must not change with the address of its row
 * (runs repeat to the bit): reductions keep LANES partial sums.
 */
#define _POSIX_C_SOURCE 200809L   /* pthread_sigmask, clock_gettime under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef long idx;

/* exp(x) for float, vectorisable (no libm call): x = n ln2 + r, |r| <= ln2/2, exp(r) by a
 * degree-6 polynomial (Cephes' coefficients), 2^n put into the exponent bits. Relative error
 * about 2 ulp. Inputs below -87.3 give ~1e-38 instead of a denormal (callers never rely on
 * denormals); above 88.3 the largest finite range; NaN stays NaN (comparisons keep it). */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    float n = rintf(x * 1.44269504088896341f);          /* vectorises (a floor with a branch does not) */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  /* 2^n, n in [-126, 127] after the clamp */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp for double: libm's, always the scalar one. (Inlined into an `omp simd` loop, GCC would take
 * libmvec's vector exp for the loop body and the scalar exp for its peeled ends: two results for
 * one input, depending on where the element sits.) double runs the tests, not the speed. */
__attribute__((noinline)) static double exp_f64(double x) { return exp(x); }

#define T float
#define SUFFIX(name) name##_f32
#define EXP exp_f32
#define SQRT sqrtf
#define LOG logf
#define LANES 16
#include "kernels_body.h"
#undef T
#undef SUFFIX
#undef EXP
#undef SQRT
#undef LOG
#undef LANES

#define T double
#define SUFFIX(name) name##_f64
#define EXP exp_f64
#define SQRT sqrt
#define LOG log
#define LANES 8
#include "kernels_body.h"
#undef T
#undef SUFFIX
#undef EXP
#undef SQRT
#undef LOG
#undef LANES

#include "kernels_attention.h"   /* float only: float64 attention runs its NumPy form */
#include "kernels_pool.h"        /* the native thread pool that runs lists of the calls above */
