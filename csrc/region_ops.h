/* The operation protocol on the region's shared words (contract and layout in region.h), used
 * by region_slots.c (repairs) and region_charge.c (charges): the compare-and-swap on a device
 * total, helping, announcing, giving back. Inline: they are the allocation fast path.
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
 *    what it holds (held[], process memory, a row per lane: a thread gives back from its own
 *    row, from the others' only when its own is short).
 *
 * Reserves: headroom in batches, taken back without its holder (issue 32).
 *  - A lane's reserve on device d < MS_RSV_DEVS, rsv[d] = {val, tag}, is headroom counted in
 *    used[d] and charged to no allocation. The invariant becomes, whenever nothing is in flight:
 *        used[d].val == sum over slots and lanes of share[d] + rsv[d].val.
 *    used[d].val never passes the cap (every CAS that raises it checks), so neither do the
 *    bytes charged to allocations, whoever holds reserves, whatever they do.
 *  - Every change is an operation of the one form above (announce, CAS one word, fold, finish)
 *    on one of two kinds of word, named in pdev (MS_PDEV): the device's total, or some lane's
 *    reserve. A lane's share is only ever written by its own operations (or its repairer), a
 *    word only by CAS with the operation's tag, and whoever overwrites another lane's tag on
 *    either kind of word helps it first. So the resolution above holds unchanged: an
 *    operation in flight reached its word iff the word carries its tag or its lane's hseq says so.
 *  - Charge of b from the lane's own reserve: CAS rsv {v, t} -> {v - b, tag}, fold share + b.
 *    Free of b into it: {v, t} -> {v + b, tag}, fold share - b, while v + b <= MS_RSV_MAX (else
 *    the free goes to used[d], with what the reserve holds beyond MS_BATCH). Neither touches
 *    used[d]: the common case moves no line between cores.
 *  - Batch: a charge of b <= MS_BATCH that its reserve cannot cover, where used[d] + b +
 *    MS_BATCH leaves at least MS_NEAR under the cap, charges b + MS_BATCH on used[d], then
 *    deposits MS_BATCH in its reserve (two operations). Otherwise, and for every larger charge,
 *    the exact path: b on used[d].
 *  - Taking back (no help from the holder: it may be stopped, idle, or dead): lane S, for lane
 *    X's reserve, announces on S (word X.rsv[d], pnew = S.share + v), CASes X.rsv {v, t} ->
 *    {0, S's tag}, folds v into S's share, then gives it back to used[d] (an operation on the
 *    device's word). A holder stopped mid-operation on its reserve finds the tag changed and
 *    re-reads; one that had reached it was helped (hseq) first.
 *  - Exactness. A charge that does not fit in used[d] takes back every reserve in the region
 *    on its device (each claimed slot's lanes), gives them to used[d] and tries again, until a
 *    pass finds none with used[d]'s tag unchanged across it (at most MS_STEAL_PASSES), then
 *    reclaims the dead, then refuses. A lane puts headroom in its reserve only inside a charge
 *    (a batch) or a free (parking what it frees, which was counted already). So a refusal of b
 *    means: charged to allocations + b + R > cap when it last read used[d], where R is at most
 *    MS_RSV_MAX (a reserve's bound) for each lane that took a batch on the device while the
 *    refused charge ran (a batch needs MS_NEAR free; a lane stopped between its batch and its
 *    deposit counts too: its charge is still running). Frees running meanwhile add nothing (what
 *    they park was counted). With no other charge on the device running (the others idle,
 *    stopped between calls, freeing, or dead), a refusal is exact to the byte;
 *    charges above MS_BATCH never take a batch (six racing 1 GiB charges under a 3 GiB cap:
 *    exactly three succeed).
 *  - A repair first takes every reserve of the dead slot's lanes into its lane 0 (operations of
 *    the same form announced there), then gives the slot's shares back. A thread that exits
 *    gives its reserves back to used[d]; a process that exits or dies, by the repair.
 *  - Threads take a lane of their own at their first charge (15 per process; more threads share
 *    the last lane under a process-local mutex) and give it back when they exit. fork: the child
 *    claims a slot of its own before its first charge (an atfork handler gives it its own
 *    descriptor, so it never keeps a dead parent's liveness lock alive). */
