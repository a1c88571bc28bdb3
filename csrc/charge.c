/* Charging (charge.h): which device pays, the cap, the region; remembering what was charged
 * (track.h) so the matching free uncharges exactly that.
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
#include "charge.h"
#include "hooks.h"
#include "log.h"
#include "state.h"

static ms_ratelimit g_oom_rl;
static ms_ratelimit g_refuse_rl;

static void report_over_cap(const char *fn, int dev, uint64_t cap, uint64_t in_use, uint64_t bytes)
{
    ms_log_limited(&g_oom_rl, MS_LOG_WARN,
                   "%s refused with CUDA_ERROR_OUT_OF_MEMORY: device %d cap %llu bytes, in use %llu, requested %llu "
                   "(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)",
                   fn, dev, (unsigned long long)cap, (unsigned long long)in_use, (unsigned long long)bytes);
}

int ms_hot;
ms_region *ms_hot_region;
ms_region *ms_fast_region;
uint64_t ms_fast_cap;

int ms_hot_mode_slow(void)
{
    int m;
    if (ms_disabled()) {
        m = MS_HOT_PASS;
    } else {
        const ms_state *s = ms_state_get();
        m = s->limits_bad ? MS_HOT_BAD : s->limits.count == 0 ? MS_HOT_PASS : MS_HOT_CAPPED;
        __atomic_store_n(&ms_hot_region, s->region, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&ms_hot, m, __ATOMIC_RELEASE);
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
    int mode = ms_hot_mode();
    if (mode == MS_HOT_PASS)
        return CUDA_SUCCESS;
    if (mode == MS_HOT_BAD) /* the one line was printed when the variable was read */
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
    int r = ms_region_charge_q(s->region, dev, cap, bytes, &in_use);
    if (r != MS_OK)
        return ms_charge_refused(fn, dev, cap, in_use, bytes, r);
    c->charged = 1;
    c->dev = dev;
    c->cap = cap;
    c->bytes = bytes;
    if (dev == 0 && __atomic_load_n(&g_one_device, __ATOMIC_RELAXED) == 1 &&
        __atomic_load_n(&ms_fast_region, __ATOMIC_RELAXED) == NULL) {
        ms_fast_cap = cap;
        __atomic_store_n(&ms_fast_region, s->region, __ATOMIC_RELEASE);
    }
    return CUDA_SUCCESS;
}

void ms_uncharge(int dev, uint64_t bytes)
{
    ms_region *r = ms_state_get()->region;
    if (r != NULL)
        ms_region_uncharge(r, dev, bytes);
}

CUresult ms_charge_refused(const char *fn, int dev, uint64_t cap, uint64_t in_use, uint64_t bytes, int r)
{
    if (r == MS_OVER_CAP) {
        report_over_cap(fn, dev, cap, in_use, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ms_log_limited(&g_refuse_rl, MS_LOG_ERROR, "%s refused: accounting region %s is corrupted", fn,
                   ms_state_get()->region_path);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* How to give an allocation back when it cannot be remembered. */
void ms_undo_alloc(ms_undo_kind kind, uint64_t key)
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
    if ((kind == MS_TRACK_PTR ? ms_track_add_ptr(key, c->dev, c->bytes) : ms_track_add(kind, key, c->dev, c->bytes)) != 0)
        return ms_charge_unremembered(fn, c, key, undo);
    return CUDA_SUCCESS;
}

CUresult ms_charge_unremembered(const char *fn, const ms_charge *c, uint64_t key, ms_undo_kind undo)
{
    ms_undo_alloc(undo, key);
    ms_uncharge(c->dev, c->bytes);
    ms_log(MS_LOG_ERROR, "%s refused: no memory to remember the allocation", fn);
    return CUDA_ERROR_OUT_OF_MEMORY;
}
