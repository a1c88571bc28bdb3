/* Container-wide accounting region (contract and layout in region.h): the design, lanes,
 * charge and uncharge. Claiming slots and repairing those of dead processes are in
 * region_slots.c; opening, creating, validating, fork and the snapshot in region_open.c.
 *
 * Design: no cross-process lock anywhere.
 *  - Per device, used[d] = {val, tag} is changed only by a 16-byte compare-and-swap (CAS). A
 *    charge reads it, checks val + bytes <= cap and swaps in val + bytes: two processes can
 *    never both pass the cap, since the second CAS fails and re-checks. The tag names the
 *    operation that made the change: (sequence number, slot, lane); sequence numbers of a lane
 *    only grow, so no tag is ever written twice and a CAS never succeeds on a stale value.
 *  - Each process owns a slot (liveness: an OFD lock on the slot's first byte, dropped by the
 *    kernel when the process dies, whatever PID namespace); each thread of it uses a lane of
 *    the slot, in which it records its share per device and the one operation it has in
 *    flight. The invariant, whenever no operation is in flight:
 *        used[d].val == sum over slots and lanes of share[d].
 *  - An operation on lane L (seq s, device d, delta x) is, in order:
 *        1. announce: pkind, pdev = d, pdelta = x, pnew = share[d] + x; then pseq = s
 *        2. CAS used[d]: {v, t} -> {v + x, tag(s, L)}   (retried, after helping, until it holds)
 *        3. fold: share[d] = pnew
 *        4. finish: dseq = s
 *    Before overwriting a tag t of another lane, a CAS "helps": it raises that lane's hseq to
 *    seq(t), recording for ever that operation t reached the total. (It does so even when the
 *    owner has finished t: checking its dseq would move the owner's line to this core on every
 *    operation, while hseq sits on a line only helpers write, usually already this core's.)
 *  - Cache lines: a device word, a lane's own fields, a lane's hseq and the read-mostly caps each
 *    have lines (and 128-byte pairs) of their own, so the only line an uncontended-by-design
 *    charge moves between cores is the device word's.
 *
 * What a process killed at any instruction leaves, and how a survivor repairs it.
 *  A dead process's lanes are frozen (only helpers still raise hseq). For a lane with pseq ==
 *  dseq nothing is in flight: share[] is exactly what it contributes to the totals. For a lane
 *  with pseq = s > dseq, the operation was killed somewhere between 1 and 4, and it reached the
 *  total iff step 2 succeeded iff used[pdev].tag == tag(s, L) now, or hseq >= s (whoever
 *  overwrote the tag raised hseq first; reading the tag before hseq makes this race-free). If
 *  it did, share[pdev] = pnew (step 3, idempotent: a value, not an addition); either way dseq
 *  = s. Now every lane is exact and the slot's share is given back, per device, by an
 *  operation of the same form announced on the dead slot's lane 0 (kind MS_OP_REPAIR: delta =
 *  -share, fold = every lane's share of d becomes 0), then the slot is freed. A repairer killed
 *  in the middle leaves one more in-flight operation that the next repairer resolves the same
 *  way, so repairs compose. Nothing here waits: the step that "took a lock" is a CAS.
 *  - Who repairs: a survivor that finds a slot's owner dead takes a non-blocking OFD lock on
 *    the slot's second byte (F_OFD_SETLK): of two reclaimers racing, one gets it and the other
 *    skips the slot; a dead repairer's lock goes with it (the next one resolves what it left in
 *    flight); a stopped repairer only delays that one slot's give-back (others skip it and are
 *    never blocked; its memory stays counted, the safe side). Threads of one process share
 *    their descriptor's locks, so they reclaim one at a time (a process-local mutex).
 *  - A stopped live process (SIGSTOP, debugger, frozen cgroup) holds nothing anyone needs:
 *    whatever instruction it stopped at, the others' CASes on the totals just proceed (an
 *    operation it has in flight is either in the total or not, and its lane says which).
 *  - A reclaimer racing a live process: a slot is repaired only after the owner's liveness lock
 *    was seen free with the repair lock held and the state word unchanged; a live owner holds
 *    its lock from before CLAIMED until after it frees the slot, so a live slot is never touched.
 *  - Claiming a slot is a CAS of its state 0 -> (nonce, CLAIMING), then the liveness lock, then
 *    a CAS to (nonce, CLAIMED). A claimer that dies before locking leaves CLAIMING with no lock;
 *    a reclaimer sets it back to 0 (a live claimer in that window then fails its last CAS and
 *    tries the next slot). Free slots have every lane at share 0 and nothing in flight.
 *  - Counters never wrap: charges check v <= cap - bytes; give-backs clamp at 0 and count it
 *    (only a corrupted file has a total below a share); a process's uncharges are clamped to
 *    what it holds (held[], process memory).
 *  - Threads take a lane of their own at their first charge (15 per process; more threads share
 *    the last lane under a process-local mutex) and give it back when they exit. fork: the child
 *    claims a slot of its own before its first charge (an atfork handler gives it its own
 *    descriptor, so it never keeps a dead parent's liveness lock alive). */
#include "region_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

unsigned long ms_forkgen;
static unsigned long ms_ids;

unsigned long ms_new_id(void) { return __atomic_add_fetch(&ms_ids, 1, __ATOMIC_RELAXED); }

#define MS_SHARED_LANE (MS_LANES - 1)

#ifdef MS_REGION_PARANOID
/* Test builds only: called between the CAS and the fold of a charge or uncharge, so a test can
 * widen the window a SIGKILL must hit to leave an operation in flight. */
