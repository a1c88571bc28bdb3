/* Private to the region's two halves (contract in region.h):
 *   region.c       the accounting: the robust mutex, process slots, charge/uncharge, reclaim;
 *   region_open.c  opening, creating and validating the file, handles across fork, snapshot. */
#ifndef MPSSHIM_REGION_IMPL_H
#define MPSSHIM_REGION_IMPL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "region.h"

/* Offset of process slot i in the file (its first byte carries the owner's liveness lock). */
#define MS_SLOT_OFF(i) (offsetof(ms_hdr, slot) + (size_t)(i) * sizeof(ms_slot))

struct ms_region {
    ms_region *next;
    int refs;
    int fd;       /* -1 in a forked child that could not reopen the file */
    char *path;   /* to reopen after fork */
    dev_t st_dev;
    ino_t st_ino;
    ms_hdr *hdr;
    int slot;              /* index of this process's slot */
    unsigned long forkgen; /* ms_forkgen when the slot was claimed */
};

/* Guards the registry of open handles (region_open.c); held across fork, and while a forked
 * child's handle claims its own slot (region.c). */
extern pthread_mutex_t ms_reg_lock;
/* Bumped in a forked child (region_open.c); a handle claimed under an older value is not
 * bound to this process (region.c). */
extern unsigned long ms_forkgen;

static inline uint64_t ms_ld(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void ms_st(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* region.c */
/* Sum of a device's usage over the claimed slots, saturating. */
uint64_t ms_slot_sum(const ms_hdr *h, int d);
/* 1 if the handle's slot belongs to this process (not inherited across fork). */
int ms_bound(const ms_region *r);
/* 1 if another open file description holds slot i's liveness lock (or the test fails). */
int ms_slot_alive(int fd, int i);
/* The region mutex (0, or an errno); recovers the totals after a dead owner. */
int ms_lock(ms_region *r);
void ms_unlock(ms_region *r);
/* Under the mutex: give back a slot's charges and free it; reclaim dead slots (how many);
 * claim a free slot for this process (0, or -1 with errno from the lock attempt). */
void ms_release_slot(ms_hdr *h, int i);
int ms_reclaim_locked(ms_region *r);
int ms_claim_locked(ms_region *r);

/* region_open.c */
/* Under the mutex: the invariant (totals == sum of slots); -1 and a reason if corrupted. */
int ms_check_totals(const ms_hdr *h, const char *path, char *err, size_t errlen);

#endif
