/* mpirt's native thread pool: runs a list of kernel calls (this library's kernels and the BLAS's
 * cblas_?gemm) on worker threads that never touch Python.
 *
 * Why: a Python pool thread that sleeps between tasks takes 80-130 us to start one on these VMs
 * (the idle virtual CPU halts; the thread then needs the GIL), about as long as a tiny model's
 * block of work, ~45 times a step. These workers spin for a while (POOL_SPIN_NS, yielding the CPU
 * to anyone else runnable) after each run before they sleep, so a run that follows within that
 * time starts in about a microsecond.
 *
 * A call is a row of POOL_ARGS longs: the kernel's index in PACKED (pool_kernel_index), then its
 * arguments in order, pointers and integers as they are, doubles by their bits. One run at a
 * time: a second thread that calls pool_run meanwhile runs its calls itself. */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_ARGS 16
#define POOL_MAX_WORKERS 255
#define POOL_SPIN_NS 2000000L                 /* 2 ms: longer than the gaps between a step's runs */

static inline double arg_double(idx bits) { double d; memcpy(&d, &bits, sizeof d); return d; }
#define PF(i) ((float *)a[i])

/* The kernels, unpacked from a call row (a[0] is the index, arguments from a[1]). */
#define PACK_BODY(T, S)                                                                                      \
    static int packed_norm_forward_##S(const idx *a) {                                                      \
        norm_forward_##S((T *)a[1], (T *)a[2], (T *)a[3], (T *)a[4], (T *)a[5], (T *)a[6], a[7], a[8],       \
                         arg_double(a[9]), (int)a[10]);                                                      \
        return 0;                                                                                            \
    }                                                                                                        \
    static int packed_norm_backward_##S(const idx *a) {                                                     \
        norm_backward_##S((T *)a[1], (T *)a[2], (T *)a[3], (T *)a[4], (T *)a[5], (T *)a[6], (T *)a[7], a[8], \
                          a[9], (int)a[10]);                                                                 \
        return 0;                                                                                            \
    }                                                                                                        \
    static int packed_gelu_##S(const idx *a) {                                                               \
        gelu_##S((T *)a[1], (T *)a[2], (T *)a[3], a[4]);                                                     \
        return 0;                                                                                            \
    }                                                                                                        \
    static int packed_adamw_##S(const idx *a) {                                                             \
        adamw_##S((T *)a[1], (T *)a[2], (T *)a[3], (T *)a[4], a[5], arg_double(a[6]), arg_double(a[7]),      \
                  arg_double(a[8]), arg_double(a[9]), arg_double(a[10]));                                    \
        return 0;                                                                                            \
    }
PACK_BODY(float, f32)
PACK_BODY(double, f64)

static int packed_attention_forward_f32(const idx *a) {
    return attention_forward_f32(PF(1), PF(2), PF(3), a[4], a[5], a[6], a[7], a[8], a[9], arg_double(a[10]));
}
static int packed_attention_backward_f32(const idx *a) {
    return attention_backward_f32(PF(1), PF(2), PF(3), PF(4), PF(5), a[6], a[7], a[8], a[9], a[10], a[11],
                                  arg_double(a[12]), (const idx *)a[13], a[14]);
}

/* cblas_?gemm, row-major, alpha 1: a[1] the function, a[2] 1 for 64-bit integers (ILP64), then
 * transa, transb, m, n, k, A, lda, B, ldb, beta, C, ldc; a[15], if not NULL, a bias (n) added to
 * every row of C afterwards, while it is in cache (the same bits as adding it after the GEMM). */
