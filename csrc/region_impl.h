/* Private to the region core (contract in region.h). Files by layer; each calls only the
 * layers above it in this list, never one below:
 *   region_ops.h       the operation protocol on the shared words (inline: the fast path), and
 *                      the design and crash-consistency argument;
 *   region_layout.c    the file's layout: new header, validation, the totals invariant;
 *   region_guard.c     the SIGBUS guard: a mapping of a file shrunk under it becomes zero pages;
 *   region_fault.c     test hooks (fault injection, the sanitizer builds' mid-operation pause);
 *   region_handles.c   the process's registry of handles, handle ids, fork;
 *   region_slots.c     claiming process slots, repairing those of dead processes;
 *   region_charge.c    threads' lanes, charge and uncharge;
 *   region_map.c       opening, creating, validating and mapping a file;
 *   region_open.c      ms_region_open/close: a handle with a slot;
 *   region_snapshot.c  the read-only snapshot for tools. */
#ifndef MPSSHIM_REGION_IMPL_H
#define MPSSHIM_REGION_IMPL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "region.h"
#include "region_ops.h"

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
    /* what this process holds per device (clamps uncharges), kept per lane (a thread adds to its
     * lane's row and gives back from it, from the others' only when its own is short): rows on
     * lines of their own, apart from the fields every charge reads */
    uint64_t held[MS_LANES][MS_MAX_DEVICES] __attribute__((aligned(128)));
};

/* region_layout.c */
/* A slot's share of a device: the sum of its lanes (modulo 2^64). */
uint64_t ms_slot_share(const ms_slot *s, int d);
/* A slot's reserves on d (0 for d >= MS_RSV_DEVS). */
uint64_t ms_slot_rsv(const ms_slot *s, int d);
/* Every claimed slot's reserves on d. */
uint64_t ms_region_rsv(const ms_hdr *h, int d);
/* A new file's header (the magic last: then the header is whole). */
void ms_layout_fill(ms_hdr *h);
/* Magic and version, from the first bytes (before the size is judged); -1 and a reason. */
int ms_version_check(const ms_hdr *h, const char *path, char *err, size_t errlen);
/* Everything the header says, and each slot's state word; -1 and a reason. */
int ms_layout_check(const ms_hdr *h, const char *path, char *err, size_t errlen);
/* The invariant (totals == sum of the slots), checked where it is stable; -1 and a reason if
 * the file was corrupted. */
int ms_check_totals(const ms_hdr *h, const char *path, char *err, size_t errlen);

/* region_guard.c */
/* Guard the region mapped at base (sizeof(ms_hdr) bytes): a SIGBUS on it, once the file
 * shrank under it, turns the mapping into private zero pages instead of killing the process
 * (ms_intact then fails). 0, or -1 (the handler could not be installed, or 64 mappings are
 * guarded already). Remove before unmapping. */
int ms_guard_add(const void *base);
void ms_guard_remove(const void *base);

/* The magic number as the first 8 bytes of the header read as one word. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define MS_MAGIC_WORD 0x47524d485353504dull /* "MPSSHMRG" */
#else
#define MS_MAGIC_WORD 0x4d505353484d5247ull
#endif
/* 1 while the mapping still holds a region: 0 once the guard replaced it (a file shrunk under
 * it) or the file was zeroed (shrunk and grown again). One load of a read-mostly line. */
static inline int ms_intact(const ms_hdr *h) {
    return __atomic_load_n((const uint64_t *)(const void *)h->magic, __ATOMIC_ACQUIRE) == MS_MAGIC_WORD;
}

/* region_handles.c */
/* Guards the registry of open handles; held across fork, and while a forked child's handle
 * claims its own slot (region_charge.c). */
extern pthread_mutex_t ms_reg_lock;
/* Bumped in a forked child; a handle claimed under an older value is not bound to this process. */
extern unsigned long ms_forkgen;
/* Installs the fork handlers (once). */
void ms_handles_init(void);
/* A new unique handle id. */
unsigned long ms_new_id(void);
/* Under ms_reg_lock: the open handle of the file at path / with this id, or NULL; add, remove. */
ms_region *ms_reg_find(const char *path);
ms_region *ms_reg_by_id(unsigned long id);
void ms_reg_add(ms_region *r);
void ms_reg_remove(ms_region *r);

