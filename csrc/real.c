/* Real-symbol lookup (see real.h). */
#include "real.h"

#include <dlfcn.h>
#include <link.h>
#include <stddef.h>

static const char *const SONAMES[MS_LIB_COUNT] = {"libcuda.so.1", "libnvidia-ml.so.1"};
static void *g_handle[MS_LIB_COUNT];
static ms_dlsym_fn g_dlsym;

MS_NO_SANITIZE ms_dlsym_fn ms_real_dlsym(void)
{
    ms_dlsym_fn fn = __atomic_load_n(&g_dlsym, __ATOMIC_ACQUIRE);
    if (fn != NULL)
        return fn;
    /* glibc >= 2.34 exports dlsym@@GLIBC_2.34 and keeps the old versions at the same address:
     * GLIBC_2.2.5 on x86-64, GLIBC_2.17 on aarch64. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && fn == NULL; i++)
        fn = (ms_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    __atomic_store_n(&g_dlsym, fn, __ATOMIC_RELEASE);
    return fn;
}

void *ms_lib_handle(ms_lib lib, int load)
{
    void *h = __atomic_load_n(&g_handle[lib], __ATOMIC_ACQUIRE);
    if (h != NULL)
        return h;
    h = dlopen(SONAMES[lib], RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL && load)
        h = dlopen(SONAMES[lib], RTLD_LAZY);
    if (h == NULL)
        return NULL;
    void *expected = NULL;
    if (!__atomic_compare_exchange_n(&g_handle[lib], &expected, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        dlclose(h); /* another thread won; drop the extra reference (same handle) */
    return __atomic_load_n(&g_handle[lib], __ATOMIC_ACQUIRE);
}

void *ms_real_lookup(ms_lib lib, const char *name, int load)
{
    ms_dlsym_fn real_dlsym = ms_real_dlsym();
    if (real_dlsym == NULL)
        return NULL;
    void *h = ms_lib_handle(lib, 0);
    if (h != NULL)
        return real_dlsym(h, name);
    if (!load)
        return NULL;
    /* Not loaded under its soname: a definition later in the search order, else load it. */
    void *p = real_dlsym(RTLD_NEXT, name);
    if (p != NULL)
        return p;
    h = ms_lib_handle(lib, 1);
    return h != NULL ? real_dlsym(h, name) : NULL;
}

int ms_addr_in_lib(ms_lib lib, const void *addr)
{
    void *h = __atomic_load_n(&g_handle[lib], __ATOMIC_ACQUIRE);
    if (h == NULL)
        h = ms_lib_handle(lib, 0);
    if (h == NULL || addr == NULL)
        return 0;
    Dl_info info;
    struct link_map *lm = NULL;
    if (dladdr1(addr, &info, (void **)&lm, RTLD_DL_LINKMAP) == 0 || lm == NULL)
        return 0;
    return (void *)lm == h; /* glibc: a dlopen handle is the object's link_map */
}