#define PACK_GEMM(T, S)                                                                                      \
    typedef void (*gemm64_##S)(int, int, int, int64_t, int64_t, int64_t, T, const T *, int64_t, const T *,  \
                               int64_t, T, T *, int64_t);                                                    \
    typedef void (*gemm32_##S)(int, int, int, int, int, int, T, const T *, int, const T *, int, T, T *, int); \
    static int packed_gemm_##S(const idx *a) {                                                              \
        T beta = (T)arg_double(a[12]);                                                                       \
        if (a[2])                                                                                            \
            ((gemm64_##S)a[1])(101, (int)a[3], (int)a[4], a[5], a[6], a[7], (T)1, (T *)a[8], a[9], (T *)a[10], \
                               a[11], beta, (T *)a[13], a[14]);                                              \
        else                                                                                                 \
            ((gemm32_##S)a[1])(101, (int)a[3], (int)a[4], (int)a[5], (int)a[6], (int)a[7], (T)1, (T *)a[8],  \
                               (int)a[9], (T *)a[10], (int)a[11], beta, (T *)a[13], (int)a[14]);             \
        const T *bias = (const T *)a[15];                                                                    \
        if (bias)                                                                                            \
            for (idx i = 0; i < a[5]; i++) {                                                                 \
                T *row = (T *)a[13] + i * a[14];                                                             \
                for (idx j = 0; j < a[6]; j++) row[j] += bias[j];                                            \
            }                                                                                                \
        return 0;                                                                                            \
    }
PACK_GEMM(float, f32)
PACK_GEMM(double, f64)

typedef int (*packed_fn)(const idx *);   /* 0, or -1: no memory for a workspace */
static const struct { const char *name; packed_fn fn; } PACKED[] = {
    {"norm_forward_f32", packed_norm_forward_f32}, {"norm_forward_f64", packed_norm_forward_f64},
    {"norm_backward_f32", packed_norm_backward_f32}, {"norm_backward_f64", packed_norm_backward_f64},
    {"gelu_f32", packed_gelu_f32}, {"gelu_f64", packed_gelu_f64},
    {"adamw_f32", packed_adamw_f32}, {"adamw_f64", packed_adamw_f64},
    {"attention_forward_f32", packed_attention_forward_f32},
    {"attention_backward_f32", packed_attention_backward_f32},
    {"gemm_f32", packed_gemm_f32}, {"gemm_f64", packed_gemm_f64},
};
#define N_PACKED ((idx)(sizeof PACKED / sizeof PACKED[0]))

/* The index of kernel `name` for a call row, or -1. */
idx pool_kernel_index(const char *name) {
    for (idx i = 0; i < N_PACKED; i++)
        if (!strcmp(PACKED[i].name, name)) return i;
    return -1;
}

static pthread_mutex_t pool_admin = PTHREAD_MUTEX_INITIALIZER;  /* one pool_start/pool_stop at a time */

static struct {
    pthread_mutex_t lock;                      /* publishing a run; sleeping workers wait on `wake` */
    pthread_cond_t wake;
    atomic_long generation;                    /* bumped when a run is published */
    const idx *calls;
    idx ncalls;
    atomic_long next, done, inside, failed;    /* next call to claim, calls done, workers in a run */
    atomic_int stop, sleepers, busy, workers;
    pthread_t threads[POOL_MAX_WORKERS];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void run_claimed(void) {
    for (;;) {
        idx i = atomic_fetch_add(&pool.next, 1);
        if (i >= pool.ncalls) return;
        const idx *call = pool.calls + i * POOL_ARGS;
        if (PACKED[call[0]].fn(call)) atomic_fetch_add(&pool.failed, 1);
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *pool_worker(void *unused) {
    (void)unused;
    long seen = atomic_load(&pool.generation);
    for (;;) {
        long start = now_ns();
        for (int spins = 1; atomic_load(&pool.generation) == seen && !atomic_load(&pool.stop); spins++) {
            cpu_relax();
            if (spins % 256 == 0) {
                if (now_ns() - start > POOL_SPIN_NS) {          /* nothing for a while: sleep */
                    pthread_mutex_lock(&pool.lock);
                    atomic_fetch_add(&pool.sleepers, 1);
                    while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.stop))
                        pthread_cond_wait(&pool.wake, &pool.lock);
                    atomic_fetch_sub(&pool.sleepers, 1);
                    pthread_mutex_unlock(&pool.lock);
                } else {
                    sched_yield();                              /* whoever else is runnable goes first */
                }
            }
        }
        pthread_mutex_lock(&pool.lock);                         /* the run's calls are stable while inside */
        if (atomic_load(&pool.stop)) {
            pthread_mutex_unlock(&pool.lock);
            return NULL;
        }
        seen = atomic_load(&pool.generation);
        atomic_fetch_add(&pool.inside, 1);
        pthread_mutex_unlock(&pool.lock);
        run_claimed();
        atomic_fetch_sub(&pool.inside, 1);
    }
}

static void stop_workers(void) {
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.stop, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    int n = atomic_load(&pool.workers);
    atomic_store(&pool.workers, 0);                             /* runs from now on are inline */
    for (int i = 0; i < n; i++) pthread_join(pool.threads[i], NULL);
    atomic_store(&pool.stop, 0);
}

/* Stop and join the workers (set_num_threads, exit). */
void pool_stop(void) {
    pthread_mutex_lock(&pool_admin);
    stop_workers();
    pthread_mutex_unlock(&pool_admin);
}

/* In a forked child: the workers are the parent's; forget them (and any lock a parent thread held). */
void pool_forget(void) {
    pthread_mutex_init(&pool_admin, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.workers, 0);
    atomic_store(&pool.inside, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.stop, 0);
}

/* Make the pool `workers` threads (0: none, calls run on the caller). Returns the count started. */
int pool_start(int workers) {
    if (workers > POOL_MAX_WORKERS) workers = POOL_MAX_WORKERS;
    pthread_mutex_lock(&pool_admin);
    if (workers != atomic_load(&pool.workers)) {
        stop_workers();
        sigset_t all, old;                                      /* signals go to Python's main thread */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int n = 0;
        while (n < workers && !pthread_create(&pool.threads[n], NULL, pool_worker, NULL)) n++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        atomic_store(&pool.workers, n);
    }
    int started = atomic_load(&pool.workers);
    pthread_mutex_unlock(&pool_admin);
    return started;
}

/* Run `ncalls` call rows (POOL_ARGS longs each) on the caller and the workers; returns when all
 * are done: 0; -1 when a call could not allocate its workspace; -2 when a row's kernel index is
 * out of range (then nothing runs). */
int pool_run(const idx *calls, idx ncalls) {
    for (idx i = 0; i < ncalls; i++)
        if (calls[i * POOL_ARGS] < 0 || calls[i * POOL_ARGS] >= N_PACKED) return -2;
    int expected = 0;
    if (atomic_load(&pool.workers) == 0 || ncalls < 2 || !atomic_compare_exchange_strong(&pool.busy, &expected, 1)) {
        int failed = 0;
        for (idx i = 0; i < ncalls; i++) failed |= PACKED[calls[i * POOL_ARGS]].fn(calls + i * POOL_ARGS);
        return failed ? -1 : 0;
    }
    pthread_mutex_lock(&pool.lock);
    while (atomic_load(&pool.inside)) {                         /* a late worker of the last run */
        pthread_mutex_unlock(&pool.lock);
        cpu_relax();
        pthread_mutex_lock(&pool.lock);
    }
    pool.calls = calls;
    pool.ncalls = ncalls;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.failed, 0);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers)) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_claimed();
    for (int spins = 1; atomic_load(&pool.done) < ncalls; spins++) {
        cpu_relax();
        if (spins % 256 == 0) sched_yield();
    }
    int failed = atomic_load(&pool.failed) != 0;
    atomic_store(&pool.busy, 0);
    return failed ? -1 : 0;
}
