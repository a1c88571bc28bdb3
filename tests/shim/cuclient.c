/* A driver-API client for the shim tests: reaches libcuda (the fake) through one of the
 * three paths and runs a script of commands given on the command line, one output line each.
 *
 *   cuclient MODE VERSION FLAGS CMD...
 *   MODE    link  (built with -DLINKED against -lcuda: symbols bound by the loader)
 *           dlsym (dlopen("libcuda.so.1") + dlsym of the exported names)
 *           gpa   (dlsym "cuGetProcAddress", ask it for itself at 11030, then for base names)
 *           gpa2  (same with the 5-argument cuGetProcAddress_v2, itself at 12000)
 *   VERSION the ABI version asked for (gpa*) or mirrored when picking exported names
 *   FLAGS   cuGetProcAddress flags (2 = per-thread default stream: _ptsz variants)
 * Commands (each prints "<cmd> rc=<CUresult>" plus values):
 *   init | ctx D | noctx | alloc N | pitch W H | managed N | async N | pool N | create D N
 *   free (frees the newest live allocation with its matching free) | info | total D
 *   used D | calls NAME | where BASE
 *   usage D      (the region through the shim's exported mpsshim_usage: used and cap of D)
 *   hammer T N SIZE CAP  (T threads, each with device 0 current, do N alloc+free pairs of SIZE;
 *                prints how many were served, refused, and seen with the driver's usage above CAP)
 *   bench N SIZE (N alloc+free pairs of SIZE on this thread; prints nanoseconds per pair)
 *   pause        (prints "pause rc=0", then waits for a line on stdin)
 *   ownbus H     (the application's own SIGBUS: maps a file of its own, truncates it and touches
 *                it; H=1 first installs a SIGBUS handler that prints "ownbus rc=0 caught=1" and
 *                exits 0; H=0 leaves the default action, so the process dies of SIGBUS)
 *   raisebus     (raise(SIGBUS) with the default action: the process dies of SIGBUS)
 *   bushandler   (installs that SIGBUS handler now with sigaction, e.g. before init opens the region)
 *   bussignal    (installs a plain SIGBUS handler that does the same, with signal())
 *   busquery     (prints "busquery rc=0 mine=1" if sigaction reports one of those handlers as SIGBUS's)
 *   nvmem IDX | nvmem2 IDX   (nvmlDeviceGetMemoryInfo / _v2 of the NVML device IDX, through
 *                             linked symbols in link mode, dlopen + dlsym otherwise)
 * No cuda.h: the few types are declared here. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cubus.h"  /* the ownbus/bushandler/bussignal/busquery commands */
#include "region.h" /* ms_snapshot, for the usage command (csrc/ is on the include path) */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmemoryPool;
typedef CUresult (*gpa_fn)(const char *, void **, int, unsigned long long);
typedef CUresult (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);

static const char *mode;
static int version, flags;
static void *lib;
static gpa_fn gpa;
static gpa2_fn gpa2;

#ifdef LINKED
#define DECL(name) extern char name[];
#define NAMES(X)                                                                                               \
    X(cuInit) X(cuDevicePrimaryCtxRetain) X(cuCtxSetCurrent) X(cuMemAlloc_v2) X(cuMemAlloc)                    \
    X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz)                     \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemCreate) X(cuMemFree_v2) X(cuMemFree)   \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemRelease) X(cuMemGetInfo_v2) X(cuMemGetInfo)             \
    X(cuDeviceTotalMem_v2) X(cuDeviceTotalMem) X(cuDeviceGetDefaultMemPool) X(cuLaunchKernel)                \
    X(cuLaunchKernel_ptsz) X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuCtxGetDevice)
#define NVML_NAMES(X) X(nvmlInit_v2) X(nvmlDeviceGetHandleByIndex_v2) X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)
NAMES(DECL)
NVML_NAMES(DECL)
#define ENTRY(name) {#name, (void *)name},
static const struct { const char *name; void *fn; } linked[] = {NAMES(ENTRY)};
static const struct { const char *name; void *fn; } linked_nvml[] = {NVML_NAMES(ENTRY)};
#endif

