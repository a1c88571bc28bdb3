/* Interception paths 2 and 3: the dlsym override and cuGetProcAddress(_v2).
 *
 * cuGetProcAddress(_v2): the real driver is asked first, with the caller's name, ABI version
 * and flags, so it alone decides which variant (v1/_v2/_ptsz/...) the caller gets. If the
 * answer is the real address of a function the shim hooks, the caller gets that exact
 * variant's hook (same signature); any other answer (unhooked functions, NULL, errors,
 * statuses) is handed back untouched. The runtime's query for cuGetProcAddress itself thus
 * returns our wrapper, and every later query stays hooked.
 *
 * dlsym: glibc's dlsym is reached with dlvsym. A lookup is redirected only when the name is
 * one the shim exports, the handle is libcuda's / libnvidia-ml's own handle, RTLD_DEFAULT or
 * RTLD_NEXT, the lookup does not come from inside that library (the driver's own lookups
 * stay real), and the answer is that library's real function. */
#include <dlfcn.h>
#include <link.h>
#include <string.h>

#include "hooks.h"
#include "log.h"
#include "state.h"

static void *swap_for_hook(const char *symbol, int cudaVersion, cuuint64_t flags, void *p)
{
    if (p == NULL || ms_disabled())
        return p;
    void *hook = ms_hook_by_real(p);
    if (hook != NULL)
        return hook;
    /* A variant we do not hook (e.g. a v1 name) is an exported symbol; an answer that is no
     * exported symbol at all for a function we hook would bypass the caps: say so. */
    Dl_info info;
    static int warned;
    if (symbol != NULL && ms_is_hooked_base(symbol) && !ms_is_hook(p) &&
        (dladdr(p, &info) == 0 || info.dli_saddr != p) && __atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED) == 0)
        ms_log(MS_LOG_ERROR,
               "cuGetProcAddress(\"%s\", %d, %llu) answered an address that is no exported driver function; "
               "it is passed through and NOT capped",
               symbol, cudaVersion, (unsigned long long)flags);
    return p;
}

CUresult ms_hk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    __typeof(ms_hk_cuGetProcAddress) *real = (__typeof(real))ms_real_fn(MS_ID_cuGetProcAddress);
    if (real == NULL)
        return ms_no_driver("cuGetProcAddress");
    CUresult rc = real(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_for_hook(symbol, cudaVersion, flags, *pfn);
    return rc;
}
MS_EXPORT_AS(cuGetProcAddress)

CUresult ms_hk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *symbolStatus)
{
    __typeof(ms_hk_cuGetProcAddress_v2) *real = (__typeof(real))ms_real_fn(MS_ID_cuGetProcAddress_v2);
    if (real == NULL)
        return ms_no_driver("cuGetProcAddress_v2");
    CUresult rc = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_for_hook(symbol, cudaVersion, flags, *pfn);
    return rc;
}
MS_EXPORT_AS(cuGetProcAddress_v2)

/* RTLD_NEXT relative to the original caller: forwarding RTLD_NEXT from here would mean "next
 * after the shim", which for a library loaded after the shim can be that library's own
 * definition (its wrapper would then call itself forever). Search the objects after the
 * caller's in load order and take the first one that defines the name itself. A link_map of
 * an object loaded at start-up is not a usable dlsym handle, so each is reopened with
 * RTLD_NOLOAD (which only takes and drops a reference). */
static void *next_after(ms_dlsym_fn real, const void *caller, const char *name)
{
    Dl_info info;
    struct link_map *lm = NULL;
    if (dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) == 0 || lm == NULL)
        return real(RTLD_NEXT, name);
    for (struct link_map *m = lm->l_next; m != NULL; m = m->l_next) {
        if (m->l_name == NULL || m->l_name[0] == '\0')
            continue;
        void *h = dlopen(m->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL)
            continue;
        void *p = real(h, name);
        dlclose(h);
        if (p == NULL)
            continue;
        struct link_map *owner = NULL;
        if (dladdr1(p, &info, (void **)&owner, RTLD_DL_LINKMAP) != 0 && owner == m)
            return p;
    }
    return NULL;
}

MS_EXPORT void *dlsym(void *handle, const char *name);

MS_EXPORT void *dlsym(void *handle, const char *name)
{
    ms_dlsym_fn real = ms_real_dlsym();
    if (real == NULL)
        return NULL;
    const void *caller = __builtin_return_address(0);
    void *p = handle == RTLD_NEXT ? next_after(real, caller, name) : real(handle, name);
    if (p == NULL || (name[0] != 'c' && name[0] != 'n'))
        return p;
    ms_lib lib;
    void *hook = ms_hook_by_name(name, &lib);
    if (hook == NULL || p == hook || ms_disabled())
        return p;
    if (handle != RTLD_DEFAULT && handle != RTLD_NEXT && handle != ms_lib_handle(lib, 0))
        return p;
    if (ms_addr_in_lib(lib, caller)) /* the driver looking itself up: never redirected */
        return p;
    return p == ms_real_lookup(lib, name, 0) ? hook : p;
}
