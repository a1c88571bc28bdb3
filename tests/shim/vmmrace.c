/* Threads race on one cuMemCreate handle, many rounds, in the patterns real programs use.
 *
 *   vmmrace MODE THREADS ROUNDS SIZE
 *   MODE release-unmap    set up: create, map, then race: one thread cuMemRelease, one cuMemUnmap
 *        retain-release   set up: create, map, release; race: THREADS-1 threads each retain the
 *                         handle at the mapping (cuMemRetainAllocationHandle) and release it,
 *                         one thread unmaps
 *        release-map      set up: create; race: one thread releases, one maps
 *        release-release  set up: create, map; race: THREADS threads release the handle (a racing
 *                         double release: the driver takes one, refuses the others)
 * After each round (threads back, before cleaning up) the region must count exactly what the
 * driver holds (fakecuda_used); then whatever is left is unmapped/released and both must be 0.
 * A watcher thread samples the region, then the driver, all along, and so does every VMM call
 * of the fake driver just before it acts (fakecuda_vmm_probe; link with -rdynamic): while only
 * frees happen, a region below the driver means a charge went back while the driver still held
 * the memory.
 * Prints "vmmrace ok=O failed=F mid=M end=E premature=P samples=S driver_used=U region_used=R":
 * M, E, P (rounds / samples that disagreed) must be 0, U and R 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "region.h" /* ms_snapshot, for mpsshim_usage */

typedef int CUresult;
typedef unsigned long long CUdeviceptr, Handle;

#define VA 0x7f0000000000ULL

enum { RELEASE_UNMAP, RETAIN_RELEASE, RELEASE_MAP, RELEASE_RELEASE };

static CUresult (*create)(Handle *, size_t, const void *, unsigned long long);
static CUresult (*release)(Handle);
static CUresult (*map)(CUdeviceptr, size_t, size_t, Handle, unsigned long long);
static CUresult (*unmap)(CUdeviceptr, size_t);
static CUresult (*retain)(Handle *, void *);
static unsigned long long (*driver_used)(int);
static int (*usage)(const char *, ms_snapshot *, char *, size_t);

static int mode, nthreads;
static long rounds;
static size_t size;
static Handle target;
static long round_no, done;
static long ok, failed, mapped; /* mapped: this round's cuMemMap succeeded */
static long gen;                /* odd while the main thread allocates: the watcher's samples are void */
static int stop;
static long premature, samples;

static void wait_until(long *word, long value)
{
    for (unsigned n = 0; __atomic_load_n(word, __ATOMIC_ACQUIRE) < value; n++)
        if (n > 200)
            sched_yield();
}

static long long region_used(void)
{
    static __thread ms_snapshot snap;
    char err[256] = "";
    if (usage(NULL, &snap, err, sizeof err) != 0) {
        fprintf(stderr, "vmmrace: usage: %s\n", err);
        exit(1);
    }
    return (long long)snap.used[0];
}

static void count(CUresult rc)
{
    __atomic_add_fetch(rc == 0 ? &ok : &failed, 1, __ATOMIC_RELAXED);
}

/* Thread `me` plays part (me + round) % THREADS of the round. */
static void *worker(void *arg)
{
    int me = (int)(long)arg;
    unsigned seed = 2463534242u + (unsigned)me * 7919u;
    for (long r = 1; r <= rounds; r++) {
        wait_until(&round_no, r);
        seed ^= seed << 13, seed ^= seed >> 17, seed ^= seed << 5;
        for (volatile unsigned spin = seed % 2048; spin > 0; spin--) /* a different start each round */
            ;
        Handle h = __atomic_load_n(&target, __ATOMIC_RELAXED), mine = 0;
        CUresult rc;
        int role = (int)((me + r) % nthreads); /* the threads take turns at each part */
        switch (mode) {
        case RELEASE_UNMAP:
            if (role < 2) /* the other threads sit this mode out */
                count(role == 0 ? release(h) : unmap(VA, size));
            break;
        case RETAIN_RELEASE:
            if (role == 0) {
                count(unmap(VA, size));
            } else if ((rc = retain(&mine, (void *)VA)) == 0) {
                count(mine == h ? release(mine) : 99);
            }
            break;
        case RELEASE_MAP:
            if (role == 0) {
                count(release(h));
            } else if (role == 1) {
                rc = map(VA, size, 0, h, 0);
                if (rc == 0)
                    __atomic_store_n(&mapped, 1, __ATOMIC_RELAXED);
                count(rc);
            }
            break;
        default:
            count(release(h));
        }
        __atomic_add_fetch(&done, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* Region first, driver second: with only frees under way the driver cannot have grown between
 * the two, so a region below it means an early uncharge. */
static void sample(void)
{
    long g = __atomic_load_n(&gen, __ATOMIC_ACQUIRE);
    long long r = region_used();
    unsigned long long d = driver_used(0);
    if ((g & 1) || __atomic_load_n(&gen, __ATOMIC_ACQUIRE) != g)
        return;
    __atomic_add_fetch(&samples, 1, __ATOMIC_RELAXED);
    if (r < (long long)d)
        __atomic_add_fetch(&premature, 1, __ATOMIC_RELAXED);
}

/* The fake driver calls this inside each VMM call just before it acts (FAKE_CUDA_VMM_YIELD):
 * the moment another thread's early uncharge is still visible. */
__attribute__((visibility("default"))) void fakecuda_vmm_probe(void);
void fakecuda_vmm_probe(void)
{
    sample();
}

static void *watcher(void *arg)
{
    (void)arg;
    while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE))
        sample();
    return NULL;
}

static void *need(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "vmmrace: no %s\n", name);
        exit(3);
    }
    return p;
}

