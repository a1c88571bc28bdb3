/* Private to the region's two halves (contract in region.h):
 *   region.c       the accounting: the design, lanes, charge/uncharge;
 *   region_slots.c claiming slots, repairing those of dead processes;
 *   region_open.c  opening, creating and validating the file, handles across fork, snapshot. */
#ifndef MPSSHIM_REGION_IMPL_H
#define MPSSHIM_REGION_IMPL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "region.h"

/* Offset of process slot i in the file: its first byte carries the owner's liveness lock, its
 * second the lock of whoever repairs it after the owner died. */
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
    uint64_t nonce;        /* in the slot's state word while this process holds it */
    unsigned long id;      /* unique per handle and per fork: threads' cached lanes name it */
    uint32_t lanes_taken;  /* bit i: lane i is some thread's (the last lane is never taken) */
    pthread_mutex_t shared_lane;  /* for threads beyond the lanes (process-local) */
    pthread_mutex_t reclaim_lock; /* one reclaiming thread per process (process-local) */
    /* what this process holds per device (clamps uncharges); a line of its own, apart from the
     * fields every charge reads */
    uint64_t held[MS_MAX_DEVICES] __attribute__((aligned(64)));
};

/* Guards the registry of open handles (region_open.c); held across fork, and while a forked
 * child's handle claims its own slot (region.c). */
extern pthread_mutex_t ms_reg_lock;
/* Bumped in a forked child (region_open.c); a handle claimed under an older value is not
 * bound to this process (region.c). */
extern unsigned long ms_forkgen;

static inline uint64_t ms_ld(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void ms_st(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* A device word's tag: the operation (sequence number, slot, lane) that last changed it. */
#define MS_TAG(seq, slot, lane) ((uint64_t)(seq) << 12 | (uint64_t)(slot) << 4 | (uint64_t)(lane))

/* region.c */
/* A slot's share of a device: the sum of its lanes (modulo 2^64). */
uint64_t ms_slot_share(const ms_slot *s, int d);
/* 1 if the handle's slot belongs to this process (not inherited across fork). */
int ms_bound(const ms_region *r);
/* Step 1 of an operation on lane L (nothing in flight there); returns its sequence number. */
uint64_t ms_announce(ms_lane *L, uint32_t kind, int dev, uint64_t delta, uint64_t pnew);
/* Step 2 of a give-back of `take` on dev by lane (slot, lane): never below 0. */
void ms_apply_down(ms_hdr *h, int dev, uint64_t take, uint64_t seq, int slot, int lane);

/* region_slots.c */
/* 1 if another open file description holds the lock on byte `off` (or the test fails). */
int ms_locked_by_other(int fd, size_t off);
/* Claim a free slot for this process (0, or -1: none free; errno from the last lock attempt). */
int ms_claim(ms_region *r);
/* Repair the slots of dead processes (how many). */
int ms_reclaim(ms_region *r);
/* Give this process's slot back (its charges, then the slot). */
void ms_release_own(ms_region *r);
/* A new unique handle id (region_open.c stamps handles with it). */
unsigned long ms_new_id(void);

/* region_open.c */
/* Under ms_reg_lock: the open handle with this id, or NULL. */
ms_region *ms_reg_by_id(unsigned long id);
/* The invariant (totals == sum of the slots), checked where it is stable; -1 and a reason if
 * the file was corrupted. */
int ms_check_totals(const ms_hdr *h, const char *path, char *err, size_t errlen);

/* Fault injection (test builds, -DMS_FAULT_INJECT): MS_FAULT("step") kills the process with
 * SIGKILL when MPSSHIM_FAULT names that step ("step" or "step:N" for its Nth passage; a
 * trailing ":stop" sends SIGSTOP instead). Steps: claim.{marked,locked,done},
 * charge.{announced,applied,folded}, uncharge.{announced,applied,folded},
 * repair.{locked,resolved,announced,applied,folded,freed} (repair.* also run when a process
 * closes the region and gives its own slot back). */
#ifdef MS_FAULT_INJECT
void ms_fault_point(const char *step);
#define MS_FAULT(step) ms_fault_point(step)
#else
#define MS_FAULT(step) ((void)0)
#endif

#endif
