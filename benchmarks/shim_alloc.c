/* Cost of a cuMemAlloc_v2 + cuMemFree_v2 pair, reaching the driver the way a client does:
 *   link   called by name, bound by the loader (build with -DLINKED and -lcuda)
 *   dlsym  dlopen("libcuda.so.1") + dlsym of each name (what ctypes, numba, cupy do)
 *   gpa    dlsym("cuGetProcAddress_v2"), then the functions through it (what cudart 12 does)
 * Run bare it measures the driver (the fake one in tests/fakes); with LD_PRELOAD=libmpsshim.so
 * the driver behind the shim. benchmarks/shim_alloc.py runs every shape and compares.
 *
 *   shim_alloc PATH THREADS PAIRS_PER_THREAD BYTES WARMUP [wait]
 * Each thread makes device 0's primary context current, runs WARMUP pairs, then all threads
 * start together (with "wait": after printing "ready", once a line arrives on stdin, so that
 * two processes start together) and run PAIRS_PER_THREAD timed pairs. Prints one JSON line:
 * wall_start_ns/wall_end_ns (CLOCK_MONOTONIC, comparable across processes: first thread's start,
 * last thread's end), pairs (all threads), cpu_ns (the threads' own CPU time), refused, and the
 * driver calls made during the timed part (the fake's call counters) per pair. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*retain_fn)(CUcontext *, int);
typedef CUresult (*setctx_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);
typedef unsigned long long (*calls_fn)(const char *);
typedef void (*reset_fn)(void);

#ifdef LINKED
CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, int dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
#endif

static struct {
    init_fn init;
    retain_fn retain;
    setctx_fn setctx;
    alloc_fn alloc;
    free_fn free;
} drv;

static CUcontext ctx;
static long pairs, warmup;
static size_t bytes;
static pthread_barrier_t ready, go;

/* Driver calls counted per pair (the fake's probes; absent from a real driver). */
static const char *const COUNTED[] = {"cuMemAlloc_v2", "cuMemFree_v2", "cuCtxGetDevice", "cuCtxGetCurrent",
                                      "cuDeviceGetCount", "cuDeviceGetUuid_v2"};
#define NCOUNTED (sizeof COUNTED / sizeof COUNTED[0])

