/* Container-wide accounting region (contract in region.h): the accounting, i.e. the lock, the
 * process slots, charge/uncharge and reclaim. Opening, creating, validating, fork and the
 * snapshot are in region_open.c; what both need is in region_impl.h.
 *
 * Design, and why:
 *  - One fixed-size file, mmap'd MAP_SHARED: a header (magic, layout version, ABI and sizes,
 *    a robust process-shared mutex, per-device used bytes and last cap) and MS_SLOTS process
 *    slots (pid, state, used bytes per device). Invariant, under the mutex:
 *        header.used[d] == sum of used[d] over CLAIMED slots.
 *  - Every charge and uncharge takes the mutex. Uncontended, a robust pthread mutex is a
 *    user-space compare-and-swap plus glibc's robust-list bookkeeping: no syscall. A lock-free
 *    "reserve then roll back" counter would be a little faster but cannot tell, after a
 *    SIGKILL between updating the total and the slot, which of the two happened; the mutex
 *    can: its next owner gets EOWNERDEAD and rebuilds the totals from the slots, which makes
 *    the invariant true again whatever step the dead owner was at.
 *  - Liveness of a slot is an open-file-description (OFD) fcntl write lock its owner holds on
 *    one byte of the file (the slot's first byte) for its lifetime; others test it with
 *    F_OFD_GETLK. The kernel drops it when the process dies, whatever the PID namespace, so
 *    PID reuse cannot fool it. Why OFD and not classic POSIX locks: a POSIX lock is dropped
 *    when the process closes ANY descriptor of the file, e.g. when a second copy of this
 *    library (cffi dlopen from another path in a preloaded process) reads a snapshot, or the
 *    program itself reads the file; the process would then look dead while it holds memory.
 *    An OFD lock lives as long as its open file description, which a forked child shares
 *    through the inherited descriptor and mapping; so an atfork child handler gives the child
 *    its own descriptor and mapping: a long-lived child never keeps a dead parent's slot
 *    alive. (A child made by a raw clone() that skips atfork handlers would, until it execs.)
 *  - Dead slots are reclaimed (their bytes subtracted from the totals) when a charge would be
 *    refused, on open, and on ms_region_reclaim. The kernel releases robust futexes before
 *    file locks when a process exits, so an EOWNERDEAD recovery may still see the dead owner's
 *    file lock: its slot stays counted (consistently) until the next reclaim.
 *  - fork: the child is a new process. The atfork handler also bumps a generation number; a
 *    handle whose generation is stale claims a new slot (through the descriptor the handler
 *    opened) before its next charge: one load and compare on the fast path, no getpid(). */
#include "region_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

unsigned long ms_forkgen;

/* Sum of a device's usage over the claimed slots, saturating (a corrupted file cannot wrap it). */
uint64_t ms_slot_sum(const ms_hdr *h, int d) {
    uint64_t sum = 0;
    for (int i = 0; i < MS_SLOTS; i++) {
        if (__atomic_load_n(&h->slot[i].state, __ATOMIC_RELAXED) != MS_SLOT_CLAIMED) continue;
        uint64_t u = __atomic_load_n(&h->slot[i].used[d], __ATOMIC_RELAXED);
        sum = (sum > UINT64_MAX - u) ? UINT64_MAX : sum + u;
    }
    return sum;
}

int ms_bound(const ms_region *r) {
    return __atomic_load_n(&r->forkgen, __ATOMIC_ACQUIRE) == __atomic_load_n(&ms_forkgen, __ATOMIC_RELAXED);
}

/* 1 if another open file description holds the slot's liveness lock (or the test fails). */
int ms_slot_alive(int fd, int i) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)MS_SLOT_OFF(i), .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1;
    return fl.l_type != F_UNLCK;
}

/* Rebuild the totals from the claimed slots (after a lock owner died mid-update). */
static void ms_recompute(ms_hdr *h) {
    for (int d = 0; d < MS_MAX_DEVICES; d++) ms_st(&h->used[d], ms_slot_sum(h, d));
}

void ms_release_slot(ms_hdr *h, int i) {
    ms_slot *s = &h->slot[i];
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        uint64_t u = ms_ld(&s->used[d]), t = ms_ld(&h->used[d]);
        if (u == 0) continue;
        ms_st(&h->used[d], t - (u < t ? u : t));
        ms_st(&s->used[d], 0);
    }
    __atomic_store_n(&s->state, MS_SLOT_FREE, __ATOMIC_RELEASE);
}

/* Under the mutex. */
int ms_reclaim_locked(ms_region *r) {
    ms_hdr *h = r->hdr;
    int mine = ms_bound(r) ? r->slot : -1, n = 0;
    for (int i = 0; i < MS_SLOTS; i++) {
        if (i == mine || h->slot[i].state != MS_SLOT_CLAIMED) continue;
        if (ms_slot_alive(r->fd, i)) continue;
        ms_release_slot(h, i);
        n++;
    }
    if (n) __atomic_add_fetch(&h->reclaimed, (uint64_t)n, __ATOMIC_RELAXED);
    return n;
}

#ifdef MS_REGION_PARANOID
/* Test builds only: called between the two stores of a charge or uncharge, so a test can
 * widen the window a SIGKILL must hit to leave the totals and the slots disagreeing. */
