/* Interception paths 2 and 3: the dlsym override and cuGetProcAddress(_v2).
 *
 * cuGetProcAddress(_v2): the real driver is asked first, with the caller's name, ABI version
 * and flags, so it alone decides which variant (v1/_v2/_ptsz/...) the caller gets. If the
 * answer is the real address of a function the shim hooks, the caller gets that exact
 * variant's hook (same signature); a driver that answers with internal addresses is handled
 * by prediction plus a check (swap_for_hook); any other answer (unhooked functions, NULL,
 * errors, statuses) is handed back untouched. The runtime's query for cuGetProcAddress
 * itself thus returns our wrapper, and every later query stays hooked.
 *
 * dlsym: glibc's dlsym is reached with dlvsym. A lookup is redirected only when the name is
 * one the shim exports, the handle is libcuda's / libnvidia-ml's own handle or RTLD_DEFAULT,
 * the lookup does not come from inside that library (the driver's own lookups stay real),
 * and the answer is that library's real function. RTLD_NEXT goes to glibc untouched (below). */
#include <dlfcn.h>
#include <string.h>

#include "hooks.h"
#include "log.h"
#include "state.h"

/* Every variant the driver has of the functions the shim hooks: (base name, ABI version it
 * appeared in, per-thread-stream flavour, hook id or -1 when that variant is not hooked). */
typedef struct variant {
    const char *base;
    int version;
    int ptsz;
    int id;
} variant;

static const variant VARIANTS[] = {
    {"cuInit", 2000, 0, MS_ID_cuInit},
    {"cuGetProcAddress", 11030, 0, MS_ID_cuGetProcAddress},
    {"cuGetProcAddress", 12000, 0, MS_ID_cuGetProcAddress_v2},
    {"cuMemAlloc", 2000, 0, MS_ID_cuMemAlloc},
    {"cuMemAlloc", 3020, 0, MS_ID_cuMemAlloc_v2},
    {"cuMemFree", 2000, 0, MS_ID_cuMemFree},
    {"cuMemFree", 3020, 0, MS_ID_cuMemFree_v2},
    {"cuMemGetInfo", 2000, 0, MS_ID_cuMemGetInfo},
    {"cuMemGetInfo", 3020, 0, MS_ID_cuMemGetInfo_v2},
    {"cuDeviceTotalMem", 2000, 0, MS_ID_cuDeviceTotalMem},
    {"cuDeviceTotalMem", 3020, 0, MS_ID_cuDeviceTotalMem_v2},
    {"cuMemAllocPitch", 2000, 0, -1}, /* 32-bit ABI, not hooked: passes through */
    {"cuMemAllocPitch", 3020, 0, MS_ID_cuMemAllocPitch_v2},
    {"cuMemAllocManaged", 6000, 0, MS_ID_cuMemAllocManaged},
    {"cuMemAllocAsync", 11020, 0, MS_ID_cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, MS_ID_cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, 0, MS_ID_cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, 1, MS_ID_cuMemAllocFromPoolAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, MS_ID_cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, MS_ID_cuMemFreeAsync_ptsz},
    {"cuMemCreate", 10020, 0, MS_ID_cuMemCreate},
    {"cuMemRelease", 10020, 0, MS_ID_cuMemRelease},
    {"cuMemMap", 10020, 0, MS_ID_cuMemMap},
    {"cuMemUnmap", 10020, 0, MS_ID_cuMemUnmap},
    {"cuMemRetainAllocationHandle", 11000, 0, MS_ID_cuMemRetainAllocationHandle},
};

/* The variants the driver's rule can pick for `version`: the newest legacy-stream one and
 * the newest per-thread-stream one that appeared at or before it (NULL where none). Returns
 * whether the base is one of the table's at all. */
static int candidates(const char *symbol, int version, const variant **legacy, const variant **ptsz)
{
    int known = 0;
    *legacy = *ptsz = NULL;
    for (size_t i = 0; i < sizeof VARIANTS / sizeof VARIANTS[0]; i++) {
        const variant *v = &VARIANTS[i];
        if (strcmp(v->base, symbol) != 0)
            continue;
        known = 1;
        if (v->version > version)
            continue;
        const variant **slot = v->ptsz ? ptsz : legacy;
        if (*slot == NULL || v->version > (*slot)->version)
            *slot = v;
    }
    return known;
}

