/* Charging and giving back (contract in region.h, the protocol and its crash-consistency
 * argument in region_ops.h): the lanes of this process's threads, a forked child's first use
 * of an inherited handle, and the fast path. */
#include "region_fast.h"

#include <pthread.h>

/* --- lanes of this process's threads --- */

__thread ms_tl ms_mine;
static pthread_key_t ms_key;
static pthread_once_t ms_key_once = PTHREAD_ONCE_INIT;

/* Under ms_reg_lock: give the calling thread's lane back to its handle, if still open. */
static void ms_drop_lane_locked(void) {
    ms_region *r = ms_mine.id ? ms_reg_by_id(ms_mine.id) : NULL;
    int lane = (int)(ms_mine.me & 15);
    if (r != NULL && lane != MS_SHARED_LANE) r->lanes_taken &= ~(1u << lane);
    ms_mine.id = 0;
}

static void ms_thread_exit(void *arg) {
    (void)arg;
    pthread_mutex_lock(&ms_reg_lock);
    ms_drop_lane_locked();
    pthread_mutex_unlock(&ms_reg_lock);
}
static void ms_key_init(void) { pthread_key_create(&ms_key, ms_thread_exit); }

/* A forked child's first use of an inherited handle: a slot of its own. Under ms_reg_lock. */
static int ms_rebind_locked(ms_region *r) {
    if (ms_bound(r)) return 0;
    if (r->fd < 0) return -1; /* the child could not reopen the file */
    int rc = ms_claim(r);
    if (rc != 0 && ms_reclaim(r) > 0) rc = ms_claim(r);
    return rc;
}

/* A thread's first charge on a handle (or its first after a fork): bind the handle to this
 * process, take a free lane (the shared one, under its mutex, when all are taken). */
ms_lane *ms_enter_slow(ms_region *r, uint64_t *me) {
    pthread_once(&ms_key_once, ms_key_init);
    pthread_mutex_lock(&ms_reg_lock);
    if (ms_rebind_locked(r) != 0) {
        pthread_mutex_unlock(&ms_reg_lock);
        return NULL;
    }
    ms_drop_lane_locked();
    int lane = MS_SHARED_LANE;
    for (int i = 0; i < MS_SHARED_LANE; i++)
        if (!(r->lanes_taken & (1u << i))) {
            lane = i;
            r->lanes_taken |= 1u << i;
            break;
        }
    ms_lane *L = &r->hdr->slot[r->slot].lane[lane];
    *me = (uint64_t)r->slot << 4 | (uint64_t)lane;
    if (lane != MS_SHARED_LANE) { /* the shared lane is never cached: each call takes its mutex */
        ms_mine = (ms_tl){.id = r->id, .L = L, .me = *me};
        pthread_setspecific(ms_key, &ms_mine); /* non-NULL: the destructor runs at thread exit */
    }
    pthread_mutex_unlock(&ms_reg_lock);
    if (lane == MS_SHARED_LANE) pthread_mutex_lock(&r->shared_lane);
    /* every operation of a live lane is MS_OP_SHARE (a repair of a dead slot may have left
     * MS_OP_REPAIR on its lane 0 before the slot was claimed again) */
    __atomic_store_n(&L->pkind, MS_OP_SHARE, __ATOMIC_RELAXED);
    return L;
}

void ms_leave_shared(ms_region *r) { pthread_mutex_unlock(&r->shared_lane); }

int ms_charge_slow(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    uint64_t me;
    ms_lane *L = ms_enter_slow(r, &me);
    if (L == NULL) return MS_ERROR;
    int rc = ms_charge_op(r, L, me, dev, cap, bytes, in_use);
    if ((me & 15) == MS_SHARED_LANE) ms_leave_shared(r);
    return rc;
}

uint64_t ms_uncharge_slow(ms_region *r, int dev, uint64_t bytes) {
    uint64_t me;
    ms_lane *L = ms_enter_slow(r, &me);
    if (L == NULL) return bytes;
    uint64_t left = ms_uncharge_op(r, L, me, dev, bytes);
    if ((me & 15) == MS_SHARED_LANE) ms_leave_shared(r);
    return left;
}

/* --- the charge and give-back beyond their first try (the fast path is region_fast.h) --- */

int ms_charge_retry(ms_region *r, ms_lane *L, uint64_t me, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use,
                    uint64_t seq, uint64_t pnew) {
    ms_hdr *h = r->hdr;
    ms_word *w = &h->used[dev];
    int reclaimed = 0;
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        if (bytes > cap || val > cap - bytes) {
            if (seq) __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE), seq = 0; /* announced, never applied */
            if (!reclaimed++ && ms_reclaim(r) > 0) continue;
            if (in_use) *in_use = val;
            return ms_intact(h) ? MS_OVER_CAP : MS_ERROR;
        }
        ms_help_me(h, tag, me);
        if (!seq) {
            pnew = ms_ld(&L->share[dev]) + bytes;
            seq = ms_announce_share(L, dev, pnew);
            MS_FAULT("charge.announced");
        }
        if (ms_cas(w, val, tag, val + bytes, seq << 12 | me)) return ms_charge_done(r, L, dev, bytes, val, seq, pnew, in_use);
    }
}

uint64_t ms_uncharge_retry(ms_region *r, ms_lane *L, uint64_t me, int dev, uint64_t bytes, uint64_t seq,
                           uint64_t take, uint64_t pnew) {
    ms_hdr *h = r->hdr;
    if (!seq) { /* held[] not taken yet: clamp to what this process holds */
        uint64_t have = __atomic_load_n(&r->held[dev], __ATOMIC_RELAXED);
        do
            take = bytes < have ? bytes : have;
        while (take && !__atomic_compare_exchange_n(&r->held[dev], &have, have - take, 1, __ATOMIC_RELAXED,
                                                    __ATOMIC_RELAXED));
        if (take < bytes) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
        if (take == 0) return bytes;
        pnew = ms_ld(&L->share[dev]) - take;
        seq = ms_announce_share(L, dev, pnew);
        MS_FAULT("uncharge.announced");
    }
    ms_word *w = &h->used[dev];
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        ms_help_me(h, tag, me);
        if (ms_cas(w, val, tag, val - (take < val ? take : val), seq << 12 | me)) {
            if (val < take) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED); /* only a corrupted file */
            return ms_uncharge_done(L, dev, bytes, take, seq, pnew);
        }
    }
}

/* --- the exported charge and give-back --- */

int ms_region_charge(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return MS_ERROR;
    return ms_charge_inl(r, dev, cap, bytes, in_use);
}

uint64_t ms_region_uncharge(ms_region *r, int dev, uint64_t bytes) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return bytes;
    return ms_uncharge_inl(r, dev, bytes);
}

uint64_t ms_region_used(const ms_region *r, int dev) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return 0;
    if (!ms_intact(r->hdr)) return UINT64_MAX;
    return __atomic_load_n(&r->hdr->used[dev].val, __ATOMIC_RELAXED);
}

uint64_t ms_region_used_live(ms_region *r, int dev) {
    uint64_t used = ms_region_used(r, dev);
    if (used > 0 && used != UINT64_MAX) ms_region_reclaim(r);
    return ms_region_used(r, dev);
}

int ms_region_reclaim(ms_region *r) { return r == NULL || !ms_intact(r->hdr) ? 0 : ms_reclaim(r); }
