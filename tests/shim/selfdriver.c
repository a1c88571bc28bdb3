/* A stand-in libcuda.so.1 that looks itself up by handle, as NVIDIA's driver does on some
 * platforms: the shim must leave the driver's own lookups alone (dlsym from inside libcuda).
 * Built with -Bsymbolic-functions, so cuInit below is this library's own function. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

__attribute__((visibility("default"))) int cuInit(unsigned int flags);
__attribute__((visibility("default"))) int cuInit(unsigned int flags) { return (int)flags; }

/* 1 if dlsym on this library's own handle gives its own cuInit. */
__attribute__((visibility("default"))) int selfdriver_lookup_is_own(void);
__attribute__((visibility("default"))) int selfdriver_lookup_is_own(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    return h != NULL && dlsym(h, "cuInit") == (void *)cuInit;
}
