/* A cuMemCreate handle's references, counted as the driver counts them (contract in track.h).
 *
 * The driver frees a handle's memory when its last reference goes (cuMemCreate's, one per
 * cuMemRetainAllocationHandle, one per mapping). The shim sees each call start and end, not the
 * instant the driver acts inside it, so the entry counts only what the driver confirmed (holds:
 * a call that added or dropped a reference and returned success) and what it may have done
 * already (adds: cuMemMap calls in flight; retains: cuMemRetainAllocationHandle calls in flight,
 * process-wide, since the handle is known only once the driver answers). The driver's count is
 * never above holds + adds (+ retains in flight), and a drop in flight can only lower it; so with
 * holds at 0 and nothing in flight that could add one, the driver has freed the memory, and
 * whoever ends the last call sees that and alone uncharges it. A call the driver refuses changes
 * nothing. Every call finds its entry again by ticket, so a handle value the driver frees and
 * hands out again meanwhile (track.c makes the old entry DEAD) is never confused with the new
 * one.
 *
 * An entry reaching 0 references while a retain is in flight anywhere is flagged `zero` and
 * kept (the retain may be taking a reference on it); the retain that leaves none in flight
 * settles the flagged entries (a scan of the shards, only when some are flagged). */
#include <stddef.h>

#include "track_impl.h"

int ms_refs_zeros;
static int ms_retains; /* cuMemRetainAllocationHandle calls in flight */

/* Slot of the FULL or DEAD handle entry of `key` with `ticket`, or -1. */
static int64_t ms_find_ticket(const ms_shard *s, uint64_t key, uint64_t h, uint32_t ticket) {
    if (s->cap == 0) return -1;
    uint32_t mask = s->cap - 1;
    for (uint32_t i = (uint32_t)h & mask, n = 0; n < s->cap; i = (i + 1) & mask, n++) {
        const ms_entry *e = &s->e[i];
        if (e->state == MS_E_EMPTY) return -1;
        if ((e->state == MS_E_FULL || e->state == MS_E_DEAD) && e->key == key && e->kind == MS_TRACK_HANDLE &&
            e->ticket == ticket)
            return i;
    }
    return -1;
}

/* Under the lock: forget entry `at` if the driver has freed its memory (1, and what it was
 * charged with), else 0. */
static int ms_settle(ms_shard *s, int64_t at, int *dev, uint64_t *bytes) {
    ms_entry *e = &s->e[at];
    int gone;
    if (e->state == MS_E_DEAD) {
        gone = e->ops == 0; /* the driver handed its value out again: it freed it */
    } else if (e->holds > 0 || e->adds > 0) {
        if (e->zero) __atomic_sub_fetch(&ms_refs_zeros, 1, __ATOMIC_SEQ_CST);
        e->zero = 0;
        gone = 0;
    } else {
        if (!e->zero) __atomic_add_fetch(&ms_refs_zeros, 1, __ATOMIC_SEQ_CST);
        e->zero = 1; /* before looking at the retains: the last one out sees it (ms_sweep) */
        gone = __atomic_load_n(&ms_retains, __ATOMIC_SEQ_CST) == 0;
    }
    if (gone) ms_forget(s, at, dev, bytes, NULL);
    return gone;
}

int ms_track_ref_begin(uint64_t handle, int add, uint64_t *ticket) {
    uint64_t h = ms_mix(MS_TRACK_HANDLE, handle);
    ms_shard *s = ms_shard_of(h);
    ms_spin_lock(&s->lock);
    int64_t at = ms_find(s, MS_TRACK_HANDLE, handle, h);
    if (at >= 0) {
        ms_entry *e = &s->e[at];
        e->ops++;
        e->adds += add != 0;
        *ticket = e->ticket;
    }
    ms_spin_unlock(&s->lock);
    return at >= 0;
}

int ms_track_ref_end(uint64_t handle, uint64_t ticket, int add, int ok, int *dev, uint64_t *bytes) {
    uint64_t h = ms_mix(MS_TRACK_HANDLE, handle);
    ms_shard *s = ms_shard_of(h);
    int rc = 0;
    ms_spin_lock(&s->lock);
    int64_t at = ms_find_ticket(s, handle, h, (uint32_t)ticket);
    if (at >= 0) {
        ms_entry *e = &s->e[at];
        e->ops--;
        if (add) e->adds--;
        if (ok) e->holds += add ? 1 : -1;
        rc = ms_settle(s, at, dev, bytes);
    }
    ms_spin_unlock(&s->lock);
    return rc;
}

void ms_track_retain_begin(void) { __atomic_add_fetch(&ms_retains, 1, __ATOMIC_SEQ_CST); }

/* Settle every flagged entry that can be, giving each charge back through `give_back`. */
static void ms_sweep(void (*give_back)(int dev, uint64_t bytes)) {
    for (int i = 0; i < MS_SHARDS; i++) {
        ms_shard *s = &ms_shards[i];
        for (uint32_t j = 0, cap = 0;;) {
            int dev = 0, gone = 0;
            uint64_t bytes = 0;
            ms_spin_lock(&s->lock);
            if (s->cap != cap) j = 0, cap = s->cap; /* it grew meanwhile: from the start again */
            for (; j < s->cap && !gone; j++)
                if (s->e[j].zero && (s->e[j].state == MS_E_FULL || s->e[j].state == MS_E_DEAD))
                    gone = ms_settle(s, j, &dev, &bytes);
            ms_spin_unlock(&s->lock);
            if (!gone) break;
            give_back(dev, bytes); /* outside the lock */
        }
    }
}

void ms_track_retain_end(int ok, uint64_t handle, void (*give_back)(int dev, uint64_t bytes)) {
    if (ok) {
        uint64_t h = ms_mix(MS_TRACK_HANDLE, handle);
        ms_shard *s = ms_shard_of(h);
        ms_spin_lock(&s->lock);
        int64_t at = ms_find(s, MS_TRACK_HANDLE, handle, h);
        if (at >= 0) {
            s->e[at].holds++;
            ms_settle(s, at, NULL, NULL); /* clears `zero`: it has a reference again */
        }
        ms_spin_unlock(&s->lock);
    }
    int last = __atomic_sub_fetch(&ms_retains, 1, __ATOMIC_SEQ_CST) == 0;
    if (last && __atomic_load_n(&ms_refs_zeros, __ATOMIC_SEQ_CST) > 0) ms_sweep(give_back);
}