#ifndef MPSSHIM_REGION_OPS_H
#define MPSSHIM_REGION_OPS_H

#include <stdint.h>

#include "region.h"

static inline uint64_t ms_ld(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void ms_st(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* A device word's tag: the operation (sequence number, slot, lane) that last changed it. */
#define MS_TAG(seq, slot, lane) ((uint64_t)(seq) << 12 | (uint64_t)(slot) << 4 | (uint64_t)(lane))

/* The only write to a device total: {ov, ot} -> {nv, nt}, atomically, full barrier. */
#if defined(__x86_64__)
__attribute__((target("cx16")))
#endif
static inline int ms_cas(ms_word *w, uint64_t ov, uint64_t ot, uint64_t nv, uint64_t nt) {
    unsigned __int128 o = (unsigned __int128)ot << 64 | ov, n = (unsigned __int128)nt << 64 | nv;
    return __sync_bool_compare_and_swap((unsigned __int128 *)(void *)w, o, n);
}

/* Reserves (see above): a batch, the most a reserve keeps from frees, the headroom a batch
 * must leave under the cap, and how many passes of taking back a refusal makes at most. */
#define MS_BATCH ((uint64_t)4 << 20)
#define MS_RSV_MAX ((uint64_t)8 << 20)
#define MS_NEAR ((uint64_t)64 << 20)
#define MS_STEAL_PASSES 8

/* The same CAS on a lane's reserve (the same 16 bytes: {val, tag}). */
static inline int ms_rcas(ms_rword *w, uint64_t ov, uint64_t ot, uint64_t nv, uint64_t nt) {
    return ms_cas((ms_word *)(void *)w, ov, ot, nv, nt);
}

/* The word an operation announced with `pdev` changes ({val, tag} at its start), or NULL for a
 * pdev no operation writes (a corrupted file). */
static inline uint64_t *ms_op_word(ms_hdr *h, uint32_t pdev) {
    uint32_t dev = pdev & 0x7f, target = pdev >> 8;
    if (dev >= MS_MAX_DEVICES) return NULL;
    if (!(pdev & MS_PDEV_RSV_BIT)) return target == 0 ? &h->used[dev].val : NULL;
    if (dev >= MS_RSV_DEVS || target >= MS_SLOTS * MS_LANES) return NULL;
    return &h->slot[target >> 4].lane[target & 15].rsv[dev].val;
}

/* Step 1 of an operation on lane L (nothing in flight there) on the word `pdev` names; returns
 * its sequence number. */
static inline uint64_t ms_announce(ms_lane *L, uint32_t kind, uint32_t pdev, uint64_t delta, uint64_t pnew) {
    uint64_t seq = ms_ld(&L->dseq) + 1;
    __atomic_store_n(&L->pkind, kind, __ATOMIC_RELAXED);
    __atomic_store_n(&L->pdev, pdev, __ATOMIC_RELAXED);
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
static inline void ms_help(ms_hdr *h, uint64_t tag, int slot, int lane) {
    unsigned tl = tag & 15, ts = (tag >> 4) & 255;
    uint64_t seq = tag >> 12;
    if (tag == 0 || (ts == (unsigned)slot && tl == (unsigned)lane)) return;
    uint64_t *hp = &h->slot[ts].lane[tl].hseq, hs = __atomic_load_n(hp, __ATOMIC_RELAXED);
    while (hs < seq && !__atomic_compare_exchange_n(hp, &hs, seq, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
}

/* Step 2 for a give-back of `take` on lane (slot, lane) with sequence `seq`: never below 0. */
static inline void ms_apply_down(ms_hdr *h, int dev, uint64_t take, uint64_t seq, int slot, int lane) {
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

#endif
