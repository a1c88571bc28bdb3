/* Charging an allocation against its device's cap, shared by the allocation hooks (hooks_mem.c,
 * hooks_vmm.c); defined in charge.c, with the one-device fast path inline here so that an
 * allocation or a free through a hook makes no call but the driver's. */
#ifndef MPSSHIM_CHARGE_H
#define MPSSHIM_CHARGE_H

#include <stdint.h>

#include "cuda_types.h"
#include "region_fast.h"
#include "track_fast.h"

#define MS_CHARGE_HIDDEN __attribute__((visibility("hidden")))

typedef struct ms_charge {
    int charged; /* 0: nothing was charged (uncapped, disabled): nothing to remember */
    int dev;
    uint64_t cap;
    uint64_t bytes;
} ms_charge;

/* How to give an allocation back when it cannot be remembered. */
typedef enum ms_undo_kind { MS_UNDO_FREE_V2, MS_UNDO_FREE_V1, MS_UNDO_RELEASE } ms_undo_kind;

/* What the hot path needs of the configuration, which is read once (state.h) and then fixed. */
enum { MS_HOT_UNKNOWN = 0, MS_HOT_PASS, MS_HOT_BAD, MS_HOT_CAPPED };
extern int ms_hot MS_CHARGE_HIDDEN;                 /* MS_HOT_*, once known */
extern ms_region *ms_hot_region MS_CHARGE_HIDDEN;   /* the state's region once ms_hot is known */
/* The one-device fast path: set once an allocation found that this process sees one device
 * (device 0), that it is capped and that the region is open. All of that is fixed from then on
 * (cuInit has succeeded, the configuration is read once), so later allocations charge device 0
 * against ms_fast_cap in ms_fast_region without asking anything else. */
extern ms_region *ms_fast_region MS_CHARGE_HIDDEN;
extern uint64_t ms_fast_cap MS_CHARGE_HIDDEN;
int ms_hot_mode_slow(void);

static inline int ms_hot_mode(void) {
    int m = __atomic_load_n(&ms_hot, __ATOMIC_ACQUIRE);
    return m != MS_HOT_UNKNOWN ? m : ms_hot_mode_slow();
}

/* 1 when allocations are being charged and remembered (caps set, not disabled). */
static inline int ms_tracking(void) {
    int m = __atomic_load_n(&ms_hot, __ATOMIC_ACQUIRE);
    if (__builtin_expect(m == MS_HOT_CAPPED, 1)) return 1;
    return m == MS_HOT_UNKNOWN && ms_hot_mode_slow() == MS_HOT_CAPPED;
}

/* Decide whether `bytes` may be allocated on `dev` (or, dev < 0, the current context's
 * device) and charge them. CUDA_SUCCESS (c->charged says if anything was charged), or the
 * error to return without calling the driver. */
CUresult ms_charge_begin(const char *fn, int dev, uint64_t bytes, ms_charge *c);
/* After the driver answered `rc`: roll back on failure, remember (kind, key) on success. */
CUresult ms_charge_end(const char *fn, ms_charge *c, CUresult rc, int kind, uint64_t key, ms_undo_kind undo);
/* Give back bytes charged on dev by this process. */
void ms_uncharge(int dev, uint64_t bytes);
/* A refusal by the region (MS_OVER_CAP or MS_ERROR from a charge): one rate-limited line, and
 * the error to return. */
CUresult ms_charge_refused(const char *fn, int dev, uint64_t cap, uint64_t in_use, uint64_t bytes, int r);
/* Give an allocation the driver made back to it (it could not be remembered, or went past the cap). */
void ms_undo_alloc(ms_undo_kind kind, uint64_t key);
/* The tracker had no memory for an allocation: undone, uncharged, refused (one line). */
CUresult ms_charge_unremembered(const char *fn, const ms_charge *c, uint64_t key, ms_undo_kind undo);

