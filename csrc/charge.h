/* Charging an allocation against its device's cap, shared by the allocation hooks
 * (hooks_mem.c, where these are defined, and hooks_vmm.c). */
#ifndef MPSSHIM_CHARGE_H
#define MPSSHIM_CHARGE_H

#include <stdint.h>

#include "cuda_types.h"

typedef struct ms_charge {
    int charged; /* 0: nothing was charged (uncapped, disabled): nothing to remember */
    int dev;
    uint64_t cap;
    uint64_t bytes;
} ms_charge;

/* How to give an allocation back when it cannot be remembered. */
typedef enum ms_undo_kind { MS_UNDO_FREE_V2, MS_UNDO_FREE_V1, MS_UNDO_RELEASE } ms_undo_kind;

/* 1 when allocations are being charged and remembered (caps set, not disabled). */
int ms_tracking(void);

/* Decide whether `bytes` may be allocated on `dev` (or, dev < 0, the current context's
 * device) and charge them. CUDA_SUCCESS (c->charged says if anything was charged), or the
 * error to return without calling the driver. */
CUresult ms_charge_begin(const char *fn, int dev, uint64_t bytes, ms_charge *c);
/* After the driver answered `rc`: roll back on failure, remember (kind, key) on success. */
CUresult ms_charge_end(const char *fn, ms_charge *c, CUresult rc, int kind, uint64_t key, ms_undo_kind undo);
/* Give back bytes charged on dev by this process. */
void ms_uncharge(int dev, uint64_t bytes);

#endif
