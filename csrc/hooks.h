/* The hook table: every driver/NVML function the shim replaces (H) or only calls (R).
 *
 * A hook ms_hk_NAME is exported as NAME (an alias with default visibility), handed out by
 * the dlsym override for NAME, and by cuGetProcAddress(_v2) whenever the driver answered
 * with the real NAME. Hooks have exactly the real function's signature, so the real
 * pointer is typed with __typeof(ms_hk_NAME).
 *
 * The 2000-era names cuMemAlloc, cuMemFree, cuMemGetInfo, cuDeviceTotalMem keep their
 * 32-bit ABI and are hooked with their own 32-bit signatures (a v1 allocation is capped
 * too). Other v1 names (cuMemAllocPitch, cuArrayCreate, ...) are not hooked: they pass
 * through untouched on every path. */
#ifndef MPSSHIM_HOOKS_H
#define MPSSHIM_HOOKS_H

#include "cuda_types.h"
#include "real.h"

#define MS_EXPORT __attribute__((visibility("default")))
#define MS_HIDDEN __attribute__((visibility("hidden")))
/* Export ms_hk_NAME under the driver's name NAME (same address, so pointers compare). */
#define MS_EXPORT_AS(NAME) extern __typeof(ms_hk_##NAME) NAME MS_EXPORT __attribute__((alias("ms_hk_" #NAME)));

/* H(name, lib): hooked; R(name, lib): real only (the shim calls it, never replaces it). */
#define MS_HOOK_LIST(H, R)                                                                       \
    H(cuInit, MS_LIB_CUDA)                                                                       \
    H(cuGetProcAddress, MS_LIB_CUDA)                                                             \
    H(cuGetProcAddress_v2, MS_LIB_CUDA)                                                          \
    H(cuMemAlloc_v2, MS_LIB_CUDA)                                                                \
    H(cuMemAlloc, MS_LIB_CUDA)                                                                   \
    H(cuMemAllocPitch_v2, MS_LIB_CUDA)                                                           \
    H(cuMemAllocManaged, MS_LIB_CUDA)                                                            \
    H(cuMemAllocAsync, MS_LIB_CUDA)                                                              \
    H(cuMemAllocAsync_ptsz, MS_LIB_CUDA)                                                         \
    H(cuMemAllocFromPoolAsync, MS_LIB_CUDA)                                                      \
    H(cuMemAllocFromPoolAsync_ptsz, MS_LIB_CUDA)                                                 \
    H(cuMemCreate, MS_LIB_CUDA)                                                                  \
    H(cuMemFree_v2, MS_LIB_CUDA)                                                                 \
    H(cuMemFree, MS_LIB_CUDA)                                                                    \
    H(cuMemFreeAsync, MS_LIB_CUDA)                                                               \
    H(cuMemFreeAsync_ptsz, MS_LIB_CUDA)                                                          \
    H(cuMemRelease, MS_LIB_CUDA)                                                                 \
    H(cuMemMap, MS_LIB_CUDA)                                                                     \
    H(cuMemUnmap, MS_LIB_CUDA)                                                                   \
    H(cuMemRetainAllocationHandle, MS_LIB_CUDA)                                                  \
    H(cuMemGetInfo_v2, MS_LIB_CUDA)                                                              \
    H(cuMemGetInfo, MS_LIB_CUDA)                                                                 \
    H(cuDeviceTotalMem_v2, MS_LIB_CUDA)                                                          \
    H(cuDeviceTotalMem, MS_LIB_CUDA)                                                             \
    H(nvmlDeviceGetMemoryInfo, MS_LIB_NVML)                                                      \
    H(nvmlDeviceGetMemoryInfo_v2, MS_LIB_NVML)                                                   \
    R(cuCtxGetDevice, MS_LIB_CUDA)                                                               \
    R(cuDeviceGetUuid_v2, MS_LIB_CUDA)                                                           \
    R(cuDeviceGetUuid, MS_LIB_CUDA)                                                              \
    R(cuDeviceGetCount, MS_LIB_CUDA)                                                             \
    R(nvmlDeviceGetUUID, MS_LIB_NVML)                                                            \
    R(nvmlDeviceGetIndex, MS_LIB_NVML)

