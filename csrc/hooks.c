/* The hook table (see hooks.h): names, hook addresses, lazily resolved real addresses. */
#include "hooks.h"

#include <string.h>

#include "log.h"

typedef struct ms_entry {
    const char *name;
    ms_lib lib;
    void *hook;  /* NULL: real-only */
    int missing; /* 1 once a lookup with the library loaded found nothing */
} ms_entry;

void *ms_real_resolved[MS_HOOK_COUNT]; /* resolved lazily; atomic (hooks.h) */

#define MS_H_(name, lib) [MS_ID_##name] = {#name, lib, (void *)ms_hk_##name, 0},
#define MS_R_(name, lib) [MS_ID_##name] = {#name, lib, NULL, 0},
static ms_entry g_table[MS_HOOK_COUNT] = {MS_HOOK_LIST(MS_H_, MS_R_)};
#undef MS_H_
#undef MS_R_

static void *resolve(enum ms_hook_id id, int load)
{
    ms_entry *e = &g_table[id];
    void *p = __atomic_load_n(&ms_real_resolved[id], __ATOMIC_ACQUIRE);
    if (p != NULL || __atomic_load_n(&e->missing, __ATOMIC_RELAXED))
        return p;
    p = ms_real_lookup(e->lib, e->name, load);
    if (p == e->hook) /* never call ourselves (a lookup that fell through to our export) */
        p = NULL;
    if (p != NULL)
        __atomic_store_n(&ms_real_resolved[id], p, __ATOMIC_RELEASE);
    else if (ms_lib_handle(e->lib, 0) != NULL)
        __atomic_store_n(&e->missing, 1, __ATOMIC_RELAXED); /* the loaded library lacks it */
    return p;
}

void *ms_real_fn(enum ms_hook_id id) { return resolve(id, 1); }

void *ms_real_fn_loaded(enum ms_hook_id id) { return resolve(id, 0); }

void *ms_hook_by_name(const char *name, ms_lib *lib)
{
    for (int i = 0; i < MS_HOOK_COUNT; i++)
        if (g_table[i].hook != NULL && strcmp(g_table[i].name, name) == 0) {
            if (lib != NULL)
                *lib = g_table[i].lib;
            return g_table[i].hook;
        }
    return NULL;
}

void *ms_hook_by_real(const void *p, ms_lib lib)
{
    if (p == NULL)
        return NULL;
    for (int i = 0; i < MS_HOOK_COUNT; i++)
        if (g_table[i].hook != NULL && g_table[i].lib == lib && resolve((enum ms_hook_id)i, 0) == p)
            return g_table[i].hook;
    return NULL;
}

int ms_is_hook(const void *p)
{
    for (int i = 0; i < MS_HOOK_COUNT; i++)
        if (g_table[i].hook != NULL && g_table[i].hook == p)
            return 1;
    return 0;
}

void *ms_hook_of(enum ms_hook_id id) { return g_table[id].hook; }

CUresult ms_no_driver(const char *name)
{
    static int once;
    if (__atomic_exchange_n(&once, 1, __ATOMIC_RELAXED) == 0)
        ms_log(MS_LOG_ERROR, "%s: cannot find the CUDA driver (libcuda.so.1) to forward to", name);
    return CUDA_ERROR_NOT_FOUND;
}
