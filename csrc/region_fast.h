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

/* The charge or give-back of a thread whose lane is not cached (region_charge.c): ms_enter_slow,
 * the same operation, and the shared lane's mutex released. */
int ms_charge_slow(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use)
    __attribute__((visibility("hidden")));
uint64_t ms_uncharge_slow(ms_region *r, int dev, uint64_t bytes) __attribute__((visibility("hidden")));

/* Before overwriting `tag`: record that its operation reached the total, unless it is our own
 * lane's (see ms_help in region_ops.h; `me` = slot << 4 | lane). Tag 0 (no operation yet) names
 * slot 0 lane 0 with sequence 0, which no hseq is below: nothing is written for it. */
static inline void ms_help_me(ms_hdr *h, uint64_t tag, uint64_t me) {
    if ((tag & 0xfff) == me) return;
    uint64_t *hp = &h->slot[(tag >> 4) & 255].lane[tag & 15].hseq, seq = tag >> 12;
    uint64_t hs = __atomic_load_n(hp, __ATOMIC_RELAXED);
    while (hs < seq && !__atomic_compare_exchange_n(hp, &hs, seq, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
}

/* Step 1 of an operation of this lane's (region_ops.h). pkind is MS_OP_SHARE for all of a live
 * lane's operations, written when a thread takes the lane (ms_enter_slow); pdelta is written by
 * repairs only (informational). */
static inline uint64_t ms_announce_share(ms_lane *L, int dev, uint64_t pnew) {
    uint64_t seq = ms_ld(&L->dseq) + 1;
    __atomic_store_n(&L->pdev, (uint32_t)dev, __ATOMIC_RELAXED);
    ms_st(&L->pnew, pnew);
    __atomic_store_n(&L->pseq, seq, __ATOMIC_RELEASE);
    return seq;
}

/* Steps 3 and 4 of a charge whose CAS took `val` to val + bytes. */
static inline __attribute__((always_inline)) int ms_charge_done(ms_region *r, ms_lane *L, int dev, uint64_t bytes,
                                                                uint64_t val, uint64_t seq, uint64_t pnew,
                                                                uint64_t *in_use) {
    MS_FAULT("charge.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], pnew);
    MS_FAULT("charge.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    if (!ms_intact(r->hdr)) return MS_ERROR; /* lost on the way: what was charged went with the file */
    __atomic_add_fetch(&r->held[dev], bytes, __ATOMIC_RELAXED);
    if (in_use) *in_use = val + bytes;
    return MS_OK;
}

/* Steps 3 and 4 of a give-back of `take`. */
static inline __attribute__((always_inline)) uint64_t ms_uncharge_done(ms_lane *L, int dev, uint64_t bytes,
                                                                       uint64_t take, uint64_t seq, uint64_t pnew) {
    MS_FAULT("uncharge.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], pnew);
    MS_FAULT("uncharge.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    return bytes - take;
}

/* Out of line (region_charge.c): the rest of a charge whose first try did not go through (a CAS
 * lost to another thread or process, or no room: reclaim the dead, then refuse); `seq` is the
 * operation already announced (0: none), `pnew` its new share. */
int ms_charge_retry(ms_region *r, ms_lane *L, uint64_t me, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use,
                    uint64_t seq, uint64_t pnew) __attribute__((visibility("hidden")));
/* The same for a give-back: clamped to what the process holds (held[] not yet taken when
 * seq == 0), or with its CAS lost. */
uint64_t ms_uncharge_retry(ms_region *r, ms_lane *L, uint64_t me, int dev, uint64_t bytes, uint64_t seq,
                           uint64_t take, uint64_t pnew) __attribute__((visibility("hidden")));

/* A charge on lane L (me: its tag bits) of this process's slot; the caller holds the lane. The
 * common case in a line: room, our own tag (or help its owner), announce, one CAS. */
static inline __attribute__((always_inline)) int ms_charge_op(ms_region *r, ms_lane *L, uint64_t me, int dev,
                                                              uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    /* A file shrunk (region_guard.c: the mapping is private zero pages) or zeroed under us is
     * caught by ms_charge_done's check after the CAS, before anything counts the charge: a
     * check before it too would only make the same refusal earlier. */
    ms_hdr *h = r->hdr;
    if (ms_ld(&h->cap[dev]) != cap) ms_st(&h->cap[dev], cap);
    ms_word *w = &h->used[dev];
    uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
    uint64_t seq = 0, pnew = 0;
    if (__builtin_expect(bytes <= cap && val <= cap - bytes, 1)) {
        ms_help_me(h, tag, me);
        pnew = ms_ld(&L->share[dev]) + bytes;
        seq = ms_announce_share(L, dev, pnew);
        MS_FAULT("charge.announced");
        if (__builtin_expect(ms_cas(w, val, tag, val + bytes, seq << 12 | me), 1))
            return ms_charge_done(r, L, dev, bytes, val, seq, pnew, in_use);
    }
    return ms_charge_retry(r, L, me, dev, cap, bytes, in_use, seq, pnew);
}

/* A give-back on lane L of this process's slot; the caller holds the lane. */
static inline __attribute__((always_inline)) uint64_t ms_uncharge_op(ms_region *r, ms_lane *L, uint64_t me, int dev,
                                                                     uint64_t bytes) {
    ms_hdr *h = r->hdr;
    if (!ms_intact(h)) return bytes; /* nothing to give back to: the file is gone */
    uint64_t have = __atomic_load_n(&r->held[dev], __ATOMIC_RELAXED);
    if (__builtin_expect(have >= bytes && __atomic_compare_exchange_n(&r->held[dev], &have, have - bytes, 0, __ATOMIC_RELAXED,
                                                         __ATOMIC_RELAXED),
                         1)) {
        uint64_t pnew = ms_ld(&L->share[dev]) - bytes, seq = ms_announce_share(L, dev, pnew);
        MS_FAULT("uncharge.announced");
        ms_word *w = &h->used[dev];
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        ms_help_me(h, tag, me);
        if (__builtin_expect(val >= bytes && ms_cas(w, val, tag, val - bytes, seq << 12 | me), 1))
            return ms_uncharge_done(L, dev, bytes, bytes, seq, pnew);
        return ms_uncharge_retry(r, L, me, dev, bytes, seq, bytes, pnew);
    }
    return ms_uncharge_retry(r, L, me, dev, bytes, 0, 0, 0);
}

/* ms_region_charge / ms_region_uncharge for a valid handle and device: the calling thread's
 * cached lane (an id matching the handle's proves the handle is bound to this process and the
 * lane is this thread's own), else out of line. */
static inline __attribute__((always_inline)) int ms_charge_inl(ms_region *r, int dev, uint64_t cap, uint64_t bytes,
                                                               uint64_t *in_use) {
    if (__builtin_expect(ms_mine.id == __atomic_load_n(&r->id, __ATOMIC_RELAXED), 1))
        return ms_charge_op(r, ms_mine.L, ms_mine.me, dev, cap, bytes, in_use);
    return ms_charge_slow(r, dev, cap, bytes, in_use);
}

static inline __attribute__((always_inline)) uint64_t ms_uncharge_inl(ms_region *r, int dev, uint64_t bytes) {
    if (__builtin_expect(ms_mine.id == __atomic_load_n(&r->id, __ATOMIC_RELAXED), 1))
        return ms_uncharge_op(r, ms_mine.L, ms_mine.me, dev, bytes);
    return ms_uncharge_slow(r, dev, bytes);
}

#endif