/* 1 if the handle's slot belongs to this process (not inherited across fork). */
static inline int ms_bound(const ms_region *r) {
    return __atomic_load_n(&r->forkgen, __ATOMIC_ACQUIRE) == __atomic_load_n(&ms_forkgen, __ATOMIC_RELAXED);
}

/* region_slots.c */
/* 1 if another open file description holds the lock on byte `off` (or the test fails). */
int ms_locked_by_other(int fd, size_t off);
/* Claim a free slot for this process (0, or -1: none free; errno from the last lock attempt). */
int ms_claim(ms_region *r);
/* Repair the slots of dead processes (how many). */
int ms_reclaim(ms_region *r);
/* An operation of lane L (me: its tag bits) taking what lane `target` (slot << 4 | lane, its
 * own included) keeps on dev beyond `keep` into L's share, without the holder's help (it may
 * be stopped, idle or dead): how much it took (region_ops.h, "Reserves"). */
uint64_t ms_take_reserve(ms_hdr *h, ms_lane *L, uint64_t me, int dev, uint64_t target, uint64_t keep);
/* Give this process's slot back (its charges, then the slot). */
void ms_release_own(ms_region *r);

/* region_map.c */
/* Unmap (if mapped) and close (if >= 0). */
void ms_release(int fd, void *map);
/* Formats a one-line reason into err, releases the fd and mapping if given; returns -1. */
int ms_fail(char *err, size_t errlen, int fd, void *map, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Open (creating it, if missing and writable, with `mode`), check and map the file at path:
 * its descriptor and mapping, or -1 and a reason. */
int ms_map(const char *path, int writable, unsigned mode, unsigned flags, int *fdp, ms_hdr **hp, char *err,
           size_t errlen);
/* Check and map the open region `fd` (named `path` in messages); on failure fd is closed.
 * With MS_MAP_LEGACY in flags (readers only), a layout-2 file is neither checked nor mapped:
 * MS_MAP_LEGACY is returned, fd left open, for ms_legacy_snapshot. */
#define MS_MAP_LEGACY 0x100u
int ms_map_fd(int fd, const char *path, int writable, unsigned flags, ms_hdr **hp, char *err, size_t errlen);

/* region_legacy.c */
/* Snapshot of the layout-2 file on fd (read, not mapped; liveness tested on lock_fd); 0, or -1
 * and a reason. fd stays the caller's. */
int ms_legacy_snapshot(int fd, int lock_fd, ms_snapshot *out, const char *path, char *err, size_t errlen);

/* Fault injection (test builds, -DMS_FAULT_INJECT): MS_FAULT("step") kills the process with
 * SIGKILL when MPSSHIM_FAULT names that step ("step" or "step:N" for its Nth passage; a
 * trailing ":stop" sends SIGSTOP instead). Steps: claim.{marked,locked,done},
 * charge.{announced,applied,folded}, uncharge.{announced,applied,folded} (on the device's word),
 * reserve.{announced,applied,folded} (a charge from the lane's reserve), park.{...} (a free into
 * it), deposit.{...} (a batch into it), take.{...} (a reserve taken back, the holder's or the
 * lane's own), return.{...} (what was taken back, to the device's word),
 * repair.{locked,resolved,drained,announced,applied,folded,freed} (repair.* also run when a
 * process closes the region and gives its own slot back). */
#ifdef MS_FAULT_INJECT
void ms_fault_point(const char *step);
#define MS_FAULT(step) ms_fault_point(step)
#else
#define MS_FAULT(step) ((void)0)
#endif

#ifdef MS_REGION_PARANOID
/* Test builds only: called between the CAS and the fold of a charge or uncharge, so a test can
 * widen the window a SIGKILL must hit to leave an operation in flight (region_fault.c). */
extern void (*ms_region_test_midop)(void);
#define MS_MIDOP() (ms_region_test_midop ? ms_region_test_midop() : (void)0)
#else
#define MS_MIDOP() ((void)0)
#endif

#endif
