/* Container-wide accounting: a versioned file, mmap'd MAP_SHARED by every process that names
 * it in MPSSHIM_REGION, holding per device the bytes in use and per process its own share.
 *
 * Contract:
 *  - ms_region_charge is an atomic check-and-charge across processes and threads: the sum of
 *    all charges never passes `cap`, however processes race.
 *  - A process that dies (SIGKILL included, at any instruction, inside a charge too) has its
 *    charges given back exactly the next time anyone would be refused, opens the region or asks
 *    for live usage; nobody deletes files, and nobody waits for anyone to do it.
 *  - Counters never drift or wrap: charge(x) then uncharge(x) restores used exactly.
 *  - No cross-process lock and no syscall on the charge/uncharge path: one compare-and-swap on
 *    this thread's reserve (headroom taken from the device's shared counter in batches) or, on
 *    the exact path, on that counter, plus stores to this thread's own lane (target: an alloc+free
 *    pair through the shim costs at most 100 ns more than without it single-threaded, and at
 *    most 200 ns per pair in aggregate with 8 threads on 2 cores). A stopped (SIGSTOP, frozen
 *    cgroup, debugger) or dead co-tenant can never block another process's call.
 *  - A file with a bad magic, version, size or type is refused with a clear reason, never
 *    "no cap"; a file is preallocated before it is published, so a full disk is a refusal at
 *    open, never a SIGBUS later.
 *  - A file shrunk under a mapping of it (another process truncating the shared file) is never
 *    a SIGBUS: the mapping becomes private zero pages (region_guard.c), and the handle answers
 *    MS_ERROR from then on, as for a file zeroed under it (its magic reads 0). Other SIGBUSes
 *    go to the handler installed before the first region was mapped, or the default action. */
#ifndef MPSSHIM_REGION_H
#define MPSSHIM_REGION_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "limits.h"

typedef struct ms_region ms_region; /* process-local handle */

enum { MS_OK = 0, MS_OVER_CAP = 1, MS_ERROR = -1 };

/* Open or create the region at `path` (creating parent directories is the caller's job).
 * Claims a process slot. 0, or -1 with a one-line reason in err. A new file is created with
 * mode 0666 & ~umask (see ms_region_open_mode for an explicit mode), preallocated, under a
 * temporary name, and published whole. The file is opened without following a symbolic link
 * and without blocking (a FIFO planted there is refused, not waited on); it must be a regular
 * file of exactly the layout's size.
 * Opening the same file twice in one process returns the same handle (reference counted, one
 * slot per process). A forked child gets a slot of its own at its first charge. */
int ms_region_open(const char *path, ms_region **out, char *err, size_t errlen);
/* The same, creating a missing file with exactly `mode` (umask ignored), or with 0666 & ~umask
 * for MS_MODE_UMASK. The shim uses 0666 for a region named in MPSSHIM_REGION: it is there to
 * be shared by every process of a container, whatever their UIDs. */
#define MS_MODE_UMASK 0xffffffffu
int ms_region_open_mode(const char *path, unsigned mode, ms_region **out, char *err, size_t errlen);
/* The same with flags: MS_OPEN_OWNED refuses a file this process's effective UID does not own
 * (the per-UID default region in a shared /tmp, which another user could plant). */
#define MS_OPEN_OWNED 1u
int ms_region_open_ex(const char *path, unsigned mode, unsigned flags, ms_region **out, char *err, size_t errlen);
/* Gives this process's charges back (at the last close of a shared handle); no other thread
 * may still be using the handle. */
void ms_region_close(ms_region *r);

/* Charge `bytes` on device `dev` (0 <= dev < MS_MAX_DEVICES) against `cap`.
 * MS_OK (*in_use: bytes in use after it, as ms_region_used says), or MS_OVER_CAP
 * (nothing charged; *in_use says what is counted, after every reserve found was taken back and
 * dead processes were reclaimed), or MS_ERROR (corrupted region: shrunk or zeroed under this
 * process too). A charge of at most MS_BATCH bytes may take a batch of headroom for the
 * calling thread (region_ops.h); exactness at the cap is stated there. */
int ms_region_charge(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use);
/* The same, with *in_use set on MS_OVER_CAP only (the allocation hooks: no pass over the slots). */
int ms_region_charge_q(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use);
/* Gives back up to `bytes` of what this process charged on `dev`. Never wraps: more than this
 * process holds is clamped, and the part that could not be given back is returned (0 normally;
 * callers that ignore it may keep calling it as a void function). */
uint64_t ms_region_uncharge(ms_region *r, int dev, uint64_t bytes);
/* Bytes in use on dev (charged to allocations: reserves are not in use); UINT64_MAX (nothing
 * free) once the region was shrunk or zeroed. Reads every live slot's reserves. */
uint64_t ms_region_used(const ms_region *r, int dev);
/* The same after giving back dead processes' charges, if any are counted on `dev` (tests
 * liveness, one fcntl per process slot in use: for memory queries, so a crashed process of the container does not
 * shrink the free memory reported until the next refused charge). */
