/* ns per charge+uncharge pair on one region, and per tracker pair as the shim does it (add at
 * the allocation; free_begin + free_end around the driver's free), single-threaded
 * and with N threads (all on device 0, so threads contend on the region's one lock).
 *   make -C tests/core && tests/core/build/core_bench [REGION_PATH] [THREADS] [ITERS]
 * Prints numbers; asserts nothing (timing belongs here, not in tests). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "region.h"
#include "track.h"

static ms_region *reg;
static long iters;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void *region_loop(void *arg) {
    (void)arg;
    for (long i = 0; i < iters; i++) {
        if (ms_region_charge(reg, 0, UINT64_MAX, 4096, NULL) != MS_OK) abort();
        ms_region_uncharge(reg, 0, 4096);
    }
    return NULL;
}

static void *track_loop(void *arg) {
    uint64_t base = (uint64_t)(uintptr_t)arg << 40;
    for (long i = 0; i < iters; i++) {
        uint64_t key = base + (uint64_t)(i & 1023) * 512;
        uint64_t ticket;
        int dev;
        uint64_t bytes;
        if (ms_track_add_ptr(key, 0, 4096) != 0) abort();
        if (!ms_track_free_begin(MS_TRACK_PTR, key, &ticket)) abort();
        if (!ms_track_free_end(MS_TRACK_PTR, key, ticket, 1, &dev, &bytes) || bytes != 4096) abort();
    }
    return NULL;
}

static double run(void *(*fn)(void *), int nthreads) {
    pthread_t t[256];
    double t0 = now();
    for (int i = 0; i < nthreads; i++) pthread_create(&t[i], NULL, fn, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
    return (now() - t0) / (double)iters / nthreads;
}

int main(int argc, char **argv) {
    char path[256], err[512];
    snprintf(path, sizeof path, "/tmp/core_bench.%d.region", (int)getpid());
    const char *p = argc > 1 ? argv[1] : path;
    int nthreads = argc > 2 ? atoi(argv[2]) : 8;
    iters = argc > 3 ? atol(argv[3]) : 2000000;
    if (nthreads < 1 || nthreads > 256) nthreads = 8;
    if (ms_region_open(p, &reg, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    /* With N threads: "per thread" is the wall time each thread took per pair (latency under
     * contention), "aggregate" is wall time divided by all pairs done (inverse throughput). */
    double r1 = run(region_loop, 1), rn = run(region_loop, nthreads);
    double t1 = run(track_loop, 1), tn = run(track_loop, nthreads);
    printf("region charge+uncharge  1 thread : %7.1f ns/pair\n", r1);
    printf("region charge+uncharge %2d threads: %7.1f ns/pair per thread, %6.1f ns/pair aggregate\n", nthreads,
           rn * nthreads, rn);
    printf("track add+free          1 thread : %7.1f ns/pair\n", t1);
    printf("track add+free         %2d threads: %7.1f ns/pair per thread, %6.1f ns/pair aggregate\n", nthreads,
           tn * nthreads, tn);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    printf("(%ld online CPUs, %ld pairs per thread)\n", cpus, iters);
    ms_region_close(reg);
    if (argc <= 1) unlink(path);
    return 0;
}
