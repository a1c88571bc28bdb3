/* Allocation hooks: charge before the driver is called, roll back if it fails, remember
 * what was charged (track.h) so the matching free uncharges exactly that.
 *
 * Which device pays:
 *  - cuMemCreate (hooks_vmm.c): prop->location.id when location.type is DEVICE;
 *  - every other allocation: the device of the calling thread's current context. In a process
 *    that sees one device (cuDeviceGetCount == 1, fixed once cuInit has succeeded) every
 *    context is on device 0, so that is charged without asking the driver on each allocation;
 *    an allocation without a current context is then charged, refused by the driver
 *    (CUDA_ERROR_INVALID_CONTEXT) and rolled back. With several devices the driver is asked
 *    (cuCtxGetDevice); if that fails while caps are set, the allocation is refused with the
 *    error cuCtxGetDevice returned, without calling the driver: the driver refuses an
 *    allocation without a current context for the same reason, and forwarding it uncharged
 *    could let memory past the cap. (A per-thread cache keyed by the current CUcontext would
 *    not be safe: a destroyed context's handle can come back for another device.) Async and pool
 *    allocations are charged to the current context's device too (the stream's or pool's
 *    device is the same in the usual one-device-per-process set-up).
 *  - Managed memory is charged in full to the current device; pool allocations are charged
 *    the requested size (memory a pool keeps cached after a free is not counted).
 * Frees of pointers or handles the shim did not charge are forwarded without uncharging. */
#include <string.h>

#include "charge.h"
#include "hooks.h"
#include "log.h"
#include "state.h"
#include "track.h"

static ms_ratelimit g_oom_rl;
static ms_ratelimit g_refuse_rl;