void (*ms_region_test_midop)(void);
#define MS_MIDOP() (ms_region_test_midop ? ms_region_test_midop() : (void)0)
#else
#define MS_MIDOP() ((void)0)
#endif

int ms_lock(ms_region *r) {
    int rc = pthread_mutex_lock(&r->hdr->mutex.m);
    if (rc == EOWNERDEAD) {
        ms_recompute(r->hdr);
        __atomic_add_fetch(&r->hdr->recoveries, 1, __ATOMIC_RELAXED);
        rc = pthread_mutex_consistent(&r->hdr->mutex.m);
        if (rc != 0) pthread_mutex_unlock(&r->hdr->mutex.m);
    }
    return rc;
}

void ms_unlock(ms_region *r) {
#ifdef MS_REGION_PARANOID /* test builds: check the invariant at every unlock */
    char why[256];
    if (ms_check_totals(r->hdr, "(paranoid check)", why, sizeof why) != 0) {
        fprintf(stderr, "mpsshim: %s\n", why);
        abort();
    }
#endif
    pthread_mutex_unlock(&r->hdr->mutex.m);
}

/* Under the mutex: take a free slot whose liveness lock we can get. */
int ms_claim_locked(ms_region *r) {
    ms_hdr *h = r->hdr;
    for (int i = 0; i < MS_SLOTS; i++) {
        if (h->slot[i].state != MS_SLOT_FREE) continue;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)MS_SLOT_OFF(i), .l_len = 1};
        if (fcntl(r->fd, F_OFD_SETLK, &fl) != 0) continue; /* a dying process still holds it (errno kept) */
        ms_slot *s = &h->slot[i];
        for (int d = 0; d < MS_MAX_DEVICES; d++) ms_st(&s->used[d], 0);
        s->pid = (int32_t)getpid();
        __atomic_store_n(&s->state, MS_SLOT_CLAIMED, __ATOMIC_RELEASE);
        r->slot = i;
        __atomic_store_n(&r->forkgen, __atomic_load_n(&ms_forkgen, __ATOMIC_RELAXED), __ATOMIC_RELEASE);
        return 0;
    }
    return -1;
}

/* A forked child's first use of an inherited handle: a slot of its own. */
static int ms_rebind(ms_region *r) {
    int rc = -1;
    pthread_mutex_lock(&ms_reg_lock);
    if (ms_bound(r)) {
        rc = 0;
    } else if (r->fd >= 0 && ms_lock(r) == 0) { /* fd < 0: the child could not reopen the file */
        rc = ms_claim_locked(r);
        if (rc != 0 && ms_reclaim_locked(r) > 0) rc = ms_claim_locked(r);
        ms_unlock(r);
    }
    pthread_mutex_unlock(&ms_reg_lock);
    return rc;
}

int ms_region_charge(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return MS_ERROR;
    if (!ms_bound(r) && ms_rebind(r) != 0) return MS_ERROR;
    if (ms_lock(r) != 0) return MS_ERROR;
    ms_hdr *h = r->hdr;
    ms_st(&h->cap[dev], cap);
    uint64_t used = ms_ld(&h->used[dev]);
    if (bytes > cap || used > cap - bytes) {
        if (ms_reclaim_locked(r) > 0) used = ms_ld(&h->used[dev]);
        if (bytes > cap || used > cap - bytes) {
            ms_unlock(r);
            if (in_use) *in_use = used;
            return MS_OVER_CAP;
        }
    }
    uint64_t *mine = &h->slot[r->slot].used[dev];
    ms_st(mine, ms_ld(mine) + bytes);
    MS_MIDOP();
    ms_st(&h->used[dev], used + bytes);
    ms_unlock(r);
    if (in_use) *in_use = used + bytes;
    return MS_OK;
}

uint64_t ms_region_uncharge(ms_region *r, int dev, uint64_t bytes) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return bytes;
    if (!ms_bound(r) && ms_rebind(r) != 0) return bytes;
    if (ms_lock(r) != 0) return bytes;
    ms_hdr *h = r->hdr;
    uint64_t *mine = &h->slot[r->slot].used[dev];
    uint64_t have = ms_ld(mine), take = bytes < have ? bytes : have, total = ms_ld(&h->used[dev]);
    ms_st(mine, have - take);
    MS_MIDOP();
    ms_st(&h->used[dev], total - (take < total ? take : total));
    if (take < bytes) __atomic_add_fetch(&h->clamped, 1, __ATOMIC_RELAXED);
    ms_unlock(r);
    return bytes - take;
}

uint64_t ms_region_used(const ms_region *r, int dev) {
    if (r == NULL || dev < 0 || dev >= MS_MAX_DEVICES) return 0;
    return ms_ld(&r->hdr->used[dev]);
}

uint64_t ms_region_used_live(ms_region *r, int dev) {
    if (ms_region_used(r, dev) > 0) ms_region_reclaim(r);
    return ms_region_used(r, dev);
}

int ms_region_reclaim(ms_region *r) {
    if (r == NULL || ms_lock(r) != 0) return 0;
    int n = ms_reclaim_locked(r);
    ms_unlock(r);
    return n;
}
