/* Charging and giving back (contract in region.h, the protocol and its crash-consistency
 * argument in region_ops.h): the lanes of this process's threads, a forked child's first use
 * of an inherited handle, and the fast path. */
#include "region_fast.h"

#include <pthread.h>

/* --- lanes of this process's threads --- */

static void ms_give_reserve_back(ms_hdr *h, ms_lane *L, uint64_t me, int dev);

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
    ms_region *r = ms_mine.id ? ms_reg_by_id(ms_mine.id) : NULL;
    if (r != NULL && ms_intact(r->hdr)) /* the lane's reserves go back with the thread */
        for (int d = 0; d < MS_RSV_DEVS; d++) ms_give_reserve_back(r->hdr, ms_mine.L, ms_mine.me, d);
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
        ms_mine = (ms_tl){.id = r->id, .L = L, .me = *me, .held = r->held[lane],
                         .rsvdev = MS_PDEV_RSV(0, *me)};
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
    int rc = ms_charge_op(r, L, me, r->held[me & 15], MS_PDEV_RSV(0, me), dev, cap, bytes, in_use);
    if ((me & 15) == MS_SHARED_LANE) ms_leave_shared(r);
    return rc;
}

uint64_t ms_uncharge_slow(ms_region *r, int dev, uint64_t bytes) {
    uint64_t me;
    ms_lane *L = ms_enter_slow(r, &me);
    if (L == NULL) return bytes;
    uint64_t left = ms_uncharge_op(r, L, me, r->held[me & 15], MS_PDEV_RSV(0, me), dev, bytes);
    if ((me & 15) == MS_SHARED_LANE) ms_leave_shared(r);
    return left;
}

/* --- reserves: taking them back, giving them to the device's word (region_ops.h) --- */

/* An operation of lane L giving `x` of its share back to dev's word (what it took back, or what
 * a free gives back with it). */
static void ms_return_share(ms_hdr *h, ms_lane *L, uint64_t me, int dev, uint64_t x, int is_free) {
    (void)is_free; /* names its fault-injection steps */
    uint64_t pnew = ms_ld(&L->share[dev]) - x, seq = ms_announce_share(L, MS_PDEV(dev), pnew);
    MS_FAULT(is_free ? "uncharge.announced" : "return.announced");
    ms_apply_down(h, dev, x, seq, (int)(me >> 4), (int)(me & 15));
    MS_FAULT(is_free ? "uncharge.applied" : "return.applied");
    MS_MIDOP();
    ms_st(&L->share[dev], pnew);
    MS_FAULT(is_free ? "uncharge.folded" : "return.folded");
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
}

/* A thread's reserve on dev, back to the device's word (at its exit). */
static void ms_give_reserve_back(ms_hdr *h, ms_lane *L, uint64_t me, int dev) {
    uint64_t x = ms_take_reserve(h, L, me, dev, me, 0);
    if (x) ms_return_share(h, L, me, dev, x, 0);
}

/* Every claimed slot's reserves on dev taken back by lane L and given to the device's word. */
static uint64_t ms_take_all(ms_hdr *h, ms_lane *L, uint64_t me, int dev) {
    uint64_t got = 0;
    for (int i = 0; i < MS_SLOTS; i++) {
        if (__atomic_load_n(&h->slot[i].state, __ATOMIC_ACQUIRE) == 0) continue;
        for (int k = 0; k < MS_LANES; k++) got += ms_take_reserve(h, L, me, dev, (uint64_t)i << 4 | (uint64_t)k, 0);
    }
    if (got) ms_return_share(h, L, me, dev, got, 0);
    return got;
}

/* A batch deposited in lane L's own reserve: its share gives `x` to it. */
static void ms_deposit(ms_hdr *h, ms_lane *L, uint64_t me, int dev, uint64_t x) {
    ms_rword *w = &L->rsv[dev];
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), v = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        ms_help_me(h, tag, me);
        uint64_t pnew = ms_ld(&L->share[dev]) - x, seq = ms_announce_share(L, MS_PDEV_RSV(dev, me), pnew);
        MS_FAULT("deposit.announced");
        if (ms_rcas(w, v, tag, v + x, seq << 12 | me)) {
            MS_FAULT("deposit.applied");
            ms_st(&L->share[dev], pnew);
            MS_FAULT("deposit.folded");
            __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
            return;
        }
        __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    }
}

/* --- the charge and give-back beyond the reserve (the fast path is region_fast.h) --- */

/* Whether a charge of `bytes` on dev, with `val` counted, takes a batch with it. */
static int ms_batch_fits(int dev, uint64_t cap, uint64_t val, uint64_t bytes) {
    return dev < MS_RSV_DEVS && bytes <= MS_BATCH && cap >= MS_NEAR + 2 * MS_BATCH &&
           val <= cap - MS_NEAR - MS_BATCH - bytes;
}

