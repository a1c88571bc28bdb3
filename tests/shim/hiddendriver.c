/* A stand-in libcuda.so.1 whose cuGetProcAddress(_v2) answers with internal addresses, not
 * with its exported functions: the shim must still hand out its hooks (by predicting the
 * variant and checking the prediction with the driver). It pretends that cuMemAlloc has a
 * _v3 from ABI 12000 on, which the shim does not know: that one must pass through, loudly.
 * cuMemAllocAsync has a legacy and a per-thread-stream variant, counted apart, so a test can
 * tell which flavour the shim's hook forwarded to. With HIDDEN_DEFAULT_PER_THREAD=1 in the
 * environment, flags 0 (CU_GET_PROC_ADDRESS_DEFAULT) mean the per-thread stream, as for a
 * program built with --default-stream per-thread.
 * Built with -O0 so the internal functions keep distinct addresses. One device, 16 GiB. */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static unsigned long long used, calls, calls_ptsz;

static int alloc_impl(unsigned long long *p, size_t n)
{
    calls++;
    if (used + n > (16ULL << 30))
        return 2;
    used += n;
    *p = 0x100000ULL + used;
    return 0;
}

EXPORT int cuInit(unsigned int flags);
EXPORT int cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; }
EXPORT int cuCtxGetDevice(int *dev);
EXPORT int cuCtxGetDevice(int *dev) { *dev = 0; return 0; }
EXPORT int cuMemAlloc_v2(unsigned long long *p, size_t n);
EXPORT int cuMemAlloc_v2(unsigned long long *p, size_t n) { return alloc_impl(p, n); }

EXPORT int cuMemAllocAsync(unsigned long long *p, size_t n, void *stream);
EXPORT int cuMemAllocAsync(unsigned long long *p, size_t n, void *stream) { (void)stream; return alloc_impl(p, n); }
EXPORT int cuMemAllocAsync_ptsz(unsigned long long *p, size_t n, void *stream);
EXPORT int cuMemAllocAsync_ptsz(unsigned long long *p, size_t n, void *stream)
{
    (void)stream;
    calls_ptsz++;
    return alloc_impl(p, n);
}
static int internal_async(unsigned long long *p, size_t n, void *s) { return cuMemAllocAsync(p, n, s); }
static int internal_async_ptsz(unsigned long long *p, size_t n, void *s) { return cuMemAllocAsync_ptsz(p, n, s); }

static int internal_init(unsigned int flags) { return flags == 0 ? 0 : 1; }
static int internal_alloc_v2(unsigned long long *p, size_t n) { return alloc_impl(p, n); }
static int internal_alloc_v3(unsigned long long *p, size_t n) { return alloc_impl(p, n) + 0; }

static int lookup(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);

static int internal_gpa2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    return lookup(symbol, pfn, version, flags, status);
}

static int lookup(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    void *p = NULL;
    if (strcmp(symbol, "cuMemAllocAsync") == 0 && version >= 11020)
        p = (flags & 2) || (flags == 0 && getenv("HIDDEN_DEFAULT_PER_THREAD") != NULL) ? (void *)internal_async_ptsz
                                                                                     : (void *)internal_async;
    else if (strcmp(symbol, "cuGetProcAddress") == 0 && version >= 12000)
        p = (void *)internal_gpa2;
    else if (strcmp(symbol, "cuInit") == 0)
        p = (void *)internal_init;
    else if (strcmp(symbol, "cuMemAlloc") == 0 && version >= 12000)
        p = (void *)internal_alloc_v3;
    else if (strcmp(symbol, "cuMemAlloc") == 0 && version >= 3020)
        p = (void *)internal_alloc_v2;
    *pfn = p;
    if (status != NULL)
        *status = p != NULL ? 0 : 1;
    return 0;
}

EXPORT int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
EXPORT int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    return internal_gpa2(symbol, pfn, version, flags, status);
}

EXPORT unsigned long long hidden_calls(void);
EXPORT unsigned long long hidden_calls(void) { return calls; }
EXPORT unsigned long long hidden_calls_ptsz(void);
EXPORT unsigned long long hidden_calls_ptsz(void) { return calls_ptsz; }
