/* Errors and cuGetProcAddress of the fake libcuda.so.1 (contract: fake_cuda.c). */
#include <string.h>

#include "fake_cuda.h"

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
/* Exported by fake_cuda_mem.c but not declared in fake_cuda.h. */
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags);
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr);

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
    P(cuMemMap, 10020, cuMemMap), P(cuMemUnmap, 10020, cuMemUnmap),
    P(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle),
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