int ms_charge_refill(ms_region *r, ms_lane *L, uint64_t me, uint64_t *held, int dev, uint64_t cap, uint64_t bytes,
                     uint64_t *in_use) {
    ms_hdr *h = r->hdr;
    if (ms_ld(&h->cap[dev]) != cap) ms_st(&h->cap[dev], cap);
    ms_word *w = &h->used[dev];
    int reclaimed = 0, passes = 0;
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        if (bytes <= cap && val <= cap - bytes) {
            uint64_t take = bytes + (ms_batch_fits(dev, cap, val, bytes) ? MS_BATCH : 0);
            ms_help_me(h, tag, me);
            uint64_t pnew = ms_ld(&L->share[dev]) + take, seq = ms_announce_share(L, MS_PDEV(dev), pnew);
            MS_FAULT("charge.announced");
            if (!ms_cas(w, val, tag, val + take, seq << 12 | me)) {
                __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE); /* announced, never applied */
                continue;
            }
            MS_FAULT("charge.applied");
            MS_MIDOP();
            ms_st(&L->share[dev], pnew);
            MS_FAULT("charge.folded");
            __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
            if (take > bytes) ms_deposit(h, L, me, dev, take - bytes);
            if (!ms_intact(h)) return MS_ERROR; /* lost on the way: what was charged went with the file */
            __atomic_add_fetch(&held[dev], bytes, __ATOMIC_RELAXED);
            if (in_use) *in_use = val + take;
            return MS_OK;
        }
        /* No room: take back every reserve on the device (the holders' help is not needed) and
         * look again, until a pass finds none and the word did not change meanwhile. */
        if (dev < MS_RSV_DEVS && passes < MS_STEAL_PASSES && ms_intact(h)) {
            passes++;
            if (ms_take_all(h, L, me, dev) != 0 || __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE) != tag) continue;
        }
        if (!reclaimed++ && ms_reclaim(r) > 0) continue;
        if (in_use) *in_use = val;
        return ms_intact(h) ? MS_OVER_CAP : MS_ERROR;
    }
}

/* What this process holds on dev, taken for a give-back of `bytes`: from the lane's own row
 * first, then the others' (a thread freeing what another charged). */
static uint64_t ms_held_take(ms_region *r, uint64_t *mine, int dev, uint64_t bytes) {
    uint64_t got = 0;
    for (int k = -1; k < MS_LANES && got < bytes; k++) {
        uint64_t *p = k < 0 ? &mine[dev] : &r->held[k][dev], have = __atomic_load_n(p, __ATOMIC_RELAXED), t;
        do
            t = bytes - got < have ? bytes - got : have;
        while (t && !__atomic_compare_exchange_n(p, &have, have - t, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
        got += t;
    }
    return got;
}

uint64_t ms_uncharge_rest(ms_region *r, ms_lane *L, uint64_t me, uint64_t *held, int dev, uint64_t bytes,
                          uint64_t take) {
    ms_hdr *h = r->hdr;
    if (!ms_intact(h)) return bytes; /* nothing to give back to: the file is gone */
    if (take == 0) { /* held[] not taken yet: clamp to what this process holds */
        take = ms_held_take(r, held, dev, bytes);
        if (take < bytes) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
        if (take == 0) return bytes;
    }
    /* a reserve the free could not park in keeps a batch; the rest goes back with the free */
    uint64_t extra = dev < MS_RSV_DEVS ? ms_take_reserve(h, L, me, dev, me, MS_BATCH) : 0;
    ms_return_share(h, L, me, dev, take + extra, 1);
    return bytes - take;
}

/* --- the exported charge and give-back --- */

int ms_region_charge(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    uint64_t u = 0;
    int rc = ms_region_charge_q(r, dev, cap, bytes, &u);
    if (in_use) *in_use = rc == MS_OK ? ms_region_used(r, dev) : u;
    return rc;
}

int ms_region_charge_q(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
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
    uint64_t rsv = ms_region_rsv(r->hdr, dev), used = __atomic_load_n(&r->hdr->used[dev].val, __ATOMIC_RELAXED);
    return used > rsv ? used - rsv : 0; /* reserves are free to whoever charges */
}

uint64_t ms_region_used_live(ms_region *r, int dev) {
    uint64_t used = ms_region_used(r, dev);
    if (used > 0 && used != UINT64_MAX) ms_region_reclaim(r);
    return ms_region_used(r, dev);
}

int ms_region_reclaim(ms_region *r) { return r == NULL || !ms_intact(r->hdr) ? 0 : ms_reclaim(r); }