/* Ask the real driver again, at another ABI version (same entry point as the caller used). */
typedef void *(*requery_fn)(const char *symbol, int version, cuuint64_t flags);

static void *requery_v1(const char *symbol, int version, cuuint64_t flags)
{
    __typeof(ms_hk_cuGetProcAddress) *real = MS_REAL(cuGetProcAddress);
    void *p = NULL;
    return real != NULL && real(symbol, &p, version, flags) == CUDA_SUCCESS ? p : NULL;
}

static void *requery_v2(const char *symbol, int version, cuuint64_t flags)
{
    __typeof(ms_hk_cuGetProcAddress_v2) *real = MS_REAL(cuGetProcAddress_v2);
    void *p = NULL;
    CUdriverProcAddressQueryResult status = 0;
    return real != NULL && real(symbol, &p, version, flags, &status) == CUDA_SUCCESS ? p : NULL;
}

/* What the caller gets for the driver's answer `p`.
 *  1. p is the real exported function of a hooked variant: that variant's hook.
 *  2. Otherwise, for a base name we hook, the driver may answer with an internal address.
 *     The candidates (newest legacy-stream and per-thread-stream variants for `version`) are
 *     checked by asking the driver again at the version each appeared in, with its stream
 *     flag explicit: the one the driver answers with the very same address is the variant
 *     the caller got (no newer variant unknown to the table was chosen), and its hook is
 *     handed out.
 *  3. Anything else is handed back untouched; for a hooked base that means uncapped, which
 *     is said once on stderr. */
static void *swap_for_hook(const char *symbol, int version, cuuint64_t flags, void *p, requery_fn requery)
{
    if (p == NULL || symbol == NULL || ms_disabled())
        return p;
    void *hook = ms_hook_by_real(p, MS_LIB_CUDA);
    if (hook != NULL || ms_is_hook(p))
        return hook != NULL ? hook : p;
    const variant *legacy, *ptsz;
    if (!candidates(symbol, version, &legacy, &ptsz))
        return p;
    int ptsz_first = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const variant *order[2] = {ptsz_first ? ptsz : legacy, ptsz_first ? legacy : ptsz};
    for (int i = 0; i < 2; i++) {
        const variant *v = order[i];
        if (v == NULL || requery(symbol, v->version, v->ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                                             : CU_GET_PROC_ADDRESS_LEGACY_STREAM) != p)
            continue;
        if (v->id < 0)
            return p; /* an unhooked variant, e.g. the 32-bit cuMemAllocPitch */
        if (ms_real_fn_loaded((enum ms_hook_id)v->id) != NULL)
            return ms_hook_of((enum ms_hook_id)v->id);
    }
    static int warned;
    if (__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED) == 0)
        ms_log(MS_LOG_ERROR,
               "cuGetProcAddress(\"%s\", %d, %llu) answered a variant the shim does not know; it is passed "
               "through and NOT capped",
               symbol, version, (unsigned long long)flags);
    return p;
}

CUresult ms_hk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    __typeof(ms_hk_cuGetProcAddress) *real = MS_REAL(cuGetProcAddress);
    if (real == NULL)
        return ms_no_driver("cuGetProcAddress");
    CUresult rc = real(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_for_hook(symbol, cudaVersion, flags, *pfn, requery_v1);
    return rc;
}
MS_EXPORT_AS(cuGetProcAddress)

CUresult ms_hk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *symbolStatus)
{
    __typeof(ms_hk_cuGetProcAddress_v2) *real = MS_REAL(cuGetProcAddress_v2);
    if (real == NULL)
        return ms_no_driver("cuGetProcAddress_v2");
    CUresult rc = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_for_hook(symbol, cudaVersion, flags, *pfn, requery_v2);
    return rc;
}
MS_EXPORT_AS(cuGetProcAddress_v2)

