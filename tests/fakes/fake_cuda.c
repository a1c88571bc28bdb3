/* A fake libcuda.so.1 for tests: host bookkeeping only, no GPU (contract:
 * /work/briefs/fake-cuda-spec.md, summarised here).
 *
 * Configuration (environment, read once at the first cuInit):
 *   FAKE_CUDA_DEVICES  total memory per device, comma-separated sizes with optional K/M/G/T
 *                      suffix (powers of 1024, optional B): "16G,8G" = two devices. Default
 *                      "16G". A malformed value makes cuInit fail with CUDA_ERROR_INVALID_VALUE
 *                      and one line on stderr. "" or "0" devices: cuInit -> CUDA_ERROR_NO_DEVICE.
 *   FAKE_CUDA_LOG=1    print each call to stderr.
 *
 * Semantics kept from the real driver (so the shim is tested against them):
 *   - every call but cuDriverGetVersion, cuGetProcAddress(_v2), cuGetErrorString/Name and the
 *     fakecuda_* probes returns CUDA_ERROR_NOT_INITIALIZED (3) before cuInit;
 *   - allocations and cuMemGetInfo use the calling thread's current context (thread-local
 *     stack); none -> CUDA_ERROR_INVALID_CONTEXT (201). cuMemCreate uses prop->location,
 *     async allocations the stream's device (NULL/legacy/per-thread stream: current context),
 *     pool allocations the pool's device;
 *   - free memory = total - bytes of live allocations; a request past it ->
 *     CUDA_ERROR_OUT_OF_MEMORY (2); sizes are counted exactly as requested (pitch allocations:
 *     pitch * height, pitch = width rounded up to 512); 0 bytes -> CUDA_ERROR_INVALID_VALUE;
 *   - freeing an unknown pointer or handle -> CUDA_ERROR_INVALID_VALUE (1);
 *   - the 2000-era v1 entry points keep their 32-bit ABI: cuMemAlloc/cuMemFree use 32-bit
 *     pointers (a separate low address range), cuMemGetInfo/cuDeviceTotalMem clamp to 2^32-1.
 * Pointers and handles are unique fake numbers, never backed by memory: do not dereference.
 * Contexts are one static struct per device (primary and created ones are the same).
 * Device UUID of device i: bytes {0xfa, 0xce, 0 x 13, i}, which the shim formats as
 * "GPU-face0000-0000-0000-0000-0000000000ii" (ii = i in two hex digits).
 *
 * Test-only exports: fakecuda_used(dev) (bytes really handed out), fakecuda_calls(name) (calls
 * of that exported function so far), fakecuda_reset_counts(). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_pool *CUmemoryPool;
typedef struct { char bytes[16]; } CUuuid;

enum {
    CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201, CUDA_ERROR_INVALID_HANDLE = 400, CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};
enum { PROC_SUCCESS = 0, PROC_SYMBOL_NOT_FOUND = 1, PROC_VERSION_NOT_SUFFICIENT = 2 };
enum { PROC_FLAG_PER_THREAD_DEFAULT_STREAM = 2 };

#define DRIVER_VERSION 13000
#define MAX_DEVICES 64
#define EXPORT __attribute__((visibility("default")))

/* ---- call counting: one counter per exported function --------------------------------- */
/* Every exported cu* function, for the call counters. */
#define FAKE_CUDA_FUNCS(X) \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName) \
    X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) X(cuDeviceTotalMem_v2) X(cuDeviceTotalMem) \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2) X(cuCtxCreate_v2) X(cuCtxDestroy_v2) \
    X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxGetDevice) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) \
    X(cuMemGetInfo_v2) X(cuMemGetInfo) X(cuMemAlloc_v2) X(cuMemAlloc) X(cuMemAllocPitch_v2) \
    X(cuMemAllocManaged) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync) \
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFree_v2) X(cuMemFree) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) \
    X(cuMemCreate) X(cuMemRelease) X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuDeviceGetDefaultMemPool) \
    X(cuStreamCreate) X(cuStreamDestroy_v2) X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuGetErrorString) \
    X(cuGetErrorName) X(cuGetProcAddress) X(cuGetProcAddress_v2) \
    X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxGetState) X(cuDevicePrimaryCtxReset_v2) X(cuCtxSynchronize) \
    X(cuIpcOpenMemHandle_v2)