static int bind(const char *path, void *lib)
{
    if (strcmp(path, "link") == 0) {
#ifdef LINKED
        drv.init = cuInit, drv.retain = cuDevicePrimaryCtxRetain, drv.setctx = cuCtxSetCurrent;
        drv.alloc = cuMemAlloc_v2, drv.free = cuMemFree_v2;
        return 0;
#else
        fprintf(stderr, "path link needs the -DLINKED build\n");
        return -1;
#endif
    }
    if (strcmp(path, "dlsym") == 0) {
        drv.init = (init_fn)dlsym(lib, "cuInit");
        drv.retain = (retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
        drv.setctx = (setctx_fn)dlsym(lib, "cuCtxSetCurrent");
        drv.alloc = (alloc_fn)dlsym(lib, "cuMemAlloc_v2");
        drv.free = (free_fn)dlsym(lib, "cuMemFree_v2");
    } else if (strcmp(path, "gpa") == 0) {
        gpa2_fn gpa = (gpa2_fn)dlsym(lib, "cuGetProcAddress_v2");
        if (gpa == NULL)
            return fprintf(stderr, "no cuGetProcAddress_v2\n"), -1;
        /* Ask for cuGetProcAddress itself first, as cudart does, then everything through it. */
        void *p = NULL;
        int st = 0;
        if (gpa("cuGetProcAddress", &p, 12000, 0, &st) == 0 && p != NULL)
            gpa = (gpa2_fn)p;
        const char *names[] = {"cuInit", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuMemAlloc", "cuMemFree"};
        void *fns[5] = {0};
        for (int i = 0; i < 5; i++)
            if (gpa(names[i], &fns[i], 12000, 0, &st) != 0)
                fns[i] = NULL;
        drv.init = (init_fn)fns[0], drv.retain = (retain_fn)fns[1], drv.setctx = (setctx_fn)fns[2];
        drv.alloc = (alloc_fn)fns[3], drv.free = (free_fn)fns[4];
    } else {
        fprintf(stderr, "PATH \"%s\" is not one of link, dlsym, gpa\n", path);
        return -1;
    }
    if (!drv.init || !drv.retain || !drv.setctx || !drv.alloc || !drv.free)
        return fprintf(stderr, "path %s: a driver function is missing\n", path), -1;
    return 0;
}

static long run_pairs(long n)
{
    long refused = 0;
    for (long i = 0; i < n; i++) {
        CUdeviceptr p;
        if (drv.alloc(&p, bytes) != 0) {
            refused++;
            continue;
        }
        if (drv.free(p) != 0)
            abort();
    }
    return refused;
}

struct result {
    long refused;
    double wall_start, wall_end, cpu;
};

static double now(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void *worker(void *arg)
{
    struct result *res = arg;
    if (drv.setctx(ctx) != 0)
        abort();
    run_pairs(warmup);
    pthread_barrier_wait(&ready);
    pthread_barrier_wait(&go);
    double c0 = now(CLOCK_THREAD_CPUTIME_ID);
    res->wall_start = now(CLOCK_MONOTONIC);
    res->refused = run_pairs(pairs);
    res->wall_end = now(CLOCK_MONOTONIC);
    res->cpu = now(CLOCK_THREAD_CPUTIME_ID) - c0;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 6 && !(argc == 7 && strcmp(argv[6], "wait") == 0)) {
        fprintf(stderr, "usage: %s link|dlsym|gpa THREADS PAIRS_PER_THREAD BYTES WARMUP [wait]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[2]);
    pairs = atol(argv[3]);
    bytes = (size_t)atoll(argv[4]);
    warmup = atol(argv[5]);
    if (threads < 1 || threads > 256 || pairs < 1 || bytes < 1 || warmup < 0) {
        fprintf(stderr, "bad arguments: THREADS 1..256, PAIRS_PER_THREAD >= 1, BYTES >= 1, WARMUP >= 0\n");
        return 2;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL || bind(argv[1], lib) != 0) {
        fprintf(stderr, "cannot reach the driver: %s\n", lib == NULL ? dlerror() : argv[1]);
        return 1;
    }
    if (drv.init(0) != 0 || drv.retain(&ctx, 0) != 0) {
        fprintf(stderr, "driver initialisation failed\n");
        return 1;
    }
    calls_fn calls = (calls_fn)dlsym(lib, "fakecuda_calls");
    reset_fn reset = (reset_fn)dlsym(lib, "fakecuda_reset_counts");
    pthread_t tid[256];
    static struct result res[256];
    pthread_barrier_init(&ready, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&go, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++)
        pthread_create(&tid[i], NULL, worker, &res[i]);
    pthread_barrier_wait(&ready);
    if (reset != NULL)
        reset();
    if (argc == 7) {
        char line[16];
        printf("ready\n");
        fflush(stdout);
        if (fgets(line, sizeof line, stdin) == NULL)
            return 1;
    }
    pthread_barrier_wait(&go);
    for (int i = 0; i < threads; i++)
        pthread_join(tid[i], NULL);
    double total = (double)pairs * threads, first = res[0].wall_start, last = res[0].wall_end, cpu = 0;
    long refused = 0;
    for (int i = 0; i < threads; i++) {
        first = res[i].wall_start < first ? res[i].wall_start : first;
        last = res[i].wall_end > last ? res[i].wall_end : last;
        cpu += res[i].cpu;
        refused += res[i].refused;
    }
    printf("{\"path\": \"%s\", \"threads\": %d, \"bytes\": %zu, \"pairs\": %.0f, \"wall_start_ns\": %.0f, "
           "\"wall_end_ns\": %.0f, \"cpu_ns\": %.0f, \"refused\": %ld, \"calls_per_pair\": {",
           argv[1], threads, bytes, total, first, last, cpu, refused);
    for (size_t i = 0; i < NCOUNTED && calls != NULL; i++)
        printf("%s\"%s\": %.3f", i ? ", " : "", COUNTED[i], (double)calls(COUNTED[i]) / total);
    printf("}}\n");
    return 0;
}