/* An NVML function: linked in link mode, else dlsym on a libnvidia-ml.so.1 handle. */
static void *nvml(const char *name)
{
#ifdef LINKED
    for (size_t i = 0; i < sizeof linked_nvml / sizeof linked_nvml[0]; i++)
        if (strcmp(linked_nvml[i].name, name) == 0)
            return linked_nvml[i].fn;
    return NULL;
#else
    static void *h;
    if (h == NULL)
        h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    return h ? dlsym(h, name) : NULL;
#endif
}

typedef struct { unsigned long long total, free, used; } nvml_mem;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvml_mem2;

/* The exported variant a base name resolves to at (version, flags): same rule as the driver. */
static const struct { const char *base; int ver; int ptsz; const char *name; } variants[] = {
    {"cuInit", 2000, 0, "cuInit"},
    {"cuDevicePrimaryCtxRetain", 7000, 0, "cuDevicePrimaryCtxRetain"},
    {"cuCtxSetCurrent", 4000, 0, "cuCtxSetCurrent"},
    {"cuCtxGetDevice", 2000, 0, "cuCtxGetDevice"},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc"}, {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2"},
    {"cuMemFree", 2000, 0, "cuMemFree"}, {"cuMemFree", 3020, 0, "cuMemFree_v2"},
    {"cuMemGetInfo", 2000, 0, "cuMemGetInfo"}, {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2"},
    {"cuDeviceTotalMem", 2000, 0, "cuDeviceTotalMem"}, {"cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2"},
    {"cuMemAllocPitch", 3020, 0, "cuMemAllocPitch_v2"},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged"},
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync"}, {"cuMemAllocAsync", 11020, 1, "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 11020, 0, "cuMemAllocFromPoolAsync"},
    {"cuMemAllocFromPoolAsync", 11020, 1, "cuMemAllocFromPoolAsync_ptsz"},
    {"cuMemFreeAsync", 11020, 0, "cuMemFreeAsync"}, {"cuMemFreeAsync", 11020, 1, "cuMemFreeAsync_ptsz"},
    {"cuMemCreate", 10020, 0, "cuMemCreate"}, {"cuMemRelease", 10020, 0, "cuMemRelease"},
    {"cuMemMap", 10020, 0, "cuMemMap"}, {"cuMemUnmap", 10020, 0, "cuMemUnmap"},
    {"cuMemRetainAllocationHandle", 11000, 0, "cuMemRetainAllocationHandle"},
    {"cuDeviceGetDefaultMemPool", 11020, 0, "cuDeviceGetDefaultMemPool"},
    {"cuLaunchKernel", 4000, 0, "cuLaunchKernel"}, {"cuLaunchKernel", 7000, 1, "cuLaunchKernel_ptsz"},
};

static const char *variant_of(const char *base)
{
    int best = -1, best_ptsz = -1;
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        if (strcmp(variants[i].base, base) != 0 || variants[i].ver > version)
            continue;
        int *slot = variants[i].ptsz ? &best_ptsz : &best;
        if (*slot < 0 || variants[i].ver > variants[*slot].ver)
            *slot = (int)i;
    }
    if ((flags & 2) && best_ptsz >= 0)
        best = best_ptsz;
    return best >= 0 ? variants[best].name : NULL;
}

/* The function the chosen path yields for a base name (NULL if none). */
static void *get(const char *base)
{
    if (strcmp(mode, "gpa") == 0 || strcmp(mode, "gpa2") == 0) {
        void *p = NULL;
        int status = -1;
        CUresult rc = gpa2 ? gpa2(base, &p, version, (unsigned long long)flags, &status)
                           : gpa(base, &p, version, (unsigned long long)flags);
        return rc == 0 ? p : NULL;
    }
    const char *name = variant_of(base);
    if (name == NULL)
        return NULL;
#ifdef LINKED
    for (size_t i = 0; i < sizeof linked / sizeof linked[0]; i++)
        if (strcmp(linked[i].name, name) == 0)
            return linked[i].fn;
    return NULL;
#else
    return dlsym(lib, name);
#endif
}

/* Set-up functions (contexts, pools) are resolved at the newest ABI whatever is under test. */
static void *get_setup(const char *base)
{
    int v = version, f = flags;
    version = 12000, flags = 0;
    void *p = get(base);
    version = v, flags = f;
    return p;
}