uint64_t ms_region_used_live(ms_region *r, int dev);

/* Give back the charges of dead processes. Returns how many slots were reclaimed. */
int ms_region_reclaim(ms_region *r);

/* For the shim's sigaction/signal interposers: SIGBUS as the application sets it. While the
 * region's SIGBUS guard is the kernel's disposition (from the first region mapped on), `act`
 * is recorded as the action the guard passes every other SIGBUS to, and `old` gets the one
 * recorded before; otherwise this is sigaction(SIGBUS, act, old). 0 or -1 (errno). */
struct sigaction;
int ms_region_sigbus_action(const struct sigaction *act, struct sigaction *old);

/* Read-only snapshot for tools (shim.usage() reaches it through the exported mpsshim_usage).
 * A layout-2 file (the shim before reserves) is read too, never mapped (region_legacy.c). */
#define MS_SNAPSHOT_MAX_PROCS 256
typedef struct ms_proc_usage {
    int32_t pid;   /* as the owning process saw itself */
    int32_t alive; /* 1 while the owner still holds its liveness lock */
    uint64_t used[MS_MAX_DEVICES];
} ms_proc_usage;

typedef struct ms_snapshot {
    uint32_t version;
    uint32_t nprocs;
    uint64_t cap[MS_MAX_DEVICES];  /* last cap charged against per device; 0 = none seen */
    uint64_t used[MS_MAX_DEVICES];
    ms_proc_usage procs[MS_SNAPSHOT_MAX_PROCS];
} ms_snapshot;

/* The size of a file of `layout` that the snapshot reads (MS_LAYOUT_VERSION and 2), else 0. */
size_t ms_region_file_size(uint32_t layout);

int ms_region_snapshot(const char *path, ms_snapshot *out, char *err, size_t errlen);
/* The same for a region the caller has opened and checked itself (a reader of files others can
 * swap: open the name once, check it, read that file); the descriptors stay the caller's. `fd`
 * may be a private copy of the file (a reader others can truncate the file under), `lock_fd`
 * the file itself, on which liveness is tested; -1 tests it on `fd`. */
int ms_region_snapshot_fd(int fd, int lock_fd, ms_snapshot *out, char *err, size_t errlen);
/* The same with MS_OPEN_OWNED or 0 (as for ms_region_open_ex). */
int ms_region_snapshot_ex(const char *path, unsigned flags, ms_snapshot *out, char *err, size_t errlen);

/* --- The file (layout version 3; bump MS_LAYOUT_VERSION on any change of the file or of the
 * protocol on it: mpsd installs the library as libmpsshim.so.<layout>, and replaces that file
 * only with a build that every process already preloading it can share a region with) ---
 * A header, per-device totals, then MS_SLOTS process slots of MS_LANES lanes each; the whole
 * file is sizeof(ms_hdr) bytes. The crash-consistency argument is at the top of region_ops.h.
 *  - used[d] is a 16-byte word {bytes counted, tag of the operation that last changed it},
 *    changed only by a 16-byte compare-and-swap.
 *  - A slot belongs to one process: its owner holds an OFD write lock on the slot's first byte
 *    for as long as it lives (liveness); a survivor repairing the slot of a dead owner holds
 *    one on the second byte (so only one repairs it; a dead repairer's lock goes with it).
 *  - A lane belongs to one thread of the slot's process at a time and records that thread's
 *    share per device (modulo 2^64: a lane that frees what another lane charged goes below
 *    zero; the slot's share is the sum of its lanes), the operation it has in flight, and, for
 *    the first MS_RSV_DEVS devices, its reserve: headroom taken from used[d] in a batch (counted
 *    there) and not yet charged to an allocation, a 16-byte word {bytes, tag} like used[d],
 *    which its owner and, without it, any other lane (taking it back) change by compare-and-swap.
 *    used[d].val == sum over lanes of share[d] + rsv[d].val whenever nothing is in flight. */
#define MS_MAGIC "MPSSHMRG"
#define MS_LAYOUT_VERSION 3
#define MS_SLOTS MS_SNAPSHOT_MAX_PROCS
#define MS_LANES 16 /* per slot: 15 threads with a lane of their own, the rest share the last */
#define MS_RSV_DEVS 8 /* devices 0..7 have per-lane reserves; charges on others are exact */
/* Refuses a file written under another ABI or with other table sizes. */
#define MS_ABI ((uint32_t)(MS_RSV_DEVS << 24 | MS_LANES << 16 | sizeof(void *) << 8 | MS_MAX_DEVICES))

/* Slot state word: 0 when free, else (claim nonce << 8) | MS_SLOT_CLAIMING or MS_SLOT_CLAIMED. */
enum { MS_SLOT_FREE = 0, MS_SLOT_CLAIMING = 1, MS_SLOT_CLAIMED = 2 };
/* What an operation in flight does once it has reached its word ("folding" it). */
enum { MS_OP_SHARE = 1, /* the lane's share of pdev becomes pnew */
       MS_OP_REPAIR = 2 /* every lane of the slot gets share 0 on pdev (a dead slot's share went back) */ };