/* ms_charge_begin(fn, -1, bytes, c): inline on the one-device fast path. */
static inline __attribute__((always_inline)) CUresult ms_charge_current(const char *fn, uint64_t bytes, ms_charge *c) {
    ms_region *r = __atomic_load_n(&ms_fast_region, __ATOMIC_ACQUIRE);
    if (__builtin_expect(r == NULL, 0)) return ms_charge_begin(fn, -1, bytes, c);
    uint64_t in_use, cap = ms_fast_cap; /* set by every MS_OVER_CAP, the one refusal that reports it */
    int rc = ms_charge_inl(r, 0, cap, bytes, &in_use);
    if (__builtin_expect(rc != MS_OK, 0)) {
        c->charged = 0;
        return ms_charge_refused(fn, 0, cap, in_use, bytes, rc);
    }
    c->charged = 1;
    c->dev = 0;
    c->cap = cap;
    c->bytes = bytes;
    return CUDA_SUCCESS;
}

/* ms_uncharge of what a tracked allocation was charged (its device was checked by the charge). */
static inline __attribute__((always_inline)) void ms_uncharge_fast(int dev, uint64_t bytes) {
    ms_region *r = __atomic_load_n(&ms_hot_region, __ATOMIC_RELAXED);
    if (__builtin_expect(r != NULL, 1)) ms_uncharge_inl(r, dev, bytes);
    else ms_uncharge(dev, bytes);
}

/* ms_charge_end for a device pointer. */
static inline __attribute__((always_inline)) CUresult ms_charge_end_ptr(const char *fn, ms_charge *c, CUresult rc,
                                                                        uint64_t key, ms_undo_kind undo) {
    if (!c->charged) return rc;
    if (__builtin_expect(rc != CUDA_SUCCESS, 0)) {
        ms_uncharge_fast(c->dev, c->bytes);
        return rc;
    }
    if (__builtin_expect(ms_track_add_ptr_fast(key, c->dev, c->bytes) != 0, 0))
        return ms_charge_unremembered(fn, c, key, undo);
    return CUDA_SUCCESS;
}

/* A free of a device pointer around the driver's: the allocation stays in the table, marked as
 * being freed, while the driver frees it, so that a racing allocation that gets the same address
 * cannot be forgotten instead, and a second free of the same pointer racing with this one joins
 * it: exactly one of them uncharges (track.h). */
typedef struct ms_freeing {
    int known;       /* the pointer is tracked: its free is marked */
    ms_pslot *first; /* marked in its first slot with `word` (the common case), else NULL */
    uint64_t word;
    uint64_t ticket; /* otherwise */
} ms_freeing;

static inline __attribute__((always_inline)) void ms_free_ptr_begin(uint64_t key, ms_freeing *f) {
    f->known = ms_tracking();
    if (!f->known) return;
    f->first = ms_ptr_mark_first(key, &f->word);
    if (__builtin_expect(f->first == NULL, 0)) f->known = ms_track_free_begin(MS_TRACK_PTR, key, &f->ticket);
}

static inline __attribute__((always_inline)) CUresult ms_free_ptr_end(const ms_freeing *f, CUresult rc, uint64_t key) {
    if (!f->known) return rc;
    if (__builtin_expect(f->first != NULL && rc == CUDA_SUCCESS, 1)) {
        int d;
        uint64_t b;
        if (__builtin_expect(ms_ptr_unmark_freed(f->first, f->word, &d, &b), 1)) {
            ms_uncharge_fast(d, b);
            return rc;
        }
    }
    int dev;
    uint64_t bytes;
    uint64_t ticket = f->first != NULL ? ms_ptr_ticket(f->first, f->word) : f->ticket;
    if (ms_track_free_end(MS_TRACK_PTR, key, ticket, rc == CUDA_SUCCESS, &dev, &bytes)) ms_uncharge(dev, bytes);
    return rc;
}

#endif
