/* cuInit and the memory queries frameworks size their pools from.
 *
 * For a capped device: total = min(cap, physical total); free = min(real free, cap - used),
 * never below 0 (used is the container-wide usage in the region, after dead processes' charges
 * are given back, so every process of the container sees the same slice). With an unusable region free is reported as 0, matching
 * the refusal of every allocation. Uncapped devices report what the driver says. */
#include "hooks.h"
#include "log.h"
#include "state.h"

/* With a malformed CUDA_MPS_PINNED_DEVICE_MEM_LIMIT the real cuInit is never called, so CUDA
 * stays uninitialised: cuInit returns CUDA_ERROR_INVALID_VALUE (the configuration value is
 * invalid) and every later driver call gets the driver's own CUDA_ERROR_NOT_INITIALIZED. */
CUresult ms_hk_cuInit(unsigned int flags)
{
    __typeof(ms_hk_cuInit) *real = MS_REAL(cuInit);
    if (real == NULL)
        return ms_no_driver("cuInit");
    if (!ms_disabled() && ms_state_get()->limits_bad)
        return CUDA_ERROR_INVALID_VALUE;
    return real(flags);
}
MS_EXPORT_AS(cuInit)

/* The cap of a device: 1 and *cap if reported values should show one, else 0. */
static int device_cap(CUdevice dev, uint64_t *cap)
{
    return ms_caps_reported() && ms_cap_of_device(dev, cap) == 1;
}

/* The cap of the current context's device: 1 and *dev, *cap if capped, else 0. */
static int current_cap(int *dev, uint64_t *cap)
{
    if (!ms_caps_reported())
        return 0;
    ms_cuCtxGetDevice_fn get = (ms_cuCtxGetDevice_fn)ms_real_fn(MS_ID_cuCtxGetDevice);
    if (get == NULL || get(dev) != CUDA_SUCCESS)
        return 0;
    return ms_cap_of_device(*dev, cap) == 1;
}

static void clamp_to_cap(int dev, uint64_t cap, uint64_t *free_b, uint64_t *total_b)
{
    ms_region *r = ms_state_get()->region;
    uint64_t total = cap < *total_b ? cap : *total_b;
    uint64_t used = r != NULL ? ms_region_used_live(r, dev) : cap;
    uint64_t avail = cap > used ? cap - used : 0;
    if (avail > total)
        avail = total;
    if (*free_b > avail)
        *free_b = avail;
    *total_b = total;
}

CUresult ms_hk_cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    __typeof(ms_hk_cuMemGetInfo_v2) *real = MS_REAL(cuMemGetInfo_v2);
    if (real == NULL)
        return ms_no_driver("cuMemGetInfo_v2");
    CUresult rc = real(free_b, total_b);
    int dev;
    uint64_t cap;
    if (rc == CUDA_SUCCESS && current_cap(&dev, &cap)) {
        uint64_t f = *free_b, t = *total_b;
        clamp_to_cap(dev, cap, &f, &t);
        *free_b = (size_t)f;
        *total_b = (size_t)t;
    }
    return rc;
}
MS_EXPORT_AS(cuMemGetInfo_v2)

/* 2000-era ABI: the driver clamps to 32 bits; the capped values are never larger. */
CUresult ms_hk_cuMemGetInfo(unsigned int *free_b, unsigned int *total_b)
{
    __typeof(ms_hk_cuMemGetInfo) *real = MS_REAL(cuMemGetInfo);
    if (real == NULL)
        return ms_no_driver("cuMemGetInfo");
    CUresult rc = real(free_b, total_b);
    int dev;
    uint64_t cap;
    if (rc == CUDA_SUCCESS && current_cap(&dev, &cap)) {
        uint64_t f = *free_b, t = *total_b;
        clamp_to_cap(dev, cap, &f, &t);
        *free_b = (unsigned int)f;
        *total_b = (unsigned int)t;
    }
    return rc;
}
MS_EXPORT_AS(cuMemGetInfo)

CUresult ms_hk_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    __typeof(ms_hk_cuDeviceTotalMem_v2) *real = MS_REAL(cuDeviceTotalMem_v2);
    if (real == NULL)
        return ms_no_driver("cuDeviceTotalMem_v2");
    CUresult rc = real(bytes, dev);
    uint64_t cap;
    if (rc == CUDA_SUCCESS && device_cap(dev, &cap) && cap < *bytes)
        *bytes = (size_t)cap;
    return rc;
}
MS_EXPORT_AS(cuDeviceTotalMem_v2)

CUresult ms_hk_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    __typeof(ms_hk_cuDeviceTotalMem) *real = MS_REAL(cuDeviceTotalMem);
    if (real == NULL)
        return ms_no_driver("cuDeviceTotalMem");
    CUresult rc = real(bytes, dev);
    uint64_t cap;
    if (rc == CUDA_SUCCESS && device_cap(dev, &cap) && cap < *bytes)
        *bytes = (unsigned int)cap;
    return rc;
}
MS_EXPORT_AS(cuDeviceTotalMem)