void (*ms_region_test_midop)(void);
#define MS_MIDOP() (ms_region_test_midop ? ms_region_test_midop() : (void)0)
#else
#define MS_MIDOP() ((void)0)
#endif

#ifdef MS_FAULT_INJECT
/* MPSSHIM_FAULT=STEP[:N][:stop]: at the Nth passage (default 1) through STEP, SIGKILL (or, with
 * ":stop", SIGSTOP: a process frozen there, e.g. holding a repair lock). */
static char ms_fault_step[64];
static long ms_fault_at, ms_fault_hits;
static int ms_fault_sig = SIGKILL;
static pthread_once_t ms_fault_once = PTHREAD_ONCE_INIT;
static void ms_fault_init(void) {
    const char *env = getenv("MPSSHIM_FAULT");
    if (env == NULL || env[0] == '\0') return;
    snprintf(ms_fault_step, sizeof ms_fault_step, "%s", env);
    char *stop = strstr(ms_fault_step, ":stop");
    if (stop) *stop = '\0', ms_fault_sig = SIGSTOP;
    char *colon = strchr(ms_fault_step, ':');
    ms_fault_at = colon ? atol(colon + 1) : 1;
    if (colon) *colon = '\0';
}
void ms_fault_point(const char *step) {
    pthread_once(&ms_fault_once, ms_fault_init);
    if (ms_fault_step[0] && strcmp(step, ms_fault_step) == 0 &&
        __atomic_add_fetch(&ms_fault_hits, 1, __ATOMIC_RELAXED) == ms_fault_at)
        raise(ms_fault_sig);
}
#endif

/* The only write to a device total: {ov, ot} -> {nv, nt}, atomically, full barrier. */
#if defined(__x86_64__)
__attribute__((target("cx16")))
#endif
static int ms_cas(ms_word *w, uint64_t ov, uint64_t ot, uint64_t nv, uint64_t nt) {
    unsigned __int128 o = (unsigned __int128)ot << 64 | ov, n = (unsigned __int128)nt << 64 | nv;
    return __sync_bool_compare_and_swap((unsigned __int128 *)(void *)w, o, n);
}

uint64_t ms_slot_share(const ms_slot *s, int d) {
    uint64_t sum = 0;
    for (int i = 0; i < MS_LANES; i++) sum += ms_ld(&s->lane[i].share[d]);
    return sum;
}

int ms_bound(const ms_region *r) {
    return __atomic_load_n(&r->forkgen, __ATOMIC_ACQUIRE) == __atomic_load_n(&ms_forkgen, __ATOMIC_RELAXED);
}

/* Step 1 of an operation on lane L (nothing in flight there); returns its sequence number. */
uint64_t ms_announce(ms_lane *L, uint32_t kind, int dev, uint64_t delta, uint64_t pnew) {
    uint64_t seq = ms_ld(&L->dseq) + 1;
    __atomic_store_n(&L->pkind, kind, __ATOMIC_RELAXED);
    __atomic_store_n(&L->pdev, (uint32_t)dev, __ATOMIC_RELAXED);
    ms_st(&L->pdelta, delta);
    ms_st(&L->pnew, pnew);
    __atomic_store_n(&L->pseq, seq, __ATOMIC_RELEASE);
    return seq;
}

/* Before overwriting `tag`: record that its operation reached the total, unless it is our own
 * lane's (a lane has one operation at a time: the tag's is finished). hseq is on a line the
 * owner never touches on its own path, so the mark is usually a write to a line this core
 * already holds; reading the owner's dseq first to skip it would pull the owner's line over
 * on every operation instead. */
static void ms_help(ms_hdr *h, uint64_t tag, int slot, int lane) {
    unsigned tl = tag & 15, ts = (tag >> 4) & 255;
    uint64_t seq = tag >> 12;
    if (tag == 0 || (ts == (unsigned)slot && tl == (unsigned)lane)) return;
    uint64_t *hp = &h->slot[ts].lane[tl].hseq, hs = __atomic_load_n(hp, __ATOMIC_RELAXED);
    while (hs < seq && !__atomic_compare_exchange_n(hp, &hs, seq, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
}

/* Step 2 for a give-back of `take` on lane (slot, lane) with sequence `seq`: never below 0. */
void ms_apply_down(ms_hdr *h, int dev, uint64_t take, uint64_t seq, int slot, int lane) {
    ms_word *w = &h->used[dev];
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), val = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        ms_help(h, tag, slot, lane);
        if (ms_cas(w, val, tag, val - (take < val ? take : val), MS_TAG(seq, slot, lane))) {
            if (val < take) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
            return;
        }
    }
}

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
            return MS_OVER_CAP;
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
    __atomic_add_fetch(&r->held[dev], bytes, __ATOMIC_RELAXED);
    if (in_use) *in_use = val + bytes;
    return MS_OK;
}

uint64_t ms_region_uncharge(ms_region *r, int dev, uint64_t bytes) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return bytes;
    if (!ms_bound(r) && ms_rebind(r) != 0) return bytes;
    ms_hdr *h = r->hdr;
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
    return __atomic_load_n(&r->hdr->used[dev].val, __ATOMIC_RELAXED);
}

uint64_t ms_region_used_live(ms_region *r, int dev) {
    if (ms_region_used(r, dev) > 0) ms_region_reclaim(r);
    return ms_region_used(r, dev);
}

int ms_region_reclaim(ms_region *r) { return r == NULL ? 0 : ms_reclaim(r); }