static uint64_t sat_mul(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static void report_over_cap(const char *fn, int dev, uint64_t cap, uint64_t in_use, uint64_t bytes)
{
    ms_log_limited(&g_oom_rl, MS_LOG_WARN,
                   "%s refused with CUDA_ERROR_OUT_OF_MEMORY: device %d cap %llu bytes, in use %llu, requested %llu "
                   "(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)",
                   fn, dev, (unsigned long long)cap, (unsigned long long)in_use, (unsigned long long)bytes);
}

/* What the hot path needs of the configuration, which is read once (state.h) and then fixed:
 * one word to read per call instead of the disabled flag and the state. */
enum { HOT_UNKNOWN = 0, HOT_PASS, HOT_BAD, HOT_CAPPED };
static int g_hot;

static int hot_mode(void)
{
    int m = __atomic_load_n(&g_hot, __ATOMIC_ACQUIRE);
    if (m != HOT_UNKNOWN)
        return m;
    if (ms_disabled()) {
        m = HOT_PASS;
    } else {
        const ms_state *s = ms_state_get();
        m = s->limits_bad ? HOT_BAD : s->limits.count == 0 ? HOT_PASS : HOT_CAPPED;
    }
    __atomic_store_n(&g_hot, m, __ATOMIC_RELEASE);
    return m;
}

/* 1 once the driver said this process sees exactly one device, -1 once it said more, 0 while
 * it cannot say (before cuInit). The set of devices is fixed once cuInit has succeeded. */
static int g_one_device;

/* The device of the calling thread's current context (see the top of the file). */
static CUresult current_device(int *dev)
{
    int one = __atomic_load_n(&g_one_device, __ATOMIC_RELAXED);
    if (one == 0) {
        ms_cuDeviceGetCount_fn count = (ms_cuDeviceGetCount_fn)ms_real_fn(MS_ID_cuDeviceGetCount);
        int n = 0;
        if (count != NULL && count(&n) == CUDA_SUCCESS && n > 0)
            __atomic_store_n(&g_one_device, one = n == 1 ? 1 : -1, __ATOMIC_RELAXED);
    }
    if (one == 1) {
        *dev = 0;
        return CUDA_SUCCESS;
    }
    ms_cuCtxGetDevice_fn get = (ms_cuCtxGetDevice_fn)ms_real_fn(MS_ID_cuCtxGetDevice);
    if (get == NULL)
        return ms_no_driver("cuCtxGetDevice");
    return get(dev);
}

/* Decide whether `bytes` may be allocated on `dev` (or, dev < 0, the current context's
 * device) and charge them. CUDA_SUCCESS (c->charged says if anything was charged), or the
 * error to return without calling the driver. */
CUresult ms_charge_begin(const char *fn, int dev, uint64_t bytes, ms_charge *c)
{
    c->charged = 0;
    int mode = hot_mode();
    if (mode == HOT_PASS)
        return CUDA_SUCCESS;
    if (mode == HOT_BAD) /* the one line was printed when the variable was read */
        return CUDA_ERROR_OUT_OF_MEMORY;
    const ms_state *s = ms_state_get();
    if (dev < 0) {
        CUresult rc = current_device(&dev);
        if (rc != CUDA_SUCCESS) {
            ms_log_limited(&g_refuse_rl, MS_LOG_INFO, "%s refused with %d: cuCtxGetDevice failed (no current context?)",
                           fn, rc);
            return rc;
        }
    }
    uint64_t cap = 0;
    int capped = ms_cap_of_device(dev, &cap);
    if (capped == 0)
        return CUDA_SUCCESS;
    if (capped < 0) {
        ms_log_limited(&g_refuse_rl, MS_LOG_WARN, "%s refused on device %d: its cap cannot be determined", fn, dev);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (s->region == NULL) /* the one line was printed when the region failed to open */
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t in_use = 0;
    int r = ms_region_charge(s->region, dev, cap, bytes, &in_use);
    if (r == MS_OVER_CAP) {
        report_over_cap(fn, dev, cap, in_use, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r != MS_OK) {
        ms_log_limited(&g_refuse_rl, MS_LOG_ERROR, "%s refused: accounting region %s is corrupted", fn,
                       s->region_path);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->charged = 1;
    c->dev = dev;
    c->cap = cap;
    c->bytes = bytes;
    return CUDA_SUCCESS;
}

int ms_tracking(void) { return hot_mode() == HOT_CAPPED; }

void ms_uncharge(int dev, uint64_t bytes)
{
    ms_region *r = ms_state_get()->region;
    if (r != NULL)
        ms_region_uncharge(r, dev, bytes);
}

/* How to give an allocation back when it cannot be remembered. */
static void undo_alloc(ms_undo_kind kind, uint64_t key)
{
    if (kind == MS_UNDO_FREE_V2) {
        __typeof(ms_hk_cuMemFree_v2) *f = MS_REAL(cuMemFree_v2);
        if (f != NULL)
            f((CUdeviceptr)key);
    } else if (kind == MS_UNDO_FREE_V1) {
        __typeof(ms_hk_cuMemFree) *f = MS_REAL(cuMemFree);
        if (f != NULL)
            f((CUdeviceptr_v1)key);
    } else {
        __typeof(ms_hk_cuMemRelease) *f = MS_REAL(cuMemRelease);
        if (f != NULL)
            f((CUmemGenericAllocationHandle)key);
    }
}

/* After the driver answered `rc`: roll back on failure, remember the charge on success. */
CUresult ms_charge_end(const char *fn, ms_charge *c, CUresult rc, int kind, uint64_t key, ms_undo_kind undo)
{
    if (!c->charged)
        return rc;
    if (rc != CUDA_SUCCESS) {
        ms_uncharge(c->dev, c->bytes);
        return rc;
    }
    if ((kind == MS_TRACK_PTR ? ms_track_add_ptr(key, c->dev, c->bytes) : ms_track_add(kind, key, c->dev, c->bytes)) != 0) {
        undo_alloc(undo, key);
        ms_uncharge(c->dev, c->bytes);
        ms_log(MS_LOG_ERROR, "%s refused: no memory to remember the allocation", fn);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

typedef struct forget {
    int known;
    uint64_t ticket;
} forget;

/* The allocation stays in the table, marked as being freed, while the driver frees it: a racing
 * allocation that gets the same address cannot be forgotten instead, and a second free of the
 * same pointer racing with this one joins it, so that exactly one of them uncharges (track.h). */
static void forget_begin(int kind, uint64_t key, forget *f)
{
    f->known = ms_tracking() && ms_track_free_begin(kind, key, &f->ticket);
}

static CUresult forget_end(forget *f, CUresult rc, int kind, uint64_t key)
{
    int dev;
    uint64_t bytes;
    if (f->known && ms_track_free_end(kind, key, f->ticket, rc == CUDA_SUCCESS, &dev, &bytes))
        ms_uncharge(dev, bytes);
    return rc;
}

/* ---- allocations ---------------------------------------------------------------------- */

CUresult ms_hk_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    __typeof(ms_hk_cuMemAlloc_v2) *real = MS_REAL(cuMemAlloc_v2);
    if (real == NULL)
        return ms_no_driver("cuMemAlloc_v2");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAlloc_v2", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize);
    return ms_charge_end("cuMemAlloc_v2", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAlloc_v2)

/* 2000-era ABI: 32-bit size and pointer. */
CUresult ms_hk_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    __typeof(ms_hk_cuMemAlloc) *real = MS_REAL(cuMemAlloc);
    if (real == NULL)
        return ms_no_driver("cuMemAlloc");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAlloc", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize);
    return ms_charge_end("cuMemAlloc", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V1);
}
MS_EXPORT_AS(cuMemAlloc)

/* Charged width*height first (the least the driver can hand out), then corrected to
 * pitch*height as returned; a correction past the cap frees the allocation again. */
CUresult ms_hk_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                  unsigned int elementSize)
{
    __typeof(ms_hk_cuMemAllocPitch_v2) *real = MS_REAL(cuMemAllocPitch_v2);
    if (real == NULL)
        return ms_no_driver("cuMemAllocPitch_v2");
    ms_charge c;
    uint64_t estimate = sat_mul(width, height);
    CUresult rc = ms_charge_begin("cuMemAllocPitch_v2", -1, estimate, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, pitch, width, height, elementSize);
    if (c.charged && rc == CUDA_SUCCESS) {
        uint64_t actual = sat_mul(*pitch, height);
        if (actual > estimate) {
            uint64_t in_use = 0;
            ms_region *r = ms_state_get()->region;
            if (ms_region_charge(r, c.dev, c.cap, actual - estimate, &in_use) != MS_OK) {
                undo_alloc(MS_UNDO_FREE_V2, *dptr);
                ms_uncharge(c.dev, estimate);
                report_over_cap("cuMemAllocPitch_v2", c.dev, c.cap, in_use, actual);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
        } else if (actual < estimate) {
            ms_uncharge(c.dev, estimate - actual);
        }
        c.bytes = actual;
    }
    return ms_charge_end("cuMemAllocPitch_v2", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocPitch_v2)

CUresult ms_hk_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    __typeof(ms_hk_cuMemAllocManaged) *real = MS_REAL(cuMemAllocManaged);
    if (real == NULL)
        return ms_no_driver("cuMemAllocManaged");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAllocManaged", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, flags);
    return ms_charge_end("cuMemAllocManaged", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocManaged)

/* Stream-ordered allocations. cuMemFree_v2 may free them too, so it is the undo. */
CUresult ms_hk_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocAsync) *real = MS_REAL(cuMemAllocAsync);
    if (real == NULL)
        return ms_no_driver("cuMemAllocAsync");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAllocAsync", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, stream);
    return ms_charge_end("cuMemAllocAsync", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocAsync)

CUresult ms_hk_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocAsync_ptsz) *real = MS_REAL(cuMemAllocAsync_ptsz);
    if (real == NULL)
        return ms_no_driver("cuMemAllocAsync_ptsz");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAllocAsync_ptsz", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, stream);
    return ms_charge_end("cuMemAllocAsync_ptsz", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocAsync_ptsz)

CUresult ms_hk_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocFromPoolAsync) *real = MS_REAL(cuMemAllocFromPoolAsync);
    if (real == NULL)
        return ms_no_driver("cuMemAllocFromPoolAsync");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAllocFromPoolAsync", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, pool, stream);
    return ms_charge_end("cuMemAllocFromPoolAsync", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocFromPoolAsync)

CUresult ms_hk_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocFromPoolAsync_ptsz) *real = MS_REAL(cuMemAllocFromPoolAsync_ptsz);
    if (real == NULL)
        return ms_no_driver("cuMemAllocFromPoolAsync_ptsz");
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemAllocFromPoolAsync_ptsz", -1, bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, pool, stream);
    return ms_charge_end("cuMemAllocFromPoolAsync_ptsz", &c, rc, MS_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocFromPoolAsync_ptsz)

/* ---- frees ---------------------------------------------------------------------------- */

CUresult ms_hk_cuMemFree_v2(CUdeviceptr dptr)
{
    __typeof(ms_hk_cuMemFree_v2) *real = MS_REAL(cuMemFree_v2);
    if (real == NULL)
        return ms_no_driver("cuMemFree_v2");
    forget f;
    forget_begin(MS_TRACK_PTR, dptr, &f);
    return forget_end(&f, real(dptr), MS_TRACK_PTR, dptr);
}
MS_EXPORT_AS(cuMemFree_v2)

CUresult ms_hk_cuMemFree(CUdeviceptr_v1 dptr)
{
    __typeof(ms_hk_cuMemFree) *real = MS_REAL(cuMemFree);
    if (real == NULL)
        return ms_no_driver("cuMemFree");
    forget f;
    forget_begin(MS_TRACK_PTR, dptr, &f);
    return forget_end(&f, real(dptr), MS_TRACK_PTR, dptr);
}
MS_EXPORT_AS(cuMemFree)

/* The memory goes back to the pool in stream order; it is uncharged now. */
CUresult ms_hk_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    __typeof(ms_hk_cuMemFreeAsync) *real = MS_REAL(cuMemFreeAsync);
    if (real == NULL)
        return ms_no_driver("cuMemFreeAsync");
    forget f;
    forget_begin(MS_TRACK_PTR, dptr, &f);
    return forget_end(&f, real(dptr, stream), MS_TRACK_PTR, dptr);
}
MS_EXPORT_AS(cuMemFreeAsync)

CUresult ms_hk_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    __typeof(ms_hk_cuMemFreeAsync_ptsz) *real = MS_REAL(cuMemFreeAsync_ptsz);
    if (real == NULL)
        return ms_no_driver("cuMemFreeAsync_ptsz");
    forget f;
    forget_begin(MS_TRACK_PTR, dptr, &f);
    return forget_end(&f, real(dptr, stream), MS_TRACK_PTR, dptr);
}
MS_EXPORT_AS(cuMemFreeAsync_ptsz)