enum {
#define X(n) F_##n,
    FAKE_CUDA_FUNCS(X)
#undef X
    F_COUNT
};
static const char *const fn_names[F_COUNT] = {
#define X(n) #n,
    FAKE_CUDA_FUNCS(X)
#undef X
};
static unsigned long long calls[F_COUNT];
static int log_calls;

__attribute__((constructor)) static void fake_load(void) {
    const char *v = getenv("FAKE_CUDA_LOG");
    log_calls = v && strcmp(v, "1") == 0;
}

#define ENTER(n)                                                                     \
    do {                                                                             \
        __atomic_fetch_add(&calls[F_##n], 1, __ATOMIC_RELAXED);                      \
        if (log_calls) fprintf(stderr, "fakecuda: %s\n", #n);                        \
    } while (0)

/* ---- devices ------------------------------------------------------------------------- */
struct fake_ctx { unsigned magic; int dev; };
struct fake_stream { unsigned magic; int dev; };
struct fake_pool { unsigned magic; int dev; };
#define CTX_MAGIC 0xC0C0C0C0u
#define STREAM_MAGIC 0x5757u
#define POOL_MAGIC 0x9009u

static int ndev;
static unsigned long long total_mem[MAX_DEVICES];
static unsigned long long used_mem[MAX_DEVICES]; /* guarded by lock */
static struct fake_ctx contexts[MAX_DEVICES];
static struct fake_pool default_pools[MAX_DEVICES];
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static int initialised;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static int parse_size(const char *s, size_t len, unsigned long long *out) {
    unsigned long long v = 0;
    size_t i = 0;
    if (len == 0) return -1;
    for (; i < len && s[i] >= '0' && s[i] <= '9'; i++) {
        if (v > (~0ULL - 9) / 10) return -1;
        v = v * 10 + (unsigned)(s[i] - '0');
    }
    if (i == 0) return -1;
    if (i < len) {
        const char *units = "KMGT";
        const char *u = strchr(units, s[i] & ~0x20);
        if (!u || !*u) return -1;
        for (int k = 0; k <= u - units; k++) {
            if (v > (~0ULL >> 10)) return -1;
            v <<= 10;
        }
        i++;
        if (i < len && (s[i] & ~0x20) == 'B') i++;
        if (i != len) return -1;
    }
    *out = v;
    return 0;
}

static void do_init(void) {
    const char *spec = getenv("FAKE_CUDA_DEVICES");
    if (!spec) spec = "16G";
    const char *p = spec;
    int n = 0;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        unsigned long long bytes;
        if (n == MAX_DEVICES || parse_size(p, len, &bytes) != 0) {
            fprintf(stderr, "fakecuda: FAKE_CUDA_DEVICES=%s is malformed (want sizes like 16G,8G)\n", spec);
            init_result = CUDA_ERROR_INVALID_VALUE;
            return;
        }
        if (bytes > 0) total_mem[n++] = bytes;
        p += len;
        if (*p == ',') p++;
    }
    for (int i = 0; i < n; i++) {
        contexts[i] = (struct fake_ctx){CTX_MAGIC, i};
        default_pools[i] = (struct fake_pool){POOL_MAGIC, i};
    }
    ndev = n;
    init_result = n ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    __atomic_store_n(&initialised, n > 0, __ATOMIC_RELEASE);
}

#define NEED_INIT() \
    do { if (!__atomic_load_n(&initialised, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define VALID_DEV(d) ((d) >= 0 && (d) < ndev)

/* ---- thread-local context stack -------------------------------------------------------- */
#define CTX_STACK 16
static __thread CUcontext ctx_stack[CTX_STACK];
static __thread int ctx_depth;

static CUcontext current_ctx(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }
static int valid_ctx(CUcontext c) { return c && c >= contexts && c < contexts + ndev && c->magic == CTX_MAGIC; }

static CUresult current_dev(int *dev) {
    CUcontext c = current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = c->dev;
    return CUDA_SUCCESS;
}

static CUresult stream_dev(CUstream s, int *dev) {
    if ((uintptr_t)s <= 2) return current_dev(dev); /* NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
    if (s->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    *dev = s->dev;
    return CUDA_SUCCESS;
}

/* ---- live allocations: chained hash keyed by pointer or handle ------------------------- */
enum { K_PTR = 1, K_HANDLE = 2 };
struct alloc { unsigned long long key, bytes; int dev, kind; struct alloc *next; };
#define BUCKETS 4096
static struct alloc *table[BUCKETS];
static struct alloc *spare; /* free list of nodes */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long next_addr = 0x100000000000ULL; /* 64-bit pointers and handles */
static unsigned long long next_addr32 = 0x10000000ULL;   /* v1 32-bit pointers */

static unsigned bucket(unsigned long long key) { return (unsigned)((key >> 8) * 0x9E3779B97F4A7C15ULL >> 52) % BUCKETS; }

/* Reserve `bytes` on `dev` and record a fresh key; 0 or a CUresult. */
static CUresult take(int dev, unsigned long long bytes, int kind, int narrow, unsigned long long *key) {
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(dev)) return CUDA_ERROR_INVALID_DEVICE;
    unsigned long long step = (bytes + 255) & ~255ULL;
    if (step < bytes) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct alloc *a = spare;
    if (a) spare = a->next;
    else a = malloc(sizeof *a);
    unsigned long long *next = narrow ? &next_addr32 : &next_addr;
    unsigned long long limit = narrow ? 0xFFFFFFFFULL : ~0ULL;
    if (!a || bytes > total_mem[dev] - used_mem[dev] || step > limit - *next) {
        if (a) { a->next = spare; spare = a; }
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    used_mem[dev] += bytes;
    *a = (struct alloc){*next, bytes, dev, kind, NULL};
    *next += step;
    unsigned b = bucket(a->key);
    a->next = table[b];
    table[b] = a;
    *key = a->key;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

static CUresult give(unsigned long long key, int kind) {
    pthread_mutex_lock(&lock);
    for (struct alloc **pp = &table[bucket(key)]; *pp; pp = &(*pp)->next) {
        struct alloc *a = *pp;
        if (a->key == key && a->kind == kind) {
            used_mem[a->dev] -= a->bytes;
            *pp = a->next;
            a->next = spare;
            spare = a;
            pthread_mutex_unlock(&lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult alloc_here(CUdeviceptr *dptr, unsigned long long bytes) {
    int dev;
    CUresult r = current_dev(&dev);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return take(dev, bytes, K_PTR, 0, dptr);
}

/* ---- initialisation and devices ------------------------------------------------------- */
EXPORT CUresult cuInit(unsigned int flags) {
    ENTER(cuInit);
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&init_once, do_init);
    return init_result;
}
EXPORT CUresult cuDriverGetVersion(int *v) {
    ENTER(cuDriverGetVersion);
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = DRIVER_VERSION;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) {
    ENTER(cuDeviceGetCount); NEED_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = ndev;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    ENTER(cuDeviceGet); NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    ENTER(cuDeviceGetName); NEED_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake CUDA Device %d", d);
    return CUDA_SUCCESS;
}
static CUresult uuid_of(CUuuid *u, CUdevice d) {
    NEED_INIT();
    if (!u) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    memset(u->bytes, 0, sizeof u->bytes);
    u->bytes[0] = (char)0xfa;
    u->bytes[1] = (char)0xce;
    u->bytes[15] = (char)d;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { ENTER(cuDeviceGetUuid); return uuid_of(u, d); }
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { ENTER(cuDeviceGetUuid_v2); return uuid_of(u, d); }
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    ENTER(cuDeviceTotalMem_v2); NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = total_mem[d];
    return CUDA_SUCCESS;
}
static unsigned int clamp32(unsigned long long v) { return v > 0xFFFFFFFFULL ? 0xFFFFFFFFu : (unsigned int)v; }
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d) {
    ENTER(cuDeviceTotalMem); NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = clamp32(total_mem[d]);
    return CUDA_SUCCESS;
}

/* ---- contexts ------------------------------------------------------------------------ */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) {
    ENTER(cuDevicePrimaryCtxRetain); NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *pctx = &contexts[d];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    ENTER(cuDevicePrimaryCtxRelease_v2); NEED_INIT();
    return VALID_DEV(d) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c) {
    ENTER(cuCtxPushCurrent_v2); NEED_INIT();
    if (!valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth == CTX_STACK) return CUDA_ERROR_INVALID_VALUE;
    ctx_stack[ctx_depth++] = c;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    ENTER(cuCtxPopCurrent_v2); NEED_INIT();
    if (!ctx_depth) return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = ctx_stack[--ctx_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d) {
    ENTER(cuCtxCreate_v2); NEED_INIT();
    (void)flags;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    if (ctx_depth == CTX_STACK) return CUDA_ERROR_INVALID_VALUE;
    *pctx = &contexts[d];
    ctx_stack[ctx_depth++] = *pctx;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext c) {
    ENTER(cuCtxDestroy_v2); NEED_INIT();
    if (!valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (current_ctx() == c) ctx_depth--;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
    ENTER(cuCtxSetCurrent); NEED_INIT();
    if (!c) { if (ctx_depth) ctx_depth--; return CUDA_SUCCESS; }
    if (!valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth) ctx_stack[ctx_depth - 1] = c;
    else ctx_stack[ctx_depth++] = c;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    ENTER(cuCtxGetCurrent); NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    ENTER(cuCtxGetDevice); NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return current_dev(d);
}

/* ---- memory -------------------------------------------------------------------------- */
EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    ENTER(cuMemGetInfo_v2); NEED_INIT();
    int dev;
    CUresult r = current_dev(&dev);
    if (r) return r;
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *free_b = total_mem[dev] - used_mem[dev];
    pthread_mutex_unlock(&lock);
    *total_b = total_mem[dev];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b) {
    ENTER(cuMemGetInfo); NEED_INIT();
    int dev;
    CUresult r = current_dev(&dev);
    if (r) return r;
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *free_b = clamp32(total_mem[dev] - used_mem[dev]);
    pthread_mutex_unlock(&lock);
    *total_b = clamp32(total_mem[dev]);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    ENTER(cuMemAlloc_v2); NEED_INIT();
    return alloc_here(dptr, bytes);
}
EXPORT CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytes) {
    ENTER(cuMemAlloc); NEED_INIT();
    int dev;
    unsigned long long key;
    CUresult r = current_dev(&dev);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    r = take(dev, bytes, K_PTR, 1, &key);
    if (!r) *dptr = (unsigned int)key;
    return r;
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem) {
    ENTER(cuMemAllocPitch_v2); NEED_INIT();
    if (!pitch || (elem != 4 && elem != 8 && elem != 16) || width == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t p = (width + 511) & ~(size_t)511;
    if (p < width || height > ~(size_t)0 / p) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = alloc_here(dptr, p * height);
    if (!r) *pitch = p;
    return r;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    ENTER(cuMemAllocManaged); NEED_INIT();
    (void)flags;
    return alloc_here(dptr, bytes);
}
static CUresult alloc_on_stream(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    NEED_INIT();
    int dev;
    CUresult r = stream_dev(s, &dev);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return take(dev, bytes, K_PTR, 0, dptr);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) { ENTER(cuMemAllocAsync); return alloc_on_stream(dptr, bytes, s); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s) { ENTER(cuMemAllocAsync_ptsz); return alloc_on_stream(dptr, bytes, s); }
static CUresult alloc_from_pool(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s) {
    NEED_INIT();
    int dev;
    if (!pool || pool->magic != POOL_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = stream_dev(s, &dev);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return take(pool->dev, bytes, K_PTR, 0, dptr);
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s) {
    ENTER(cuMemAllocFromPoolAsync); return alloc_from_pool(dptr, bytes, pool, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s) {
    ENTER(cuMemAllocFromPoolAsync_ptsz); return alloc_from_pool(dptr, bytes, pool, s);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { ENTER(cuMemFree_v2); NEED_INIT(); return give(p, K_PTR); }
EXPORT CUresult cuMemFree(unsigned int p) { ENTER(cuMemFree); NEED_INIT(); return give(p, K_PTR); }
static CUresult free_on_stream(CUdeviceptr p, CUstream s) {
    NEED_INIT();
    int dev;
    CUresult r = stream_dev(s, &dev);
    return r ? r : give(p, K_PTR);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { ENTER(cuMemFreeAsync); return free_on_stream(p, s); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { ENTER(cuMemFreeAsync_ptsz); return free_on_stream(p, s); }

/* CUmemAllocationProp / CUmemPoolProps: location.type at byte 8 (1 = device), location.id at 12. */
static CUresult location_dev(const void *props, int *dev) {
    if (!props) return CUDA_ERROR_INVALID_VALUE;
    int type, id;
    memcpy(&type, (const char *)props + 8, sizeof type);
    memcpy(&id, (const char *)props + 12, sizeof id);
    if (type != 1) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(id)) return CUDA_ERROR_INVALID_DEVICE;
    *dev = id;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes, const void *prop, unsigned long long flags) {
    ENTER(cuMemCreate); NEED_INIT();
    int dev;
    CUresult r = location_dev(prop, &dev);
    if (r) return r;
    if (!h || flags) return CUDA_ERROR_INVALID_VALUE;
    return take(dev, bytes, K_HANDLE, 0, h);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { ENTER(cuMemRelease); NEED_INIT(); return give(h, K_HANDLE); }
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props) {
    ENTER(cuMemPoolCreate); NEED_INIT();
    int dev;
    CUresult r = location_dev(props, &dev);
    if (r) return r;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    struct fake_pool *p = malloc(sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (struct fake_pool){POOL_MAGIC, dev};
    *pool = p;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    ENTER(cuMemPoolDestroy); NEED_INIT();
    if (!pool || pool->magic != POOL_MAGIC || (pool >= default_pools && pool < default_pools + MAX_DEVICES))
        return CUDA_ERROR_INVALID_VALUE;
    pool->magic = 0;
    free(pool);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d) {
    ENTER(cuDeviceGetDefaultMemPool); NEED_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *pool = &default_pools[d];
    return CUDA_SUCCESS;
}

/* ---- streams and launches -------------------------------------------------------------- */
EXPORT CUresult cuStreamCreate(CUstream *ps, unsigned int flags) {
    ENTER(cuStreamCreate); NEED_INIT();
    int dev;
    (void)flags;
    CUresult r = current_dev(&dev);
    if (r) return r;
    if (!ps) return CUDA_ERROR_INVALID_VALUE;
    struct fake_stream *s = malloc(sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    *s = (struct fake_stream){STREAM_MAGIC, dev};
    *ps = s;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    ENTER(cuStreamDestroy_v2); NEED_INIT();
    if ((uintptr_t)s <= 2 || s->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}
#define LAUNCH_ARGS void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
                    unsigned shmem, CUstream s, void **params, void **extra
#define UNUSED_LAUNCH (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)s, \
                      (void)params, (void)extra
EXPORT CUresult cuLaunchKernel(LAUNCH_ARGS) { ENTER(cuLaunchKernel); UNUSED_LAUNCH; return CUDA_SUCCESS; }
EXPORT CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS) { ENTER(cuLaunchKernel_ptsz); UNUSED_LAUNCH; return CUDA_SUCCESS; }

/* ---- enough for numba's ctypes driver binding (tests/e2e/test_numba.py) --------------------- */
/* Attributes: compute capability 8.0, 108 SMs, warp 32, unified addressing; every other
 * attribute below 200 reads 0 (the real driver has values for each; numba reads a few). */
EXPORT CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice d) {
    ENTER(cuDeviceGetAttribute); NEED_INIT();
    if (!value || attrib <= 0 || attrib >= 200) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 1: *value = 1024; break;          /* MAX_THREADS_PER_BLOCK */
    case 2: case 5: *value = 1024; break;  /* MAX_BLOCK_DIM_X, MAX_GRID_DIM_X (small, fake) */
    case 10: *value = 32; break;           /* WARP_SIZE */
    case 16: *value = 108; break;          /* MULTIPROCESSOR_COUNT */
    case 41: *value = 1; break;            /* UNIFIED_ADDRESSING */
    case 75: *value = 8; break;            /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;            /* COMPUTE_CAPABILITY_MINOR */
    case 33: *value = d + 1; break;        /* PCI_BUS_ID */
    default: *value = 0;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active) {
    ENTER(cuDevicePrimaryCtxGetState); NEED_INIT();
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = 1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) {
    ENTER(cuDevicePrimaryCtxReset_v2); NEED_INIT();
    return VALID_DEV(d) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
EXPORT CUresult cuCtxSynchronize(void) {
    ENTER(cuCtxSynchronize); NEED_INIT();
    return current_ctx() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
/* IPC is not faked: numba only needs the symbol to exist. */
typedef struct { char reserved[64]; } CUipcMemHandle;
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
    ENTER(cuIpcOpenMemHandle_v2); NEED_INIT();
    (void)dptr, (void)h, (void)flags;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ---- errors --------------------------------------------------------------------------- */
static const struct { int code; const char *name, *text; } errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};
static CUresult error_field(CUresult e, const char **out, int want_name) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == e) { *out = want_name ? errors[i].name : errors[i].text; return CUDA_SUCCESS; }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char **s) { ENTER(cuGetErrorString); return error_field(e, s, 0); }
EXPORT CUresult cuGetErrorName(CUresult e, const char **s) { ENTER(cuGetErrorName); return error_field(e, s, 1); }

/* ---- cuGetProcAddress: (base name, ABI version, per-thread-stream?) -> exported function -- */
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
#define P(base, ver, fn) {#base, ver, 0, (void *)fn}
#define PT(base, ver, fn) {#base, ver, 1, (void *)fn}
static const struct { const char *base; int version, ptsz; void *fn; } procs[] = {
    P(cuInit, 2000, cuInit), P(cuDriverGetVersion, 2020, cuDriverGetVersion),
    P(cuDeviceGet, 2000, cuDeviceGet), P(cuDeviceGetCount, 2000, cuDeviceGetCount),
    P(cuDeviceGetName, 2000, cuDeviceGetName),
    P(cuDeviceGetUuid, 9020, cuDeviceGetUuid), P(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2),
    P(cuDeviceTotalMem, 2000, cuDeviceTotalMem), P(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2),
    P(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    P(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2),
    P(cuCtxCreate, 3020, cuCtxCreate_v2), P(cuCtxDestroy, 4000, cuCtxDestroy_v2),
    P(cuCtxSetCurrent, 4000, cuCtxSetCurrent), P(cuCtxGetCurrent, 4000, cuCtxGetCurrent),
    P(cuCtxGetDevice, 2000, cuCtxGetDevice),
    P(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2), P(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2),
    P(cuMemGetInfo, 2000, cuMemGetInfo), P(cuMemGetInfo, 3020, cuMemGetInfo_v2),
    P(cuMemAlloc, 2000, cuMemAlloc), P(cuMemAlloc, 3020, cuMemAlloc_v2),
    P(cuMemFree, 2000, cuMemFree), P(cuMemFree, 3020, cuMemFree_v2),
    P(cuMemAllocPitch, 3020, cuMemAllocPitch_v2), P(cuMemAllocManaged, 6000, cuMemAllocManaged),
    P(cuMemAllocAsync, 11020, cuMemAllocAsync), PT(cuMemAllocAsync, 11020, cuMemAllocAsync_ptsz),
    P(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync),
    PT(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync_ptsz),
    P(cuMemFreeAsync, 11020, cuMemFreeAsync), PT(cuMemFreeAsync, 11020, cuMemFreeAsync_ptsz),
    P(cuMemCreate, 10020, cuMemCreate), P(cuMemRelease, 10020, cuMemRelease),
    P(cuMemPoolCreate, 11020, cuMemPoolCreate), P(cuMemPoolDestroy, 11020, cuMemPoolDestroy),
    P(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool),
    P(cuStreamCreate, 2000, cuStreamCreate), P(cuStreamDestroy, 4000, cuStreamDestroy_v2),
    P(cuLaunchKernel, 4000, cuLaunchKernel), PT(cuLaunchKernel, 7000, cuLaunchKernel_ptsz),
    P(cuGetErrorString, 6000, cuGetErrorString), P(cuGetErrorName, 6000, cuGetErrorName),
    P(cuGetProcAddress, 11030, cuGetProcAddress), P(cuGetProcAddress, 12000, cuGetProcAddress_v2),
    P(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute), P(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState),
    P(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2), P(cuCtxSynchronize, 2000, cuCtxSynchronize),
    P(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle_v2),
};

static CUresult lookup(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    if (!symbol || !pfn || version > DRIVER_VERSION) return CUDA_ERROR_INVALID_VALUE;
    int want_ptsz = (flags & PROC_FLAG_PER_THREAD_DEFAULT_STREAM) != 0;
    int found = 0, best = -1, best_ptsz = -1;
    for (int i = 0; i < (int)(sizeof procs / sizeof procs[0]); i++) {
        if (strcmp(procs[i].base, symbol) != 0) continue;
        found = 1;
        if (procs[i].version > version) continue;
        int *slot = procs[i].ptsz ? &best_ptsz : &best;
        if (*slot < 0 || procs[i].version > procs[*slot].version) *slot = i;
    }
    if (want_ptsz && best_ptsz >= 0) best = best_ptsz;
    *pfn = best >= 0 ? procs[best].fn : NULL;
    if (status) *status = best >= 0 ? PROC_SUCCESS : found ? PROC_VERSION_NOT_SUFFICIENT : PROC_SYMBOL_NOT_FOUND;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    ENTER(cuGetProcAddress);
    return lookup(symbol, pfn, version, flags, NULL);
}
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    ENTER(cuGetProcAddress_v2);
    return lookup(symbol, pfn, version, flags, status);
}

/* ---- test probes ---------------------------------------------------------------------- */
EXPORT unsigned long long fakecuda_used(int dev) {
    if (dev < 0 || dev >= MAX_DEVICES) return 0;
    pthread_mutex_lock(&lock);
    unsigned long long v = used_mem[dev];
    pthread_mutex_unlock(&lock);
    return v;
}
EXPORT unsigned long long fakecuda_calls(const char *name) {
    for (int i = 0; name && i < F_COUNT; i++)
        if (strcmp(fn_names[i], name) == 0) return __atomic_load_n(&calls[i], __ATOMIC_RELAXED);
    return 0;
}
EXPORT void fakecuda_reset_counts(void) {
    for (int i = 0; i < F_COUNT; i++) __atomic_store_n(&calls[i], 0, __ATOMIC_RELAXED);
}