#define MS_ID_(name, lib) MS_ID_##name,
enum ms_hook_id { MS_HOOK_LIST(MS_ID_, MS_ID_) MS_HOOK_COUNT };
#undef MS_ID_

/* Hooks (signatures of the real functions). */
CUresult ms_hk_cuInit(unsigned int flags);
CUresult ms_hk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult ms_hk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *symbolStatus);
CUresult ms_hk_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult ms_hk_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
CUresult ms_hk_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                  unsigned int elementSize);
CUresult ms_hk_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult ms_hk_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream);
CUresult ms_hk_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream);
CUresult ms_hk_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream);
CUresult ms_hk_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                            CUstream stream);
CUresult ms_hk_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags);
CUresult ms_hk_cuMemFree_v2(CUdeviceptr dptr);
CUresult ms_hk_cuMemFree(CUdeviceptr_v1 dptr);
CUresult ms_hk_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream);
CUresult ms_hk_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream);
CUresult ms_hk_cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult ms_hk_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags);
CUresult ms_hk_cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult ms_hk_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult ms_hk_cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult ms_hk_cuMemGetInfo(unsigned int *free, unsigned int *total);
CUresult ms_hk_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult ms_hk_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
nvmlReturn_t ms_hk_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t ms_hk_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);

/* Real-only functions. */
typedef CUresult (*ms_cuCtxGetDevice_fn)(CUdevice *dev);
typedef CUresult (*ms_cuDeviceGetUuid_fn)(CUuuid *uuid, CUdevice dev);
typedef CUresult (*ms_cuDeviceGetCount_fn)(int *count);
typedef nvmlReturn_t (*ms_nvmlDeviceGetUUID_fn)(nvmlDevice_t device, char *uuid, unsigned int length);
typedef nvmlReturn_t (*ms_nvmlDeviceGetIndex_fn)(nvmlDevice_t device, unsigned int *index);

/* The real function of hook NAME, typed like the hook (NULL if the driver has none). */
#define MS_REAL(NAME) ((__typeof(ms_hk_##NAME) *)ms_real_fast(MS_ID_##NAME))

/* The real function for a table entry, resolved once (loading the library if needed). */
void *ms_real_fn(enum ms_hook_id id);
/* The real addresses resolved so far (written once each by hooks.c; atomic). */
extern void *ms_real_resolved[MS_HOOK_COUNT] MS_HIDDEN;
/* ms_real_fn without a call once resolved (every hook starts with it). */
static inline void *ms_real_fast(enum ms_hook_id id)
{
    void *p = __atomic_load_n(&ms_real_resolved[id], __ATOMIC_ACQUIRE);
    return p != NULL ? p : ms_real_fn(id);
}
/* Same, but never loads the library (NULL if it is not loaded). */
void *ms_real_fn_loaded(enum ms_hook_id id);

/* The hook exported under exactly `name`, or NULL (also NULL for real-only entries). */
void *ms_hook_by_name(const char *name, ms_lib *lib);
/* If `p` is the real function of a hooked entry of library `lib`, that entry's hook; else NULL.
 * Only entries of `lib` are looked at: resolving another library's entries while it is not
 * loaded would search the file system for it (dlopen RTLD_NOLOAD) on every call. */
void *ms_hook_by_real(const void *p, ms_lib lib);
/* 1 if `p` is one of the shim's hooks. */
int ms_is_hook(const void *p);
/* The hook of a hooked entry. */
void *ms_hook_of(enum ms_hook_id id);

/* The result a hook returns when the driver library cannot be found (one error line). */
CUresult ms_no_driver(const char *name);

#endif