static void must(CUresult rc, const char *what, long r)
{
    if (rc != 0) {
        fprintf(stderr, "vmmrace: %s failed (%d) in round %ld\n", what, rc, r);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    static const char *modes[] = {"release-unmap", "retain-release", "release-map", "release-release"};
    mode = -1;
    for (int i = 0; argc == 5 && i < 4; i++)
        if (strcmp(argv[1], modes[i]) == 0)
            mode = i;
    if (mode < 0) {
        fprintf(stderr, "usage: vmmrace release-unmap|retain-release|release-map|release-release"
                        " THREADS ROUNDS SIZE\n");
        return 2;
    }
    nthreads = atoi(argv[2]);
    rounds = atol(argv[3]);
    size = strtoull(argv[4], NULL, 0);
    if (nthreads < 2 || nthreads > 64 || rounds < 1 || size < 1) {
        fprintf(stderr, "vmmrace: THREADS 2..64, ROUNDS >= 1, SIZE >= 1\n");
        return 2;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "vmmrace: %s\n", dlerror());
        return 3;
    }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))need(lib, "cuInit");
    create = (CUresult(*)(Handle *, size_t, const void *, unsigned long long))need(lib, "cuMemCreate");
    release = (CUresult(*)(Handle))need(lib, "cuMemRelease");
    map = (CUresult(*)(CUdeviceptr, size_t, size_t, Handle, unsigned long long))need(lib, "cuMemMap");
    unmap = (CUresult(*)(CUdeviceptr, size_t))need(lib, "cuMemUnmap");
    retain = (CUresult(*)(Handle *, void *))need(lib, "cuMemRetainAllocationHandle");
    driver_used = (unsigned long long (*)(int))need(lib, "fakecuda_used");
    usage = (int (*)(const char *, ms_snapshot *, char *, size_t))need(RTLD_DEFAULT, "mpsshim_usage");
    must(init(0), "cuInit", 0);
    unsigned char prop[64] = {0}; /* CUmemAllocationProp: pinned, on device 0 */
    int one = 1;
    memcpy(prop, &one, sizeof one);
    memcpy(prop + 8, &one, sizeof one);
    pthread_t th[64], w;
    for (int i = 0; i < nthreads; i++)
        pthread_create(&th[i], NULL, worker, (void *)(long)i);
    pthread_create(&w, NULL, watcher, NULL);
    long mid = 0, end = 0;
    for (long r = 1; r <= rounds; r++) {
        Handle h = 0;
        __atomic_add_fetch(&gen, 1, __ATOMIC_ACQ_REL);
        must(create(&h, size, prop, 0), "cuMemCreate", r);
        if (mode != RELEASE_MAP)
            must(map(VA, size, 0, h, 0), "cuMemMap", r);
        if (mode == RETAIN_RELEASE)
            must(release(h), "cuMemRelease", r);
        __atomic_store_n(&mapped, mode != RELEASE_MAP, __ATOMIC_RELAXED);
        __atomic_add_fetch(&gen, 1, __ATOMIC_ACQ_REL);
        __atomic_store_n(&target, h, __ATOMIC_RELAXED);
        __atomic_store_n(&round_no, r, __ATOMIC_RELEASE);
        wait_until(&done, r * nthreads);
        mid += region_used() != (long long)driver_used(0);
        if (mode == RELEASE_RELEASE || (mode == RELEASE_MAP && __atomic_load_n(&mapped, __ATOMIC_RELAXED)))
            must(unmap(VA, size), "cuMemUnmap", r);
        end += region_used() != (long long)driver_used(0);
    }
    for (int i = 0; i < nthreads; i++)
        pthread_join(th[i], NULL);
    __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
    pthread_join(w, NULL);
    printf("vmmrace ok=%ld failed=%ld mid=%ld end=%ld premature=%ld samples=%ld driver_used=%llu region_used=%lld\n",
           ok, failed, mid, end, premature, samples, driver_used(0), region_used());
    return 0;
}
