/* Internal interface of the fake libcuda.so.1, shared by its source files (fake_cuda.c: state,
 * devices, contexts; fake_cuda_mem.c: memory, streams; fake_cuda_lookup.c: errors and
 * cuGetProcAddress). The contract is at the top of fake_cuda.c. Internal names start with fc_
 * and stay hidden (-fvisibility=hidden); only EXPORT functions are the library's ABI. */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_pool *CUmemoryPool;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcMemHandle;

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
extern unsigned long long fc_calls[F_COUNT];
extern const char *const fc_fn_names[F_COUNT];
extern int fc_log_calls;

/* First statement of every exported function: count the call, log it if asked. */
#define ENTER(n)                                                  \
    do {                                                          \
        __atomic_fetch_add(&fc_calls[F_##n], 1, __ATOMIC_RELAXED); \
        if (fc_log_calls) fprintf(stderr, "fakecuda: %s\n", #n);   \
    } while (0)

struct fake_ctx { unsigned magic; int dev; };
struct fake_stream { unsigned magic; int dev; };
struct fake_pool { unsigned magic; int dev; };
#define CTX_MAGIC 0xC0C0C0C0u
#define STREAM_MAGIC 0x5757u
#define POOL_MAGIC 0x9009u

extern int fc_ndev;
extern int fc_initialised;
extern unsigned long long fc_total_mem[MAX_DEVICES];
extern struct fake_ctx fc_contexts[MAX_DEVICES];
extern struct fake_pool fc_default_pools[MAX_DEVICES];

/* Every call but the few the real driver allows before cuInit starts with NEED_INIT(). */
#define NEED_INIT() \
    do { if (!__atomic_load_n(&fc_initialised, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define VALID_DEV(d) ((d) >= 0 && (d) < fc_ndev)

static inline unsigned int clamp32(unsigned long long v) { return v > 0xFFFFFFFFULL ? 0xFFFFFFFFu : (unsigned int)v; }

/* The calling thread's current context (NULL if none) and its device. */
CUcontext fc_current_ctx(void);
CUresult fc_current_dev(int *dev);

#define LAUNCH_ARGS void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
                    unsigned shmem, CUstream s, void **params, void **extra
#define UNUSED_LAUNCH (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)s, \
                      (void)params, (void)extra
/* The exported functions. */
EXPORT CUresult cuInit(unsigned int flags);
EXPORT CUresult cuDriverGetVersion(int *v);
EXPORT CUresult cuDeviceGetCount(int *n);
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal);
EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d);
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d);
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d);
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d);
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d);
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d);
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d);
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c);
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d);
EXPORT CUresult cuCtxDestroy_v2(CUcontext c);
EXPORT CUresult cuCtxSetCurrent(CUcontext c);
EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx);
EXPORT CUresult cuCtxGetDevice(CUdevice *d);
EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b);
EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b);
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
EXPORT CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytes);
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem);
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags);
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s);
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemFree_v2(CUdeviceptr p);
EXPORT CUresult cuMemFree(unsigned int p);
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s);
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes, const void *prop, unsigned long long flags);
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h);
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props);
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool);
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d);
EXPORT CUresult cuStreamCreate(CUstream *ps, unsigned int flags);
EXPORT CUresult cuStreamDestroy_v2(CUstream s);
EXPORT CUresult cuLaunchKernel(LAUNCH_ARGS);
EXPORT CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS);
EXPORT CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice d);
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active);
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d);
EXPORT CUresult cuCtxSynchronize(void);
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags);
EXPORT CUresult cuGetErrorString(CUresult e, const char **s);
EXPORT CUresult cuGetErrorName(CUresult e, const char **s);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
EXPORT unsigned long long fakecuda_used(int dev);
EXPORT unsigned long long fakecuda_calls(const char *name);
EXPORT void fakecuda_reset_counts(void);

#endif