/* dlsym itself is a few instructions of assembly so that RTLD_NEXT lookups reach glibc's
 * dlsym by a tail jump: glibc resolves RTLD_NEXT relative to its return address, which then
 * is still the original caller's. Forwarding RTLD_NEXT from C would mean "next after the
 * shim": a library loaded after the shim would get its own definition back and recurse
 * forever. The jump also keeps the shim's code out of the way of sanitizer runtimes, which
 * look up RTLD_NEXT symbols before they are initialised. Every other lookup goes to
 * ms_dlsym_impl (also by a tail jump, so its return address is the caller's too).
 * RTLD_NEXT lookups are never redirected: a caller before the shim gets the shim's hook from
 * glibc anyway, a caller after it (another interposer) asks for the real function. */
MS_HIDDEN MS_NO_SANITIZE void *ms_dlsym_impl(void *handle, const char *name);

/* Until the name is known to be "cu..." or "nvml..." nothing but glibc's dlsym is called. */
MS_HIDDEN MS_NO_SANITIZE void *ms_dlsym_impl(void *handle, const char *name)
{
    ms_dlsym_fn real = ms_real_dlsym();
    if (real == NULL)
        return NULL;
    const void *caller = __builtin_return_address(0);
    void *p = real(handle, name);
    int cu = name[0] == 'c' && name[1] == 'u';
    int nvml = name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l';
    if (p == NULL || !(cu || nvml))
        return p;
    ms_lib lib;
    void *hook = ms_hook_by_name(name, &lib);
    if (hook == NULL || p == hook || ms_disabled())
        return p;
    if (handle != RTLD_DEFAULT && handle != ms_lib_handle(lib, 0))
        return p;
    if (ms_addr_in_lib(lib, caller)) /* the driver looking itself up: never redirected */
        return p;
    return p == ms_real_lookup(lib, name, 0) ? hook : p;
}

/* MS_HIDDEN functions called from the assembly below. */
MS_HIDDEN MS_NO_SANITIZE ms_dlsym_fn ms_real_dlsym_for_asm(void);
MS_HIDDEN MS_NO_SANITIZE ms_dlsym_fn ms_real_dlsym_for_asm(void) { return ms_real_dlsym(); }

#if defined(__x86_64__)
#if defined(__CET__)
#define MS_LANDING_PAD "    endbr64\n"
#else
#define MS_LANDING_PAD ""
#endif
__asm__(".pushsection .text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n" MS_LANDING_PAD
        "    cmpq $-1, %rdi\n" /* RTLD_NEXT */
        "    je 1f\n"
        "    jmp ms_dlsym_impl\n"
        "1:  pushq %rdi\n"
        "    pushq %rsi\n"
        "    subq $8, %rsp\n" /* 16-byte alignment for the call */
        "    call ms_real_dlsym_for_asm\n"
        "    addq $8, %rsp\n"
        "    popq %rsi\n"
        "    popq %rdi\n"
        "    testq %rax, %rax\n"
        "    je 2f\n"
        "    jmp *%rax\n"
        "2:  ret\n" /* no glibc dlsym: NULL */
        ".size dlsym, .-dlsym\n"
        ".popsection\n");
#elif defined(__aarch64__)
#if defined(__ARM_FEATURE_BTI_DEFAULT)
#define MS_LANDING_PAD "    bti c\n"
#else
#define MS_LANDING_PAD ""
#endif
__asm__(".pushsection .text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        "dlsym:\n" MS_LANDING_PAD
        "    cmn x0, #1\n" /* RTLD_NEXT */
        "    b.eq 1f\n"
        "    b ms_dlsym_impl\n"
        "1:  stp x29, x30, [sp, #-32]!\n"
        "    mov x29, sp\n"
        "    stp x0, x1, [sp, #16]\n"
        "    bl ms_real_dlsym_for_asm\n"
        "    mov x16, x0\n"
        "    ldp x0, x1, [sp, #16]\n"
        "    ldp x29, x30, [sp], #32\n"
        "    cbz x16, 2f\n"
        "    br x16\n"
        "2:  mov x0, #0\n"
        "    ret\n"
        ".size dlsym, .-dlsym\n"
        ".popsection\n");
#else
#error "libmpsshim's dlsym override needs a tail-jump stub for this architecture (x86-64 and aarch64 exist)"
#endif
