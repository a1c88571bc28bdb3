/* Several threads free the same pointer at once (a program's double free, racing), many times.
 *
 *   racefree FREE THREADS ITERS SIZE [SECONDS]
 *   FREE  cuMemFree_v2 | cuMemFreeAsync (reached through dlopen + dlsym)
 * Each round the main thread allocates SIZE bytes on device 0, then releases THREADS spinning
 * threads that all free that pointer at once. The driver frees it once; the others get an
 * error. It runs ITERS rounds, or fewer if SECONDS pass first (spinning threads on a loaded
 * 2-core machine can take a thousand times longer per round). Prints "racefree rounds=N
 * freed=F failed=E other=O driver_used=U region_used=R": F must be N, and U and R 0 (what the
 * driver and the shim's region count once everything is freed). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "region.h" /* ms_snapshot, for mpsshim_usage */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

static CUresult (*set_ctx)(CUcontext);
static CUresult (*mem_free)(CUdeviceptr);
static CUresult (*mem_free_async)(CUdeviceptr, void *);
static CUcontext ctx;
static int nthreads;
static long iters;
static CUdeviceptr target;
static long round_no; /* bumped by the main thread to start a round */
static long no_round = -1; /* the first round that will not start: set once the main thread stops */
static long done;     /* threads finished with the round */
static long freed, failed, other;

static void wait_until(long *word, long value)
{
    for (unsigned n = 0; __atomic_load_n(word, __ATOMIC_ACQUIRE) < value; n++)
        if (n > 200)
            sched_yield();
}

static void *worker(void *arg)
{
    (void)arg;
    if (set_ctx(ctx) != 0)
        abort();
    for (long r = 1;; r++) {
        for (unsigned n = 0; __atomic_load_n(&round_no, __ATOMIC_ACQUIRE) < r; n++) {
            long last = __atomic_load_n(&no_round, __ATOMIC_ACQUIRE);
            if (last >= 0 && r >= last)
                return NULL;
            if (n > 200)
                sched_yield();
        }
        CUdeviceptr p = __atomic_load_n(&target, __ATOMIC_RELAXED);
        CUresult rc = mem_free ? mem_free(p) : mem_free_async(p, NULL);
        __atomic_add_fetch(rc == 0 ? &freed : rc == 1 ? &failed : &other, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&done, 1, __ATOMIC_RELEASE);
    }
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *need(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "racefree: no %s\n", name);
        exit(3);
    }
    return p;
}

int main(int argc, char **argv)
{
    if ((argc != 5 && argc != 6) || (strcmp(argv[1], "cuMemFree_v2") != 0 && strcmp(argv[1], "cuMemFreeAsync") != 0)) {
        fprintf(stderr, "usage: racefree cuMemFree_v2|cuMemFreeAsync THREADS ITERS SIZE [SECONDS]\n");
        return 2;
    }
    nthreads = atoi(argv[2]);
    iters = atol(argv[3]);
    unsigned long long size = strtoull(argv[4], NULL, 0);
    double seconds = argc == 6 ? atof(argv[5]) : 1e9;
    if (nthreads < 2 || nthreads > 64 || iters < 1 || size < 1) {
        fprintf(stderr, "racefree: THREADS 2..64, ITERS >= 1, SIZE >= 1\n");
        return 2;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "racefree: %s\n", dlerror());
        return 3;
    }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))need(lib, "cuInit");
    CUresult (*retain)(CUcontext *, int) = (CUresult(*)(CUcontext *, int))need(lib, "cuDevicePrimaryCtxRetain");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))need(lib, "cuMemAlloc_v2");
    unsigned long long (*used)(int) = (unsigned long long (*)(int))need(lib, "fakecuda_used");
    set_ctx = (CUresult(*)(CUcontext))need(lib, "cuCtxSetCurrent");
    if (strcmp(argv[1], "cuMemFree_v2") == 0)
        mem_free = (CUresult(*)(CUdeviceptr))need(lib, argv[1]);
    else
        mem_free_async = (CUresult(*)(CUdeviceptr, void *))need(lib, argv[1]);
    if (init(0) != 0 || retain(&ctx, 0) != 0 || set_ctx(ctx) != 0) {
        fprintf(stderr, "racefree: driver initialisation failed\n");
        return 1;
    }
    pthread_t th[64];
    for (int i = 0; i < nthreads; i++)
        pthread_create(&th[i], NULL, worker, NULL);
    double deadline = now() + seconds;
    long r;
    for (r = 1; r <= iters && (r == 1 || now() < deadline); r++) {
        CUdeviceptr p = 0;
        if (alloc(&p, size) != 0) {
            fprintf(stderr, "racefree: allocation %ld failed\n", r);
            return 1;
        }
        __atomic_store_n(&target, p, __ATOMIC_RELAXED);
        __atomic_store_n(&round_no, r, __ATOMIC_RELEASE);
        wait_until(&done, r * nthreads);
    }
    __atomic_store_n(&no_round, r, __ATOMIC_RELEASE);
    for (int i = 0; i < nthreads; i++)
        pthread_join(th[i], NULL);
    int (*usage)(const char *, ms_snapshot *, char *, size_t) =
        (int (*)(const char *, ms_snapshot *, char *, size_t))dlsym(RTLD_DEFAULT, "mpsshim_usage");
    static ms_snapshot snap;
    char err[256] = "";
    long long region_used = -1;
    if (usage != NULL && usage(NULL, &snap, err, sizeof err) == 0)
        region_used = (long long)snap.used[0];
    printf("racefree rounds=%ld freed=%ld failed=%ld other=%ld driver_used=%llu region_used=%lld\n", r - 1, freed,
           failed, other, used(0), region_used);
    return 0;
}
