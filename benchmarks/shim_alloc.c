/* Cost of a cuMemAlloc_v2 + cuMemFree_v2 pair, called the way a linked program calls them
 * (-lcuda). Run bare, it measures the driver (the fake one in tests/fakes); run with
 * LD_PRELOAD=libmpsshim.so it measures the driver behind the shim. benchmarks/shim_alloc.py
 * runs both and compares.
 *
 *   shim_alloc THREADS PAIRS_PER_THREAD BYTES
 * prints one line: "threads=T pairs=N wall_ns_per_pair=X cpu_ns_per_pair=Y refused=R"
 * (wall: elapsed time / all pairs of all threads; cpu: user+system time / all pairs). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
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

static void *worker(void *arg) {
    long *refused = arg;
    if (cuCtxSetCurrent(ctx) != 0) abort();
    run_pairs(WARMUP);
    pthread_barrier_wait(&start);
    *refused = run_pairs(pairs);
    return NULL;
}

static double seconds(const struct timeval *tv) { return (double)tv->tv_sec + (double)tv->tv_usec / 1e6; }

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
    long refused[256] = {0};
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, worker, &refused[i]);
    struct rusage r0, r1;
    struct timespec t0, t1;
    pthread_barrier_wait(&start);
    getrusage(RUSAGE_SELF, &r0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    getrusage(RUSAGE_SELF, &r1);
    double total = (double)pairs * threads;
    double wall = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    double cpu = (seconds(&r1.ru_utime) - seconds(&r0.ru_utime) + seconds(&r1.ru_stime) - seconds(&r0.ru_stime)) * 1e9;
    long refused_all = 0;
    for (int i = 0; i < threads; i++) refused_all += refused[i];
    printf("threads=%d pairs=%.0f wall_ns_per_pair=%.1f cpu_ns_per_pair=%.1f refused=%ld\n", threads, total,
           wall / total, cpu / total, refused_all);
    return 0;
}
