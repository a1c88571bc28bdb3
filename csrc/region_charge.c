/* Charging and giving back (contract in region.h, the protocol and its crash-consistency
 * argument in region_ops.h): the lanes of this process's threads, a forked child's first use
 * of an inherited handle, and the fast path. */
#include "region_impl.h"

#include <pthread.h>

#define MS_SHARED_LANE (MS_LANES - 1)

/* --- lanes of this process's threads --- */

typedef struct ms_tl {
    unsigned long id; /* the handle the lane belongs to (0: none) */
    int lane;
} ms_tl;
static __thread ms_tl ms_mine;
static pthread_key_t ms_key;
static pthread_once_t ms_key_once = PTHREAD_ONCE_INIT;

/* Under ms_reg_lock: give the calling thread's lane back to its handle, if still open. */
static void ms_drop_lane_locked(void) {
    ms_region *r = ms_mine.id ? ms_reg_by_id(ms_mine.id) : NULL;
    if (r != NULL && ms_mine.lane != MS_SHARED_LANE) r->lanes_taken &= ~(1u << ms_mine.lane);
    ms_mine.id = 0;
}

static void ms_thread_exit(void *arg) {
    (void)arg;
    pthread_mutex_lock(&ms_reg_lock);
    ms_drop_lane_locked();
    pthread_mutex_unlock(&ms_reg_lock);
}
static void ms_key_init(void) { pthread_key_create(&ms_key, ms_thread_exit); }

static int ms_adopt(ms_region *r) {
    pthread_once(&ms_key_once, ms_key_init);
    pthread_mutex_lock(&ms_reg_lock);
    ms_drop_lane_locked();
    int lane = MS_SHARED_LANE;
    for (int i = 0; i < MS_SHARED_LANE; i++)
        if (!(r->lanes_taken & (1u << i))) {
            lane = i;
            r->lanes_taken |= 1u << i;
            break;
        }
    ms_mine = (ms_tl){.id = r->id, .lane = lane};
    pthread_setspecific(ms_key, &ms_mine); /* non-NULL: the destructor runs at thread exit */
    pthread_mutex_unlock(&ms_reg_lock);
    return lane;
}

static int ms_enter(ms_region *r) {
    int lane = ms_mine.id == __atomic_load_n(&r->id, __ATOMIC_RELAXED) ? ms_mine.lane : ms_adopt(r);
    if (lane == MS_SHARED_LANE) pthread_mutex_lock(&r->shared_lane);
    return lane;
}

static void ms_leave(ms_region *r, int lane) {
    if (lane == MS_SHARED_LANE) pthread_mutex_unlock(&r->shared_lane);
}

/* A forked child's first use of an inherited handle: a slot of its own. */
static int ms_rebind(ms_region *r) {
    int rc = 0;
    pthread_mutex_lock(&ms_reg_lock);
    if (!ms_bound(r)) {
        rc = -1;
        if (r->fd >= 0) { /* fd < 0: the child could not reopen the file */
            rc = ms_claim(r);
            if (rc != 0 && ms_reclaim(r) > 0) rc = ms_claim(r);
        }
    }
    pthread_mutex_unlock(&ms_reg_lock);
    return rc;
}

/* --- the fast path --- */

int ms_region_charge(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return MS_ERROR;
    if (!ms_bound(r) && ms_rebind(r) != 0) return MS_ERROR;
    ms_hdr *h = r->hdr;
    if (!ms_intact(h)) return MS_ERROR; /* shrunk (region_guard.c) or zeroed under us */
    if (ms_ld(&h->cap[dev]) != cap) ms_st(&h->cap[dev], cap);
    ms_word *w = &h->used[dev];
    int li = ms_enter(r), reclaimed = 0;
    ms_lane *L = &h->slot[r->slot].lane[li];
    uint64_t seq = 0, val;
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE);
        val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        if (bytes > cap || val > cap - bytes) {
            if (seq) __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE), seq = 0; /* announced, never applied */
            if (!reclaimed++ && ms_reclaim(r) > 0) continue;
            ms_leave(r, li);
            if (in_use) *in_use = val;
            return ms_intact(h) ? MS_OVER_CAP : MS_ERROR;
        }
        ms_help(h, tag, r->slot, li);
        if (!seq) {
            seq = ms_announce(L, MS_OP_SHARE, dev, bytes, ms_ld(&L->share[dev]) + bytes);
            MS_FAULT("charge.announced");
        }
        if (ms_cas(w, val, tag, val + bytes, MS_TAG(seq, r->slot, li))) break;
    }
    MS_FAULT("charge.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], ms_ld(&L->pnew));
    MS_FAULT("charge.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    ms_leave(r, li);
    if (!ms_intact(h)) return MS_ERROR; /* lost on the way: what was charged went with the file */
    __atomic_add_fetch(&r->held[dev], bytes, __ATOMIC_RELAXED);
    if (in_use) *in_use = val + bytes;
    return MS_OK;
}

uint64_t ms_region_uncharge(ms_region *r, int dev, uint64_t bytes) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return bytes;
    if (!ms_bound(r) && ms_rebind(r) != 0) return bytes;
    ms_hdr *h = r->hdr;
    if (!ms_intact(h)) return bytes; /* nothing to give back to: the file is gone */
    uint64_t have = __atomic_load_n(&r->held[dev], __ATOMIC_RELAXED), take;
    do
        take = bytes < have ? bytes : have;
    while (take && !__atomic_compare_exchange_n(&r->held[dev], &have, have - take, 1, __ATOMIC_RELAXED,
                                                __ATOMIC_RELAXED));
    if (take < bytes) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
    if (take == 0) return bytes;
    int li = ms_enter(r);
    ms_lane *L = &h->slot[r->slot].lane[li];
    uint64_t seq = ms_announce(L, MS_OP_SHARE, dev, 0 - take, ms_ld(&L->share[dev]) - take);
    MS_FAULT("uncharge.announced");
    ms_apply_down(h, dev, take, seq, r->slot, li);
    MS_FAULT("uncharge.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], ms_ld(&L->pnew));
    MS_FAULT("uncharge.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    ms_leave(r, li);
    return bytes - take;
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
