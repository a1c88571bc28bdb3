/* The region core's charge and give-back, inline: the allocation hooks (hooks_mem.c) reach them
 * without a call, and region_charge.c's ms_region_charge/ms_region_uncharge are these too
 * (contract in region.h, protocol and crash-consistency argument in region_ops.h). The rare
 * parts are calls out of line (region_charge.c): a thread's first charge on a handle, a forked
 * child's first use of an inherited one, threads beyond the lanes, reclaiming dead processes
 * before refusing. Nothing here checks more than it must per call: the file's layout and totals
 * are checked when it is opened (ms_check_totals), the magic word (ms_intact, one load) before
 * and after each operation. */
#ifndef MPSSHIM_REGION_FAST_H
#define MPSSHIM_REGION_FAST_H

#include "region_impl.h"

#define MS_SHARED_LANE (MS_LANES - 1)

/* The calling thread's lane: the handle it belongs to (0: none), and, cached so the fast path
 * computes nothing, the lane's address and the low bits of its tags (slot << 4 | lane). An id
 * matching the handle's proves the slot is this process's: a forked child's handles get new ids
 * (region_handles.c) and a thread adopts a lane only after binding the handle. Initial-exec
 * TLS: one %fs-relative load instead of a call to __tls_get_addr. */
typedef struct ms_tl {
    unsigned long id;
    ms_lane *L;
    uint64_t me;
} ms_tl;
extern __thread ms_tl ms_mine __attribute__((tls_model("initial-exec"), visibility("hidden")));

/* Out of line (region_charge.c): the lane of a thread the handle has not seen (binding a forked
 * child's handle first; taking the shared lane's mutex for threads beyond the lanes), or NULL
 * if the child's handle cannot be bound. */
ms_lane *ms_enter_slow(ms_region *r, uint64_t *me) __attribute__((visibility("hidden")));
void ms_leave_shared(ms_region *r) __attribute__((visibility("hidden")));

static inline ms_lane *ms_enter(ms_region *r, uint64_t *me) {
    if (__builtin_expect(ms_mine.id == __atomic_load_n(&r->id, __ATOMIC_RELAXED), 1)) {
        *me = ms_mine.me;
        return ms_mine.L;
    }
    return ms_enter_slow(r, me);
}

static inline void ms_leave(ms_region *r, uint64_t me) {
    if (__builtin_expect((me & 15) == MS_SHARED_LANE, 0)) ms_leave_shared(r);
}

/* Before overwriting `tag`: record that its operation reached the total, unless it is our own
 * lane's (see ms_help in region_ops.h; `me` = slot << 4 | lane). */
static inline void ms_help_me(ms_hdr *h, uint64_t tag, uint64_t me) {
    if (tag == 0 || (tag & 0xfff) == me) return;
    uint64_t *hp = &h->slot[(tag >> 4) & 255].lane[tag & 15].hseq, seq = tag >> 12;
    uint64_t hs = __atomic_load_n(hp, __ATOMIC_RELAXED);
    while (hs < seq && !__atomic_compare_exchange_n(hp, &hs, seq, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
}

static inline __attribute__((always_inline)) int ms_charge_inl(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    uint64_t me;
    ms_lane *L = ms_enter(r, &me);
    if (L == NULL) return MS_ERROR;
    ms_hdr *h = r->hdr;
    if (!ms_intact(h)) { /* shrunk (region_guard.c) or zeroed under us */
        ms_leave(r, me);
        return MS_ERROR;
    }
    if (ms_ld(&h->cap[dev]) != cap) ms_st(&h->cap[dev], cap);
    ms_word *w = &h->used[dev];
    uint64_t seq = 0, val;
    int reclaimed = 0;
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE);
        val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        if (__builtin_expect(bytes > cap || val > cap - bytes, 0)) {
            if (seq) __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE), seq = 0; /* announced, never applied */
            if (!reclaimed++ && ms_reclaim(r) > 0) continue;
            ms_leave(r, me);
            if (in_use) *in_use = val;
            return ms_intact(h) ? MS_OVER_CAP : MS_ERROR;
        }
        ms_help_me(h, tag, me);
        if (!seq) {
            seq = ms_announce(L, MS_OP_SHARE, dev, bytes, ms_ld(&L->share[dev]) + bytes);
            MS_FAULT("charge.announced");
        }
        if (__builtin_expect(ms_cas(w, val, tag, val + bytes, seq << 12 | me), 1)) break;
    }
    MS_FAULT("charge.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], ms_ld(&L->pnew));
    MS_FAULT("charge.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    ms_leave(r, me);
    if (!ms_intact(h)) return MS_ERROR; /* lost on the way: what was charged went with the file */
    __atomic_add_fetch(&r->held[dev], bytes, __ATOMIC_RELAXED);
    if (in_use) *in_use = val + bytes;
    return MS_OK;
}

static inline __attribute__((always_inline)) uint64_t ms_uncharge_inl(ms_region *r, int dev, uint64_t bytes) {
    uint64_t me;
    ms_lane *L = ms_enter(r, &me);
    if (L == NULL) return bytes;
    ms_hdr *h = r->hdr;
    if (!ms_intact(h)) { /* nothing to give back to: the file is gone */
        ms_leave(r, me);
        return bytes;
    }
    uint64_t have = __atomic_load_n(&r->held[dev], __ATOMIC_RELAXED), take;
    do
        take = bytes < have ? bytes : have;
    while (take && !__atomic_compare_exchange_n(&r->held[dev], &have, have - take, 1, __ATOMIC_RELAXED,
                                                __ATOMIC_RELAXED));
    if (__builtin_expect(take < bytes, 0)) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
    if (__builtin_expect(take == 0, 0)) {
        ms_leave(r, me);
        return bytes;
    }
    uint64_t seq = ms_announce(L, MS_OP_SHARE, dev, 0 - take, ms_ld(&L->share[dev]) - take);
    MS_FAULT("uncharge.announced");
    ms_word *w = &h->used[dev];
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        ms_help_me(h, tag, me);
        if (__builtin_expect(ms_cas(w, val, tag, val - (take < val ? take : val), seq << 12 | me), 1)) {
            if (__builtin_expect(val < take, 0)) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    MS_FAULT("uncharge.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], ms_ld(&L->pnew));
    MS_FAULT("uncharge.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    ms_leave(r, me);
    return bytes - take;
}

#endif
