/* A fake libcuda.so.1 for tests: host bookkeeping only, no GPU. This file: configuration,
 * devices, contexts and the call counters; fake_cuda_mem.c: memory and streams;
 * fake_cuda_lookup.c: error strings and cuGetProcAddress; fake_cuda.h: what they share.
 *
 * Configuration (environment, read once at the first cuInit):
 *   FAKE_CUDA_DEVICES  total memory per device, comma-separated sizes with optional K/M/G/T
 *                      suffix (powers of 1024, optional B): "16G,8G" = two devices. Default
 *                      "16G". A malformed value makes cuInit fail with CUDA_ERROR_INVALID_VALUE
 *                      and one line on stderr. "" or "0" devices: cuInit -> CUDA_ERROR_NO_DEVICE.
 *   FAKE_CUDA_LOG=1    print each call to stderr.
 *   FAKE_CUDA_VMM_YIELD=N  cuMemRelease/Map/Unmap/RetainAllocationHandle yield the CPU 0 to 2N times
 *                      before acting (read at their first call), so that racing threads meet.
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
 *   - a cuMemCreate handle's memory lives while the handle has a reference (cuMemCreate and each
 *     cuMemRetainAllocationHandle give one, each cuMemRelease takes one) or a mapping (cuMemMap,
 *     cuMemUnmap of whole mappings); a handle with no reference left is refused by cuMemRelease
 *     and cuMemMap (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_HANDLE);
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
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

/* ---- call counting: one counter per exported function --------------------------------- */
const char *const fc_fn_names[F_COUNT] = {
#define X(n) #n,
    FAKE_CUDA_FUNCS(X)
#undef X
};
unsigned long long fc_calls[F_COUNT];
int fc_log_calls;

__attribute__((constructor)) static void fake_load(void) {
    const char *v = getenv("FAKE_CUDA_LOG");
    fc_log_calls = v && strcmp(v, "1") == 0;
}

/* ---- devices ------------------------------------------------------------------------- */
int fc_ndev;
unsigned long long fc_total_mem[MAX_DEVICES];
struct fake_ctx fc_contexts[MAX_DEVICES];
struct fake_pool fc_default_pools[MAX_DEVICES];
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
int fc_initialised;
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
        if (bytes > 0) fc_total_mem[n++] = bytes;
        p += len;
        if (*p == ',') p++;
    }
    for (int i = 0; i < n; i++) {
        fc_contexts[i] = (struct fake_ctx){CTX_MAGIC, i};
        fc_default_pools[i] = (struct fake_pool){POOL_MAGIC, i};
    }
    fc_ndev = n;
    init_result = n ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    __atomic_store_n(&fc_initialised, n > 0, __ATOMIC_RELEASE);
}

/* ---- thread-local context stack -------------------------------------------------------- */
#define CTX_STACK 16
static __thread CUcontext ctx_stack[CTX_STACK];
static __thread int ctx_depth;

CUcontext fc_current_ctx(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }
static int valid_ctx(CUcontext c) { return c && c >= fc_contexts && c < fc_contexts + fc_ndev && c->magic == CTX_MAGIC; }

CUresult fc_current_dev(int *dev) {
    CUcontext c = fc_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = c->dev;
    return CUDA_SUCCESS;
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
    *n = fc_ndev;
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
    *bytes = fc_total_mem[d];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d) {
    ENTER(cuDeviceTotalMem); NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = clamp32(fc_total_mem[d]);
    return CUDA_SUCCESS;
}

/* ---- contexts ------------------------------------------------------------------------ */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) {
    ENTER(cuDevicePrimaryCtxRetain); NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!VALID_DEV(d)) return CUDA_ERROR_INVALID_DEVICE;
    *pctx = &fc_contexts[d];
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
    *pctx = &fc_contexts[d];
    ctx_stack[ctx_depth++] = *pctx;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext c) {
    ENTER(cuCtxDestroy_v2); NEED_INIT();
    if (!valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (fc_current_ctx() == c) ctx_depth--;
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
    *pctx = fc_current_ctx();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    ENTER(cuCtxGetDevice); NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return fc_current_dev(d);
}

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
    return fc_current_ctx() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
/* IPC is not faked: numba only needs the symbol to exist. */
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
    ENTER(cuIpcOpenMemHandle_v2); NEED_INIT();
    (void)dptr, (void)h, (void)flags;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ---- test probes ---------------------------------------------------------------------- */
EXPORT unsigned long long fakecuda_calls(const char *name) {
    for (int i = 0; name && i < F_COUNT; i++)
        if (strcmp(fc_fn_names[i], name) == 0) return __atomic_load_n(&fc_calls[i], __ATOMIC_RELAXED);
    return 0;
}
EXPORT void fakecuda_reset_counts(void) {
    for (int i = 0; i < F_COUNT; i++) __atomic_store_n(&fc_calls[i], 0, __ATOMIC_RELAXED);
}
