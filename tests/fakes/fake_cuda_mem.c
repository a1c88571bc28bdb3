/* Memory and streams of the fake libcuda.so.1 (contract: fake_cuda.c). */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

static unsigned long long used_mem[MAX_DEVICES]; /* guarded by lock */

/* The device of a stream: NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD mean the current context. */
static CUresult stream_dev(CUstream s, int *dev) {
    if ((uintptr_t)s <= 2) return fc_current_dev(dev);
    if (s->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    *dev = s->dev;
    return CUDA_SUCCESS;
}

/* ---- live allocations: chained hash keyed by pointer or handle ------------------------- */
enum { K_PTR = 1, K_HANDLE = 2, K_MAP = 3 };
/* K_HANDLE: holds = the handle's references (1 from cuMemCreate, + 1 per
 * cuMemRetainAllocationHandle, - 1 per cuMemRelease), ref = its mappings; the memory is freed
 * when both are 0. K_MAP: key = mapped address, bytes = mapping size, ref = the handle mapped there. */
struct alloc { unsigned long long key, bytes, ref; int dev, kind, holds; struct alloc *next; };
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
    if (!a || bytes > fc_total_mem[dev] - used_mem[dev] || step > limit - *next) {
        if (a) { a->next = spare; spare = a; }
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    used_mem[dev] += bytes;
    *a = (struct alloc){*next, bytes, 0, dev, kind, 1, NULL};
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
    CUresult r = fc_current_dev(&dev);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return take(dev, bytes, K_PTR, 0, dptr);
}

/* ---- memory -------------------------------------------------------------------------- */
EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    ENTER(cuMemGetInfo_v2); NEED_INIT();
    int dev;
    CUresult r = fc_current_dev(&dev);
    if (r) return r;
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *free_b = fc_total_mem[dev] - used_mem[dev];
    pthread_mutex_unlock(&lock);
    *total_b = fc_total_mem[dev];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b) {
    ENTER(cuMemGetInfo); NEED_INIT();
    int dev;
    CUresult r = fc_current_dev(&dev);
    if (r) return r;
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *free_b = clamp32(fc_total_mem[dev] - used_mem[dev]);
    pthread_mutex_unlock(&lock);
    *total_b = clamp32(fc_total_mem[dev]);
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
    CUresult r = fc_current_dev(&dev);
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
/* Virtual memory management (under `lock`): a handle's memory lives while it is unreleased or
 * mapped, as the real driver's does (cuMemUnmap: "backing memory allocations will be freed if
 * there are no existing mappings and there are no unreleased memory handles"). */
static struct alloc **find_locked(unsigned long long key, int kind) {
    for (struct alloc **pp = &table[bucket(key)]; *pp; pp = &(*pp)->next)
        if ((*pp)->key == key && (*pp)->kind == kind) return pp;
    return NULL;
}
static void unlink_locked(struct alloc **pp) {
    struct alloc *a = *pp;
    *pp = a->next;
    a->next = spare;
    spare = a;
}
/* Free a handle's memory if it has neither references nor mappings left. */
static void settle_handle_locked(struct alloc **pp) {
    if ((*pp)->holds == 0 && (*pp)->ref == 0) {
        used_mem[(*pp)->dev] -= (*pp)->bytes;
        unlink_locked(pp);
    }
}
/* FAKE_CUDA_VMM_YIELD=N: the VMM calls yield the CPU 0 to 2N times (N on average, varying from
 * call to call) before they act, which widens the windows in which racing threads see one
 * another and varies which of them acts first; then they call the program's
 * fakecuda_vmm_probe() if it exports one, just before acting (tests/shim/vmmrace.c looks there
 * for a charge given back while this driver still holds the memory). */
extern void fakecuda_vmm_probe(void) __attribute__((weak, visibility("default")));
static void vmm_yield(void) {
    static int n = -1;
    static __thread unsigned seed;
    int v = __atomic_load_n(&n, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *e = getenv("FAKE_CUDA_VMM_YIELD");
        v = e ? atoi(e) : 0;
        v = v < 0 ? 0 : v > 1000 ? 1000 : v;
        __atomic_store_n(&n, v, __ATOMIC_RELAXED);
    }
    if (seed == 0) seed = (unsigned)(uintptr_t)&seed | 1;
    seed ^= seed << 13, seed ^= seed >> 17, seed ^= seed << 5;
    for (unsigned i = 0, k = seed % (2u * (unsigned)v + 1); i < k; i++) sched_yield();
    if (v > 0 && fakecuda_vmm_probe) fakecuda_vmm_probe();
}
/* A handle with no reference left (released, kept alive by a mapping) is not a valid handle:
 * releasing or mapping it is refused, as the real driver refuses a released handle. */
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    ENTER(cuMemRelease); NEED_INIT();
    vmm_yield();
    pthread_mutex_lock(&lock);
    struct alloc **pp = find_locked(h, K_HANDLE);
    int ok = pp && (*pp)->holds > 0;
    if (ok) {
        (*pp)->holds--;
        settle_handle_locked(pp);
    }
    pthread_mutex_unlock(&lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
/* Not in fake_cuda.h's counter list (FAKE_CUDA_FUNCS): these three are not counted. */
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags);
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr);
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
    NEED_INIT();
    if (!ptr || !size || offset || flags) return CUDA_ERROR_INVALID_VALUE;
    vmm_yield();
    pthread_mutex_lock(&lock);
    struct alloc **hp = find_locked(h, K_HANDLE);
    struct alloc *m = spare;
    CUresult r = !hp || (*hp)->holds == 0 ? CUDA_ERROR_INVALID_HANDLE
               : size > (*hp)->bytes || find_locked(ptr, K_MAP) ? CUDA_ERROR_INVALID_VALUE
               : !m && !(m = malloc(sizeof *m)) ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    if (!r) {
        if (m == spare) spare = m->next;
        (*hp)->ref++;
        *m = (struct alloc){ptr, size, h, (*hp)->dev, K_MAP, 1, table[bucket(ptr)]};
        table[bucket(ptr)] = m;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
/* [ptr, ptr + size) must be exactly whole mappings, one after the other. */
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    unsigned long long end = ptr + size, at = ptr;
    if (!ptr || !size || end < ptr) return CUDA_ERROR_INVALID_VALUE;
    vmm_yield();
    pthread_mutex_lock(&lock);
    for (struct alloc **pp; at < end && (pp = find_locked(at, K_MAP)) && (*pp)->bytes <= end - at;)
        at += (*pp)->bytes;
    CUresult r = at == end ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (at = ptr; !r && at < end;) {
        struct alloc **pp = find_locked(at, K_MAP);
        unsigned long long h = (*pp)->ref;
        at += (*pp)->bytes;
        unlink_locked(pp);
        struct alloc **hp = find_locked(h, K_HANDLE);
        (*hp)->ref--;
        settle_handle_locked(hp);
    }
    pthread_mutex_unlock(&lock);
    return r;
}
/* The handle mapped at exactly `addr` (the real driver also accepts addresses inside it). */
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    NEED_INIT();
    if (!h) return CUDA_ERROR_INVALID_VALUE;
    vmm_yield();
    pthread_mutex_lock(&lock);
    struct alloc **mp = find_locked((unsigned long long)(uintptr_t)addr, K_MAP);
    struct alloc **hp = mp ? find_locked((*mp)->ref, K_HANDLE) : NULL;
    if (hp) {
        (*hp)->holds++;
        *h = (*hp)->key;
    }
    pthread_mutex_unlock(&lock);
    return hp ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
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
    if (!pool || pool->magic != POOL_MAGIC || (pool >= fc_default_pools && pool < fc_default_pools + MAX_DEVICES))
        return CUDA_ERROR_INVALID_VALUE;
    pool->magic = 0;
    free(pool);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d) {
    ENTER(cuDeviceGetDefaultMemPool); NEED_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *pool = &fc_default_pools[d];
    return CUDA_SUCCESS;
}

/* ---- streams and launches -------------------------------------------------------------- */
EXPORT CUresult cuStreamCreate(CUstream *ps, unsigned int flags) {
    ENTER(cuStreamCreate); NEED_INIT();
    int dev;
    (void)flags;
    CUresult r = fc_current_dev(&dev);
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
EXPORT CUresult cuLaunchKernel(LAUNCH_ARGS) { ENTER(cuLaunchKernel); UNUSED_LAUNCH; return CUDA_SUCCESS; }
EXPORT CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS) { ENTER(cuLaunchKernel_ptsz); UNUSED_LAUNCH; return CUDA_SUCCESS; }

/* ---- test probe ---------------------------------------------------------------------- */
EXPORT unsigned long long fakecuda_used(int dev) {
    if (dev < 0 || dev >= MAX_DEVICES) return 0;
    pthread_mutex_lock(&lock);
    unsigned long long v = used_mem[dev];
    pthread_mutex_unlock(&lock);
    return v;
}
