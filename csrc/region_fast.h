/* The region core's charge and give-back, inline: the allocation hooks (hooks_mem.c) reach them
 * without a call, and region_charge.c's ms_region_charge/ms_region_uncharge are these too
 * (contract in region.h, protocol and crash-consistency argument in region_ops.h). The rare
 * parts are calls out of line (region_charge.c): a thread's first charge on a handle, a forked
 * child's first use of an inherited one, threads beyond the lanes, reclaiming dead processes
 * before refusing. Nothing here checks more than it must per call: the file's layout and totals
 * are checked when it is opened (ms_check_totals), the magic word (ms_intact, one load) after
 * each charge's CAS and before each give-back. The common charge and free touch only the
 * calling thread's lane (its reserve, region_ops.h) and its row of held[]. */
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
    uint64_t *held;  /* the lane's row of the handle's held[][] */
    uint32_t rsvdev; /* MS_PDEV_RSV(0, me): the lane's own reserves in pdev */
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
static inline uint64_t ms_announce_share(ms_lane *L, uint32_t pdev, uint64_t pnew) {
    uint64_t seq = ms_ld(&L->dseq) + 1;
    __atomic_store_n(&L->pdev, pdev, __ATOMIC_RELAXED);
    ms_st(&L->pnew, pnew);
    __atomic_store_n(&L->pseq, seq, __ATOMIC_RELEASE);
    return seq;
}

/* Out of line (region_charge.c): a charge its lane's reserve could not cover (a batch, or the
 * exact path on the device's word; taking reserves back and reclaiming the dead before
 * refusing), and a give-back that does not go into the reserve (`take`: what was already
 * taken from held[], 0 when not yet). */
int ms_charge_refill(ms_region *r, ms_lane *L, uint64_t me, uint64_t *held, int dev, uint64_t cap, uint64_t bytes,
                     uint64_t *in_use) __attribute__((visibility("hidden")));
uint64_t ms_uncharge_rest(ms_region *r, ms_lane *L, uint64_t me, uint64_t *held, int dev, uint64_t bytes,
                          uint64_t take) __attribute__((visibility("hidden")));

/* A charge on lane L (me: its tag bits; held: its row of r->held) of this process's slot; the
 * caller holds the lane. The common case in a line: the lane's own reserve covers it (our own
 * tag on it, or help whoever took it last), announce, one CAS on a word no other core writes. */
static inline __attribute__((always_inline)) int ms_charge_op(ms_region *r, ms_lane *L, uint64_t me, uint64_t *held,
                                                              uint32_t rsvdev, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    if (__builtin_expect(dev < MS_RSV_DEVS, 1)) {
        ms_rword *w = &L->rsv[dev];
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), v = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        if (__builtin_expect(bytes - 1 < v, 1)) { /* 1 <= bytes <= v: a charge of 0 checks the cap */
            ms_hdr *h = r->hdr;
            ms_help_me(h, tag, me);
            uint64_t pnew = ms_ld(&L->share[dev]) + bytes, seq = ms_announce_share(L, (rsvdev | (uint32_t)dev), pnew);
            MS_FAULT("reserve.announced");
            if (__builtin_expect(ms_rcas(w, v, tag, v - bytes, seq << 12 | me), 1)) {
                MS_FAULT("reserve.applied");
                MS_MIDOP();
                ms_st(&L->share[dev], pnew);
                MS_FAULT("reserve.folded");
                __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
                /* a file shrunk (region_guard.c: private zero pages) or zeroed under us: what
                 * was charged went with it */
                if (!ms_intact(h)) return MS_ERROR;
                __atomic_add_fetch(&held[dev], bytes, __ATOMIC_RELAXED);
                return MS_OK; /* *in_use left alone (ms_region_charge fills it) */
            }
            __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE); /* announced, never applied: taken back */
        }
    }
    return ms_charge_refill(r, L, me, held, dev, cap, bytes, in_use);
}

/* A give-back on lane L of this process's slot; the caller holds the lane. The common case:
 * taken from what this lane's thread holds, parked in the lane's reserve (one that is not empty:
 * a lane has one only once it took a batch far from the cap; one taken back stays empty). */
static inline __attribute__((always_inline)) uint64_t ms_uncharge_op(ms_region *r, ms_lane *L, uint64_t me,
                                                                     uint64_t *held, uint32_t rsvdev, int dev,
                                                                     uint64_t bytes) {
    /* A file shrunk or zeroed under us reads an empty reserve: such a free goes out of line,
     * which checks the magic before it gives anything back. */
    ms_hdr *h = r->hdr;
    uint64_t have = __atomic_load_n(&held[dev], __ATOMIC_RELAXED);
    if (__builtin_expect(dev >= MS_RSV_DEVS || have < bytes ||
                             !__atomic_compare_exchange_n(&held[dev], &have, have - bytes, 0, __ATOMIC_RELAXED,
                                                          __ATOMIC_RELAXED),
                         0))
        return ms_uncharge_rest(r, L, me, held, dev, bytes, 0);
    ms_rword *w = &L->rsv[dev];
    uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), v = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
    /* (a reserve above MS_RSV_MAX is only a corrupted file's: then parking may fail a CAS, never wrap) */
    if (__builtin_expect(v != 0 && bytes <= MS_RSV_MAX - v, 1)) {
        ms_help_me(h, tag, me);
        uint64_t pnew = ms_ld(&L->share[dev]) - bytes, seq = ms_announce_share(L, (rsvdev | (uint32_t)dev), pnew);
        MS_FAULT("park.announced");
        if (__builtin_expect(ms_rcas(w, v, tag, v + bytes, seq << 12 | me), 1)) {
            MS_FAULT("park.applied");
            MS_MIDOP();
            ms_st(&L->share[dev], pnew);
            MS_FAULT("park.folded");
            __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
            return 0;
        }
        __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE); /* announced, never applied: taken back */
    }
    return ms_uncharge_rest(r, L, me, held, dev, bytes, bytes);
}

/* ms_region_charge / ms_region_uncharge for a valid handle and device: the calling thread's
 * cached lane (an id matching the handle's proves the handle is bound to this process and the
 * lane is this thread's own), else out of line. */
static inline __attribute__((always_inline)) int ms_charge_inl(ms_region *r, int dev, uint64_t cap, uint64_t bytes,
                                                               uint64_t *in_use) {
    if (__builtin_expect(ms_mine.id == __atomic_load_n(&r->id, __ATOMIC_RELAXED), 1))
        return ms_charge_op(r, ms_mine.L, ms_mine.me, ms_mine.held, ms_mine.rsvdev, dev, cap, bytes, in_use);
    return ms_charge_slow(r, dev, cap, bytes, in_use);
}

static inline __attribute__((always_inline)) uint64_t ms_uncharge_inl(ms_region *r, int dev, uint64_t bytes) {
    if (__builtin_expect(ms_mine.id == __atomic_load_n(&r->id, __ATOMIC_RELAXED), 1))
        return ms_uncharge_op(r, ms_mine.L, ms_mine.me, ms_mine.held, ms_mine.rsvdev, dev, bytes);
    return ms_uncharge_slow(r, dev, bytes);
}

#endif