/* An operation's word, in pdev: the device (low 7 bits), and either nothing more for the
 * device's total used[dev], or MS_PDEV_RSV_BIT with (slot << 4 | lane) above bit 8 for that
 * lane's reserve rsv[dev]. */
#define MS_PDEV_RSV_BIT 0x80u
#define MS_PDEV(dev) ((uint32_t)(dev))
#define MS_PDEV_RSV(dev, slot_lane) ((uint32_t)(dev) | MS_PDEV_RSV_BIT | (uint32_t)(slot_lane) << 8)

/* Every field that one party writes often and another reads sits on a line of its own, in a
 * 128-byte pair of its own (x86 fetches lines in adjacent pairs): a charge moves the device
 * word's line between cores, and nothing else in the common case. */
typedef struct ms_word {
    uint64_t val; /* bytes counted on the device: charged to allocations, and lanes' reserves */
    uint64_t tag; /* seq << 12 | slot << 4 | lane of the last change; 0 before the first */
    char pad[112];
} __attribute__((aligned(128))) ms_word;

/* A lane's reserve on one device: the same {val, tag} as a device word, 16 bytes. */
typedef struct ms_rword {
    uint64_t val; /* bytes of headroom, counted in used[dev] */
    uint64_t tag;
} __attribute__((aligned(16))) ms_rword;

typedef struct ms_lane {
    /* written only by the thread using the lane (or by whoever repairs the dead slot) */
    uint64_t pseq;   /* the last operation announced (sequence numbers only grow, never reused) */
    uint32_t pkind;  /* MS_OP_* */
    uint32_t pdev;   /* MS_PDEV: the device and the word the operation changes */
    uint64_t pdelta; /* added to used[pdev].val (modulo 2^64: a give-back is a negative number) */
    uint64_t pnew;   /* the lane's share of pdev after the operation (MS_OP_SHARE) */
    uint64_t dseq;   /* the last operation finished; pseq != dseq: one is in flight */
    char pad0[24];
    uint64_t share[MS_MAX_DEVICES];
    /* the lane's reserves: written by its owner's charges and frees, and by whoever takes them */
    ms_rword rsv[MS_RSV_DEVS];
    /* a line written by others only, which the owner never touches on its own path: "operation
     * hseq of this lane reached its word" (read by whoever repairs the dead lane) */
    uint64_t hseq;
    char pad1[56];
} __attribute__((aligned(128))) ms_lane;

typedef struct ms_slot {
    uint64_t state;
    int32_t pid; /* as the owner saw itself (informational: liveness is the file lock) */
    char pad[116];
    ms_lane lane[MS_LANES];
} __attribute__((aligned(128))) ms_slot;

typedef struct ms_hdr {
    char magic[8];
    uint32_t version, abi;
    uint64_t file_size;
    uint32_t nslots, ndevices;
    uint32_t nlanes, pad0;
    uint64_t resolved;  /* operations a dead process left in flight, finished or dropped by a survivor */
    uint64_t reclaimed; /* dead slots given back */
    uint64_t clamped;   /* uncharges of more than the process held; totals found below a share */
    uint64_t cap[MS_MAX_DEVICES]; /* last cap charged against per device (read-mostly) */
    char pad1[64];                /* used[] starts on a 128-byte pair of its own */
    ms_word used[MS_MAX_DEVICES];
    ms_slot slot[MS_SLOTS];
} ms_hdr;

/* tests/core/test_region.py edits files at these offsets */
_Static_assert(offsetof(ms_hdr, version) == 8, "layout");
_Static_assert(offsetof(ms_hdr, resolved) == 40, "layout");
_Static_assert(offsetof(ms_hdr, cap) == 64, "layout");
_Static_assert(offsetof(ms_hdr, used) == 128 + 8 * MS_MAX_DEVICES && sizeof(ms_word) == 128, "layout");
_Static_assert(offsetof(ms_hdr, slot) == 128 + 136 * MS_MAX_DEVICES, "layout");
_Static_assert(offsetof(ms_lane, dseq) == 32 && offsetof(ms_lane, share) == 64, "layout");
_Static_assert(offsetof(ms_lane, rsv) == 64 + 8 * MS_MAX_DEVICES && sizeof(ms_rword) == 16, "layout");
_Static_assert(offsetof(ms_lane, hseq) == 64 + 8 * MS_MAX_DEVICES + 16 * MS_RSV_DEVS &&
                   sizeof(ms_lane) == 128 + 8 * MS_MAX_DEVICES + 16 * MS_RSV_DEVS, "layout");
_Static_assert(offsetof(ms_slot, lane) == 128 && sizeof(ms_slot) == 128 + MS_LANES * sizeof(ms_lane), "layout");
_Static_assert(sizeof(ms_hdr) == 128 + 136 * MS_MAX_DEVICES + MS_SLOTS * sizeof(ms_slot), "layout");

#endif
