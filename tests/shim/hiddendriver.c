/* A stand-in libcuda.so.1 whose cuGetProcAddress(_v2) answers with internal addresses, not
 * with its exported functions: the shim must still hand out its hooks (by predicting the
 * variant and checking the prediction with the driver). It pretends that cuMemAlloc has a
 * _v3 from ABI 12000 on, which the shim does not know: that one must pass through, loudly.
 * Built with -O0 so the internal functions keep distinct addresses. One device, 16 GiB. */
#define _GNU_SOURCE
#include <stddef.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static unsigned long long used, calls;

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

static int internal_init(unsigned int flags) { return flags == 0 ? 0 : 1; }
static int internal_alloc_v2(unsigned long long *p, size_t n) { return alloc_impl(p, n); }
static int internal_alloc_v3(unsigned long long *p, size_t n) { return alloc_impl(p, n) + 0; }

static int lookup(const char *symbol, void **pfn, int version, int *status);

static int internal_gpa2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    (void)flags;
    return lookup(symbol, pfn, version, status);
}

static int lookup(const char *symbol, void **pfn, int version, int *status)
{
    void *p = NULL;
    if (strcmp(symbol, "cuGetProcAddress") == 0 && version >= 12000)
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
