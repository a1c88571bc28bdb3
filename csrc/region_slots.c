/* Process slots of the accounting region (design and crash-consistency argument at the top of
 * region_ops.h): claiming a free slot, finishing what a dead process left in flight, giving a
 * slot's shares back (a dead one's, or our own on close) and freeing it. No step waits on
 * another process: claims are compare-and-swaps, file locks are taken with F_OFD_SETLK. */
#include "region_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static int ms_lock_byte(int fd, size_t off, short type) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = (off_t)off, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

int ms_locked_by_other(int fd, size_t off) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)off, .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1;
    return fl.l_type != F_UNLCK;
}

static int ms_slot_clean(const ms_slot *s) {
    for (int i = 0; i < MS_LANES; i++) {
        if (ms_ld(&s->lane[i].pseq) != ms_ld(&s->lane[i].dseq)) return 0;
        for (int d = 0; d < MS_MAX_DEVICES; d++)
            if (ms_ld(&s->lane[i].share[d]) != 0 || (d < MS_RSV_DEVS && ms_ld(&s->lane[i].rsv[d].val) != 0)) return 0;
    }
    return 1;
}

int ms_claim(ms_region *r) {
    ms_hdr *h = r->hdr;
    uint64_t claiming = r->nonce << 8 | MS_SLOT_CLAIMING, claimed = r->nonce << 8 | MS_SLOT_CLAIMED;
    int err = 0;
    for (int i = 0; i < MS_SLOTS; i++) {
        ms_slot *s = &h->slot[i];
        uint64_t st = 0;
        if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != 0 ||
            !__atomic_compare_exchange_n(&s->state, &st, claiming, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
            continue;
        MS_FAULT("claim.marked");
        int locked = ms_lock_byte(r->fd, MS_SLOT_OFF(i), F_WRLCK) == 0;
        if (!locked) err = errno; /* a dying process still holds it, or no OFD locks here */
        if (!locked || !ms_slot_clean(s)) { /* unclean: only a corrupted file; leave that slot alone */
            if (locked) ms_lock_byte(r->fd, MS_SLOT_OFF(i), F_UNLCK);
            st = claiming;
            __atomic_compare_exchange_n(&s->state, &st, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
            continue;
        }
        MS_FAULT("claim.locked");
        s->pid = (int32_t)getpid();
        st = claiming;
        if (!__atomic_compare_exchange_n(&s->state, &st, claimed, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
            ms_lock_byte(r->fd, MS_SLOT_OFF(i), F_UNLCK); /* a reclaimer took it back before we locked */
            continue;
        }
        MS_FAULT("claim.done");
        r->slot = i;
        __atomic_store_n(&r->forkgen, __atomic_load_n(&ms_forkgen, __ATOMIC_RELAXED), __ATOMIC_RELEASE);
        return 0;
    }
    errno = err;
    return -1;
}

uint64_t ms_take_reserve(ms_hdr *h, ms_lane *L, uint64_t me, int dev, uint64_t target, uint64_t keep) {
    ms_rword *w = &h->slot[target >> 4].lane[target & 15].rsv[dev];
    for (;;) {
        uint64_t tag = __atomic_load_n(&w->tag, __ATOMIC_ACQUIRE), v = __atomic_load_n(&w->val, __ATOMIC_RELAXED);
        if (v <= keep) return 0;
        ms_help(h, tag, (int)(me >> 4), (int)(me & 15));
        uint64_t pnew = ms_ld(&L->share[dev]) + (v - keep);
        uint64_t seq = ms_announce(L, MS_OP_SHARE, MS_PDEV_RSV(dev, target), v - keep, pnew);
        MS_FAULT("take.announced");
        if (ms_rcas(w, v, tag, keep, seq << 12 | me)) {
            MS_FAULT("take.applied");
            ms_st(&L->share[dev], pnew);
            MS_FAULT("take.folded");
            __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
            return v - keep;
        }
        __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE); /* announced, never applied: look again */
    }
}

/* Finish (or drop) the operation a dead lane left in flight (see region_ops.h). */
static void ms_resolve(ms_hdr *h, int si, int li) {
    ms_slot *s = &h->slot[si];
    ms_lane *L = &s->lane[li];
    uint64_t seq = __atomic_load_n(&L->pseq, __ATOMIC_ACQUIRE);
    if (seq == ms_ld(&L->dseq)) return;
    uint32_t pdev = __atomic_load_n(&L->pdev, __ATOMIC_RELAXED), dev = pdev & 0x7f;
    uint64_t *word = ms_op_word(h, pdev);
    if (word != NULL) {
        uint64_t tag = __atomic_load_n(word + 1, __ATOMIC_SEQ_CST);
        int applied = tag == MS_TAG(seq, si, li) || __atomic_load_n(&L->hseq, __ATOMIC_SEQ_CST) >= seq;
        if (applied && __atomic_load_n(&L->pkind, __ATOMIC_RELAXED) == MS_OP_REPAIR)
            for (int k = 0; k < MS_LANES; k++) ms_st(&s->lane[k].share[dev], 0);
        else if (applied)
            ms_st(&L->share[dev], ms_ld(&L->pnew));
    }
    __atomic_store_n(&L->dseq, seq, __ATOMIC_RELEASE);
    __atomic_add_fetch(&h->resolved, 1, __ATOMIC_RELAXED);
    MS_FAULT("repair.resolved");
}

/* Give every share of slot si back and free it. The caller has the slot to itself: its own
 * (closing), or a dead owner's with the repair lock held. */
static void ms_repair(ms_hdr *h, int si, uint64_t state) {
    ms_slot *s = &h->slot[si];
    for (int li = 0; li < MS_LANES; li++) ms_resolve(h, si, li);
    /* the lanes' reserves into lane 0's share (operations announced there, like a live lane's
     * taking back: a repairer killed in the middle leaves one to resolve) */
    for (int d = 0; d < MS_RSV_DEVS; d++)
        for (int k = 0; k < MS_LANES; k++)
            if (ms_take_reserve(h, &s->lane[0], (uint64_t)si << 4, d, (uint64_t)si << 4 | (uint64_t)k, 0) != 0)
                MS_FAULT("repair.drained");
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        int any = 0;
        for (int k = 0; k < MS_LANES; k++) any |= ms_ld(&s->lane[k].share[d]) != 0;
        if (!any) continue;
        /* Even a share of 0 (+x on one lane, -x on another) is zeroed by an operation in flight,
         * with a new tag: a reader checking the totals never sees half of it. */
        uint64_t c = ms_slot_share(s, d), seq = ms_announce(&s->lane[0], MS_OP_REPAIR, MS_PDEV(d), 0 - c, 0);
        MS_FAULT("repair.announced");
        ms_apply_down(h, d, c, seq, si, 0);
        MS_FAULT("repair.applied");
        for (int k = 0; k < MS_LANES; k++) ms_st(&s->lane[k].share[d], 0);
        MS_FAULT("repair.folded");
        __atomic_store_n(&s->lane[0].dseq, seq, __ATOMIC_RELEASE);
    }
    __atomic_compare_exchange_n(&s->state, &state, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
    MS_FAULT("repair.freed");
}

void ms_release_own(ms_region *r) {
    ms_repair(r->hdr, r->slot, __atomic_load_n(&r->hdr->slot[r->slot].state, __ATOMIC_ACQUIRE));
    memset(r->held, 0, sizeof r->held);
}

int ms_reclaim(ms_region *r) {
    if (r->fd < 0) return 0;
    ms_hdr *h = r->hdr;
    pthread_mutex_lock(&r->reclaim_lock); /* one thread of this process: they share the OFD */
    int mine = ms_bound(r) ? r->slot : -1, n = 0;
    for (int i = 0; i < MS_SLOTS; i++) {
        uint64_t st = __atomic_load_n(&h->slot[i].state, __ATOMIC_ACQUIRE);
        if (i == mine || st == 0 || ms_locked_by_other(r->fd, MS_SLOT_OFF(i))) continue;
        if ((st & 0xff) == MS_SLOT_CLAIMING) { /* its claimer died before locking (or will retry) */
            __atomic_compare_exchange_n(&h->slot[i].state, &st, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
            continue;
        }
        if (ms_lock_byte(r->fd, MS_SLOT_OFF(i) + 1, F_WRLCK) != 0) continue; /* another survivor repairs it */
        MS_FAULT("repair.locked");
        if (__atomic_load_n(&h->slot[i].state, __ATOMIC_ACQUIRE) == st && !ms_locked_by_other(r->fd, MS_SLOT_OFF(i))) {
            ms_repair(h, i, st);
            n++;
        }
        ms_lock_byte(r->fd, MS_SLOT_OFF(i) + 1, F_UNLCK);
    }
    if (n) __atomic_add_fetch(&h->reclaimed, (uint64_t)n, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&r->reclaim_lock);
    return n;
}

