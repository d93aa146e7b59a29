/* The FMA throughput of each core: the ceiling of mpirt's MFU on CPUs (mpirt/flops.py).
 *
 *   fma_peak BITS CPU...   prints "CPU FLOP/s" per CPU (float32 lanes with BITS=32, float64 with 64)
 *
 * Built by mpirt/flops.py with -O2 -march=native -ffp-contract=fast -DVECTOR_BYTES=<the SIMD width
 * /proc/cpuinfo names> (64: AVX-512, 32: AVX2, 16: SSE or NEON). The process pins itself to one CPU
 * at a time and runs NACC independent multiply-add chains (more than FMA latency x FMA units on
 * any core made so far), so the loop runs at the core's FMA issue rate. Rounds are timed in thread
 * CPU time, which stops while the thread waits for a CPU: another process on the core slows no
 * round down, it only takes turns. A virtual machine's CPU taken away by its host still counts as
 * the thread's time, and a neighbour on the host's other hyperthread of the core shares its FMA
 * units (a CI machine measured a third below the core's rate over a whole 80 ms): the rounds are
 * spread over about a quarter of a second (a pause between two) for some of them to miss a busy
 * spell of the host. The best round of each CPU is printed.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef VECTOR_BYTES
#define VECTOR_BYTES 16
#endif
#if VECTOR_BYTES >= 32 && !defined(__aarch64__)
#define NACC (VECTOR_BYTES >= 64 ? 16 : 12)   /* accumulators + 2 operands fit the vector registers */
#else
#define NACC 16
#endif
#define ROUNDS 24
#define ROUND_S 2e-3
#define PAUSE_NS 8000000L   /* between rounds */

typedef float vf __attribute__((vector_size(VECTOR_BYTES)));
typedef double vd __attribute__((vector_size(VECTOR_BYTES)));

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* acc = acc * m + c, NACC chains, n times; returns a sum of the chains so nothing is optimised
 * away. m < 1 and c > 0 keep every value near c / (1 - m): no overflow, no denormals. */
#define CHAINS(T, NAME)                                                              \
    static double NAME(long n, T m, T c) {                                           \
        T acc[NACC];                                                                 \
        for (int i = 0; i < NACC; i++) acc[i] = c * (__typeof__(acc[0][0]))(i + 1);   \
        for (long k = 0; k < n; k++) {                                               \
            _Pragma("GCC unroll 16")                                                 \
            for (int i = 0; i < NACC; i++) acc[i] = acc[i] * m + c;                  \
        }                                                                            \
        double s = 0;                                                                \
        for (int i = 0; i < NACC; i++)                                               \
            for (unsigned j = 0; j < sizeof(T) / sizeof(acc[0][0]); j++) s += acc[i][j]; \
        return s;                                                                    \
    }
CHAINS(vf, chains_f32)
CHAINS(vd, chains_f64)

static volatile double sink;

/* FLOP/s of one round of n iterations, or the best of ROUNDS rounds sized to ROUND_S */
static double round_rate(int bits, long n) {
    double t0 = thread_seconds();
    if (bits == 32) {
        vf m = (vf){0} + 0.999f, c = (vf){0} + 1e-3f;
        sink = chains_f32(n, m, c);
    } else {
        vd m = (vd){0} + 0.999, c = (vd){0} + 1e-3;
        sink = chains_f64(n, m, c);
    }
    double dt = thread_seconds() - t0;
    double flops = 2.0 * NACC * (VECTOR_BYTES / (bits / 8)) * (double)n;
    return dt > 0 ? flops / dt : 0;
}

static double core_rate(int bits) {
    long n = 1000;
    double rate = round_rate(bits, n);
    while (rate <= 0 || 2.0 * NACC * (VECTOR_BYTES / (bits / 8)) * n / rate < ROUND_S) {
        n *= 4;
        rate = round_rate(bits, n);
    }
    double best = 0;
    for (int r = 0; r < ROUNDS; r++) {
        double got = round_rate(bits, n);
        best = got > best ? got : best;
        struct timespec pause = {0, PAUSE_NS};
        nanosleep(&pause, NULL);
    }
    return best;
}

int main(int argc, char **argv) {
    if (argc < 3 || (atoi(argv[1]) != 32 && atoi(argv[1]) != 64)) {
        fprintf(stderr, "usage: %s 32|64 CPU...\n", argv[0]);
        return 2;
    }
    int bits = atoi(argv[1]);
    for (int a = 2; a < argc; a++) {
        int cpu = atoi(argv[a]);
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0)
            continue;   /* not ours to run on: the caller counts it as unmeasured */
        sched_yield();  /* move onto it now */
        printf("%d %.6e\n", cpu, core_rate(bits));
        fflush(stdout);
    }
    return 0;
}