static int is_v1(const char *base)
{
    const char *name = variant_of(base);
    return name != NULL && strcmp(name, base) == 0 && (strcmp(base, "cuMemAlloc") == 0 || strcmp(base, "cuMemFree") == 0 ||
                                                       strcmp(base, "cuMemGetInfo") == 0 || strcmp(base, "cuDeviceTotalMem") == 0);
}

enum kind { K_MEM, K_MEM1, K_ASYNC, K_HANDLE };
static struct { enum kind kind; unsigned long long key; } live[256];
static int nlive;

static void push(enum kind k, unsigned long long key)
{
    if (nlive < 256)
        live[nlive].kind = k, live[nlive++].key = key;
}

static void *probe(const char *name)
{
    void *p = dlsym(lib, name); /* fakecuda_* are not hooked: the override passes them through */
    if (p == NULL) {
        fprintf(stderr, "cuclient: the fake lacks %s\n", name);
        exit(3);
    }
    return p;
}

static void NOSYM(const char *cmd) { printf("%s rc=nosym\n", cmd); }

struct hammer {
    unsigned long n, size, cap;
    unsigned long ok, refused, over, errors;
};

static void *hammer_thread(void *arg)
{
    struct hammer *h = arg;
    CUresult (*retain)(CUcontext *, int) = (CUresult(*)(CUcontext *, int))get_setup("cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))get_setup("cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))get("cuMemAlloc");
    CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))get("cuMemFree");
    unsigned long long (*used)(int) = (unsigned long long (*)(int))probe("fakecuda_used");
    CUcontext c = NULL;
    if (retain(&c, 0) != 0 || set(c) != 0) {
        h->errors++;
        return NULL;
    }
    for (unsigned long i = 0; i < h->n; i++) {
        CUdeviceptr p = 0;
        CUresult rc = alloc(&p, h->size);
        if (rc == 2) {
            h->refused++;
            continue;
        }
        if (rc != 0) {
            h->errors++;
            continue;
        }
        h->ok++;
        if (used(0) > h->cap)
            h->over++;
        if (release(p) != 0)
            h->errors++;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: cuclient MODE VERSION FLAGS CMD...\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    mode = argv[1];
    version = atoi(argv[2]);
    flags = atoi(argv[3]);
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "cuclient: %s\n", dlerror());
        return 3;
    }
    if (strcmp(mode, "gpa") == 0 || strcmp(mode, "gpa2") == 0) {
        /* as the runtime does: dlsym the entry point, then ask it for itself */
        void *self = NULL;
        int status = 0;
        if (strcmp(mode, "gpa") == 0) {
            gpa_fn first = (gpa_fn)dlsym(lib, "cuGetProcAddress");
            if (first == NULL || first("cuGetProcAddress", &self, 11030, 0) != 0 || self == NULL)
                return 4;
            gpa = (gpa_fn)self;
        } else {
            gpa2_fn first = (gpa2_fn)dlsym(lib, "cuGetProcAddress_v2");
            if (first == NULL || first("cuGetProcAddress", &self, 12000, 0, &status) != 0 || self == NULL)
                return 4;
            gpa2 = (gpa2_fn)self;
        }
    } else if (strcmp(mode, "link") != 0 && strcmp(mode, "dlsym") != 0) {
        fprintf(stderr, "cuclient: unknown mode %s\n", mode);
        return 2;
    }
    for (int i = 4; i < argc; i++) {
        const char *cmd = argv[i];
        if (strcmp(cmd, "init") == 0) {
            CUresult (*f)(unsigned) = (CUresult(*)(unsigned))get("cuInit");
            printf("init rc=%d\n", f ? f(0) : -1);
        } else if (strcmp(cmd, "ctx") == 0) {
            int dev = atoi(argv[++i]);
            CUresult (*retain)(CUcontext *, int) = (CUresult(*)(CUcontext *, int))get_setup("cuDevicePrimaryCtxRetain");
            CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))get_setup("cuCtxSetCurrent");
            CUcontext c = NULL;
            CUresult rc = retain(&c, dev);
            if (rc == 0)
                rc = set(c);
            printf("ctx rc=%d\n", rc);
        } else if (strcmp(cmd, "noctx") == 0) {
            CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))get_setup("cuCtxSetCurrent");
            printf("noctx rc=%d\n", set(NULL));
        } else if (strcmp(cmd, "alloc") == 0) {
            unsigned long long n = strtoull(argv[++i], NULL, 0);
            void *f = get("cuMemAlloc");
            if (f == NULL) { NOSYM("alloc"); continue; }
            CUresult rc;
            if (is_v1("cuMemAlloc")) {
                unsigned int p = 0;
                rc = ((CUresult(*)(unsigned int *, unsigned int))f)(&p, (unsigned int)n);
                if (rc == 0) push(K_MEM1, p);
            } else {
                CUdeviceptr p = 0;
                rc = ((CUresult(*)(CUdeviceptr *, size_t))f)(&p, n);
                if (rc == 0) push(K_MEM, p);
            }
            printf("alloc rc=%d\n", rc);
        } else if (strcmp(cmd, "pitch") == 0) {
            size_t w = strtoull(argv[++i], NULL, 0), h = strtoull(argv[++i], NULL, 0), pitch = 0;
            void *f = get("cuMemAllocPitch");
            if (f == NULL) { NOSYM("pitch"); continue; }
            CUdeviceptr p = 0;
            CUresult rc = ((CUresult(*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned))f)(&p, &pitch, w, h, 4);
            if (rc == 0) push(K_MEM, p);
            printf("pitch rc=%d pitch=%zu\n", rc, pitch);
        } else if (strcmp(cmd, "managed") == 0) {
            unsigned long long n = strtoull(argv[++i], NULL, 0);
            void *f = get("cuMemAllocManaged");
            if (f == NULL) { NOSYM("managed"); continue; }
            CUdeviceptr p = 0;
            CUresult rc = ((CUresult(*)(CUdeviceptr *, size_t, unsigned))f)(&p, n, 1);
            if (rc == 0) push(K_MEM, p);
            printf("managed rc=%d\n", rc);
        } else if (strcmp(cmd, "async") == 0 || strcmp(cmd, "pool") == 0) {
            int pool_alloc = strcmp(cmd, "pool") == 0;
            unsigned long long n = strtoull(argv[++i], NULL, 0);
            void *f = get(pool_alloc ? "cuMemAllocFromPoolAsync" : "cuMemAllocAsync");
            if (f == NULL) { NOSYM(cmd); continue; }
            CUdeviceptr p = 0;
            CUresult rc;
            if (pool_alloc) {
                CUresult (*getdev)(int *) = (CUresult(*)(int *))get_setup("cuCtxGetDevice");
                CUresult (*getpool)(CUmemoryPool *, int) = (CUresult(*)(CUmemoryPool *, int))get_setup("cuDeviceGetDefaultMemPool");
                int dev = 0;
                CUmemoryPool mp = NULL;
                rc = getdev(&dev);
                if (rc == 0) rc = getpool(&mp, dev);
                if (rc == 0) rc = ((CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream))f)(&p, n, mp, NULL);
            } else {
                rc = ((CUresult(*)(CUdeviceptr *, size_t, CUstream))f)(&p, n, NULL);
            }
            if (rc == 0) push(K_ASYNC, p);
            printf("%s rc=%d\n", cmd, rc);
        } else if (strcmp(cmd, "create") == 0) {
            int dev = atoi(argv[++i]);
            unsigned long long n = strtoull(argv[++i], NULL, 0);
            void *f = get("cuMemCreate");
            if (f == NULL) { NOSYM("create"); continue; }
            unsigned char prop[32] = {0};
            int type = 1; /* PINNED */
            int loc_type = 1; /* DEVICE */
            memcpy(prop, &type, 4);
            memcpy(prop + 8, &loc_type, 4);
            memcpy(prop + 12, &dev, 4);
            unsigned long long h = 0;
            CUresult rc = ((CUresult(*)(unsigned long long *, size_t, const void *, unsigned long long))f)(&h, n, prop, 0);
            if (rc == 0) push(K_HANDLE, h);
            printf("create rc=%d\n", rc);
        } else if (strcmp(cmd, "free") == 0) {
            if (nlive == 0) { printf("free rc=empty\n"); continue; }
            nlive--;
            CUresult rc = -1;
            unsigned long long key = live[nlive].key;
            if (live[nlive].kind == K_MEM) {
                int ver = version;
                if (version < 3020)
                    version = 3020; /* a 64-bit pointer is freed with the 64-bit ABI */
                void *f = get("cuMemFree");
                version = ver;
                rc = f ? ((CUresult(*)(CUdeviceptr))f)(key) : -1;
            } else if (live[nlive].kind == K_MEM1) {
                void *f = get("cuMemFree");
                rc = f ? ((CUresult(*)(unsigned int))f)((unsigned int)key) : -1;
            } else if (live[nlive].kind == K_ASYNC) {
                void *f = get("cuMemFreeAsync");
                rc = f ? ((CUresult(*)(CUdeviceptr, CUstream))f)(key, NULL) : -1;
            } else {
                void *f = get("cuMemRelease");
                rc = f ? ((CUresult(*)(unsigned long long))f)(key) : -1;
            }
            printf("free rc=%d\n", rc);
        } else if (strcmp(cmd, "info") == 0) {
            void *f = get("cuMemGetInfo");
            if (f == NULL) { NOSYM("info"); continue; }
            CUresult rc;
            unsigned long long fr = 0, to = 0;
            if (is_v1("cuMemGetInfo")) {
                unsigned int a = 0, b = 0;
                rc = ((CUresult(*)(unsigned int *, unsigned int *))f)(&a, &b);
                fr = a, to = b;
            } else {
                size_t a = 0, b = 0;
                rc = ((CUresult(*)(size_t *, size_t *))f)(&a, &b);
                fr = a, to = b;
            }
            printf("info rc=%d free=%llu total=%llu\n", rc, fr, to);
        } else if (strcmp(cmd, "total") == 0) {
            int dev = atoi(argv[++i]);
            void *f = get("cuDeviceTotalMem");
            if (f == NULL) { NOSYM("total"); continue; }
            CUresult rc;
            unsigned long long to = 0;
            if (is_v1("cuDeviceTotalMem")) {
                unsigned int b = 0;
                rc = ((CUresult(*)(unsigned int *, int))f)(&b, dev);
                to = b;
            } else {
                size_t b = 0;
                rc = ((CUresult(*)(size_t *, int))f)(&b, dev);
                to = b;
            }
            printf("total rc=%d total=%llu\n", rc, to);
        } else if (strcmp(cmd, "used") == 0) {
            int dev = atoi(argv[++i]);
            unsigned long long (*f)(int) = (unsigned long long (*)(int))probe("fakecuda_used");
            printf("used rc=0 bytes=%llu\n", f(dev));
        } else if (strcmp(cmd, "calls") == 0) {
            const char *name = argv[++i];
            unsigned long long (*f)(const char *) = (unsigned long long (*)(const char *))probe("fakecuda_calls");
            printf("calls rc=0 name=%s n=%llu\n", name, f(name));
        } else if (strcmp(cmd, "where") == 0) {
            /* which object and symbol the path's pointer for BASE is */
            const char *base = argv[++i];
            void *p = get(base);
            Dl_info info;
            if (p == NULL || dladdr(p, &info) == 0) {
                printf("where rc=nosym base=%s\n", base);
                continue;
            }
            const char *file = info.dli_fname ? strrchr(info.dli_fname, '/') : NULL;
            printf("where rc=0 base=%s file=%s sym=%s exact=%d\n", base, file ? file + 1 : info.dli_fname,
                   info.dli_sname ? info.dli_sname : "?", info.dli_saddr == p);
        } else if (strcmp(cmd, "usage") == 0) {
            int dev = atoi(argv[++i]);
            static ms_snapshot snap;
            char err[256] = "";
            int (*usage)(const char *, ms_snapshot *, char *, size_t) =
                (int (*)(const char *, ms_snapshot *, char *, size_t))dlsym(RTLD_DEFAULT, "mpsshim_usage");
            int rc = usage ? usage(NULL, &snap, err, sizeof err) : -1;
            printf("usage rc=%d used=%llu cap=%llu\n", rc, rc == 0 ? (unsigned long long)snap.used[dev] : 0ULL,
                   rc == 0 ? (unsigned long long)snap.cap[dev] : 0ULL);
        } else if (strcmp(cmd, "hammer") == 0) {
            int t = atoi(argv[++i]);
            struct hammer hs[64];
            pthread_t th[64];
            unsigned long n = strtoul(argv[++i], NULL, 0), size = strtoul(argv[++i], NULL, 0);
            unsigned long cap = strtoul(argv[++i], NULL, 0);
            if (t > 64)
                t = 64;
            for (int k = 0; k < t; k++) {
                hs[k] = (struct hammer){n, size, cap, 0, 0, 0, 0};
                pthread_create(&th[k], NULL, hammer_thread, &hs[k]);
            }
            unsigned long ok = 0, refused = 0, over = 0, errors = 0;
            for (int k = 0; k < t; k++) {
                pthread_join(th[k], NULL);
                ok += hs[k].ok, refused += hs[k].refused, over += hs[k].over, errors += hs[k].errors;
            }
            printf("hammer rc=0 ok=%lu refused=%lu over=%lu errors=%lu\n", ok, refused, over, errors);
        } else if (strcmp(cmd, "bench") == 0) {
            unsigned long n = strtoul(argv[++i], NULL, 0), size = strtoul(argv[++i], NULL, 0), bad = 0;
            CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))get("cuMemAlloc");
            CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))get("cuMemFree");
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            for (unsigned long k = 0; k < n; k++) {
                CUdeviceptr p = 0;
                bad += alloc(&p, size) != 0;
                bad += release(p) != 0;
            }
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
            printf("bench rc=%d ns_per_pair=%.1f\n", bad ? 1 : 0, ns);
        } else if (strcmp(cmd, "pause") == 0) {
            char line[64];
            printf("pause rc=0\n");
            if (fgets(line, sizeof line, stdin) == NULL)
                return 5;
        } else if (strcmp(cmd, "ownbus") == 0) {
            int handler = atoi(argv[++i]);
            printf("ownbus rc=%d\n", own_bus(handler));
        } else if (strcmp(cmd, "bushandler") == 0) {
            printf("bushandler rc=%d\n", install_bus_handler());
        } else if (strcmp(cmd, "bussignal") == 0) {
            printf("bussignal rc=%d\n", signal(SIGBUS, own_bus_plain) == SIG_ERR ? -1 : 0);
        } else if (strcmp(cmd, "busquery") == 0) {
            struct sigaction now;
            int rc = sigaction(SIGBUS, NULL, &now);
            int mine = (now.sa_flags & SA_SIGINFO) ? now.sa_sigaction == own_bus_handler : now.sa_handler == own_bus_plain;
            printf("busquery rc=%d mine=%d\n", rc, mine);
        } else if (strcmp(cmd, "raisebus") == 0) {
            fflush(stdout);
            raise(SIGBUS);
            printf("raisebus rc=0\n");
        } else if (strcmp(cmd, "nvmem") == 0 || strcmp(cmd, "nvmem2") == 0) {
            unsigned idx = (unsigned)atoi(argv[++i]);
            int (*init)(void) = (int (*)(void))nvml("nvmlInit_v2");
            int (*byidx)(unsigned, void **) = (int (*)(unsigned, void **))nvml("nvmlDeviceGetHandleByIndex_v2");
            void *dev = NULL;
            int rc = init && byidx ? init() : -1;
            if (rc == 0)
                rc = byidx(idx, &dev);
            unsigned long long t = 0, f = 0, u = 0;
            if (rc == 0 && strcmp(cmd, "nvmem") == 0) {
                nvml_mem m = {0, 0, 0};
                rc = ((int (*)(void *, nvml_mem *))nvml("nvmlDeviceGetMemoryInfo"))(dev, &m);
                t = m.total, f = m.free, u = m.used;
            } else if (rc == 0) {
                nvml_mem2 m = {(unsigned)sizeof(nvml_mem2) | (2u << 24), 0, 0, 0, 0};
                rc = ((int (*)(void *, nvml_mem2 *))nvml("nvmlDeviceGetMemoryInfo_v2"))(dev, &m);
                t = m.total, f = m.free, u = m.used;
            }
            printf("%s rc=%d total=%llu free=%llu used=%llu\n", cmd, rc, t, f, u);
        } else {
            fprintf(stderr, "cuclient: unknown command %s\n", cmd);
            return 2;
        }
    }
    return 0;
}
