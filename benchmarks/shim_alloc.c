/* Cost of a cuMemAlloc_v2 + cuMemFree_v2 pair, called the way a linked program calls them
 * (-lcuda). Run bare, it measures the driver (the fake one in tests/fakes); run with
 * LD_PRELOAD=libmpsshim.so it measures the driver behind the shim. benchmarks/shim_alloc.py
 * runs both and compares.
 *
 *   shim_alloc THREADS PAIRS_PER_THREAD BYTES
 * prints one line: "threads=T pairs=N wall_ns_per_pair=X cpu_ns_per_pair=Y refused=R"
 * (wall: from the first thread's start to the last thread's end, / all pairs of all threads;
 * cpu: the threads' own CPU time (CLOCK_THREAD_CPUTIME_ID around their loops), / all pairs).
 * Each thread reads its clocks itself, so a descheduled main thread cannot skew them. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, int dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);

#define WARMUP 2000

static CUcontext ctx;
static long pairs;
static size_t bytes;
static pthread_barrier_t start;

static long run_pairs(long n) {
    long refused = 0;
    for (long i = 0; i < n; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, bytes) != 0) {
            refused++;
            continue;
        }
        if (cuMemFree_v2(p) != 0) abort();
    }
    return refused;
}

struct result {
    long refused;
    double wall_start, wall_end, cpu;
};

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void *worker(void *arg) {
    struct result *res = arg;
    if (cuCtxSetCurrent(ctx) != 0) abort();
    run_pairs(WARMUP);
    pthread_barrier_wait(&start);
    double c0 = now(CLOCK_THREAD_CPUTIME_ID);
    res->wall_start = now(CLOCK_MONOTONIC);
    res->refused = run_pairs(pairs);
    res->wall_end = now(CLOCK_MONOTONIC);
    res->cpu = now(CLOCK_THREAD_CPUTIME_ID) - c0;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s THREADS PAIRS_PER_THREAD BYTES\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    pairs = atol(argv[2]);
    bytes = (size_t)atoll(argv[3]);
    if (threads < 1 || threads > 256 || pairs < 1 || bytes < 1) {
        fprintf(stderr, "bad arguments: THREADS 1..256, PAIRS_PER_THREAD >= 1, BYTES >= 1\n");
        return 2;
    }
    if (cuInit(0) != 0 || cuDevicePrimaryCtxRetain(&ctx, 0) != 0) {
        fprintf(stderr, "driver initialisation failed\n");
        return 1;
    }
    pthread_t tid[256];
    static struct result res[256];
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, worker, &res[i]);
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    double total = (double)pairs * threads, first = res[0].wall_start, last = res[0].wall_end, cpu = 0;
    long refused_all = 0;
    for (int i = 0; i < threads; i++) {
        if (res[i].wall_start < first) first = res[i].wall_start;
        if (res[i].wall_end > last) last = res[i].wall_end;
        cpu += res[i].cpu;
        refused_all += res[i].refused;
    }
    double wall = last - first;
    printf("threads=%d pairs=%.0f wall_ns_per_pair=%.1f cpu_ns_per_pair=%.1f refused=%ld\n", threads, total,
           wall / total, cpu / total, refused_all);
    return 0;
}
