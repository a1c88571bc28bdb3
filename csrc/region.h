/* Container-wide accounting: a versioned file, mmap'd MAP_SHARED by every process that names
 * it in MPSSHIM_REGION, holding per device the bytes in use and per process its own share.
 *
 * Contract:
 *  - ms_region_charge is an atomic check-and-charge across processes and threads: the sum of
 *    all charges never passes `cap`, however processes race.
 *  - A process that dies (SIGKILL included, even inside a call) has its charges given back the
 *    next time anyone would be refused, or opens the region; nobody deletes files.
 *  - Counters never drift or wrap: charge(x) then uncharge(x) restores used exactly.
 *  - No syscall on the charge/uncharge fast path (target: an alloc+free pair through the shim
 *    costs at most 150 ns more than without it).
 *  - A file with a bad magic, version or size is refused with a clear reason, never "no cap". */
#ifndef MPSSHIM_REGION_H
#define MPSSHIM_REGION_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "limits.h"

typedef struct ms_region ms_region; /* process-local handle */

enum { MS_OK = 0, MS_OVER_CAP = 1, MS_ERROR = -1 };

/* Open or create the region at `path` (creating parent directories is the caller's job).
 * Claims a process slot. 0, or -1 with a one-line reason in err. A new file is created with
 * mode 0666 & ~umask (see ms_region_open_mode for an explicit mode).
 * Opening the same file twice in one process returns the same handle (reference counted, one
 * slot per process). A forked child gets a slot of its own at its first charge. */
int ms_region_open(const char *path, ms_region **out, char *err, size_t errlen);
/* The same, creating a missing file with exactly `mode` (umask ignored), or with 0666 & ~umask
 * for MS_MODE_UMASK. The shim uses 0666 for a region named in MPSSHIM_REGION: it is there to
 * be shared by every process of a container, whatever their UIDs. */
#define MS_MODE_UMASK 0xffffffffu
int ms_region_open_mode(const char *path, unsigned mode, ms_region **out, char *err, size_t errlen);
/* Gives this process's charges back (at the last close of a shared handle); no other thread
 * may still be using the handle. */
void ms_region_close(ms_region *r);

/* Charge `bytes` on device `dev` (0 <= dev < MS_MAX_DEVICES) against `cap`.
 * MS_OK, or MS_OVER_CAP (nothing charged; *in_use says what is in use, after dead processes
 * were reclaimed), or MS_ERROR (corrupted region). */
int ms_region_charge(ms_region *r, int dev, uint64_t cap, uint64_t bytes, uint64_t *in_use);
/* Gives back up to `bytes` of what this process charged on `dev`. Never wraps: more than this
 * process holds is clamped, and the part that could not be given back is returned (0 normally;
 * callers that ignore it may keep calling it as a void function). */
uint64_t ms_region_uncharge(ms_region *r, int dev, uint64_t bytes);
uint64_t ms_region_used(const ms_region *r, int dev);
/* The same after giving back dead processes' charges, if any are counted on `dev` (takes the
 * lock and tests liveness: for memory queries, so a crashed process of the container does not
 * shrink the free memory reported until the next refused charge). */
uint64_t ms_region_used_live(ms_region *r, int dev);

/* Give back the charges of dead processes. Returns how many slots were reclaimed. */
int ms_region_reclaim(ms_region *r);

/* Read-only snapshot for tools (shim.usage() reaches it through the exported mpsshim_usage). */
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

int ms_region_snapshot(const char *path, ms_snapshot *out, char *err, size_t errlen);

/* --- The file (layout version 1; bump MS_LAYOUT_VERSION on any change) ---
 * A header, then MS_SLOTS process slots; the whole file is sizeof(ms_hdr) bytes. Invariant
 * under the mutex: used[d] == the sum of slot[i].used[d] over claimed slots. A slot's owner
 * holds an OFD write lock (F_OFD_SETLK) on the slot's first byte for as long as it lives. */
#define MS_MAGIC "MPSSHMRG"
#define MS_LAYOUT_VERSION 1
#define MS_SLOTS MS_SNAPSHOT_MAX_PROCS
/* Refuses a file written under another ABI (e.g. aarch64, where the mutex is 48 bytes). */
#define MS_ABI ((uint32_t)(sizeof(pthread_mutex_t) << 16 | sizeof(void *) << 8 | MS_MAX_DEVICES))

enum { MS_SLOT_FREE = 0, MS_SLOT_CLAIMED = 1 };

typedef struct ms_slot {
    int32_t pid; /* as the owner saw itself (informational: liveness is the file lock) */
    uint32_t state;
    uint64_t used[MS_MAX_DEVICES];
} __attribute__((aligned(64))) ms_slot;

typedef struct ms_hdr {
    char magic[8];
    uint32_t version, abi;
    uint64_t file_size;
    uint32_t nslots, ndevices;
    uint64_t recoveries; /* EOWNERDEAD recoveries */
    uint64_t reclaimed;  /* dead slots given back */
    uint64_t clamped;    /* uncharges of more than the process held */
    union {
        pthread_mutex_t m; /* robust, process-shared */
        char pad[64];
    } mutex __attribute__((aligned(64)));
    uint64_t used[MS_MAX_DEVICES];
    uint64_t cap[MS_MAX_DEVICES];
    ms_slot slot[MS_SLOTS];
} ms_hdr;

/* tests/core/test_region.py edits files at these offsets */
_Static_assert(offsetof(ms_hdr, version) == 8, "layout");
_Static_assert(offsetof(ms_hdr, recoveries) == 32, "layout");
_Static_assert(offsetof(ms_hdr, used) == 128, "layout");
_Static_assert(sizeof(ms_slot) == 576 && offsetof(ms_slot, state) == 4, "layout");
_Static_assert(sizeof(ms_hdr) == 128 + 2 * 8 * MS_MAX_DEVICES + MS_SLOTS * sizeof(ms_slot), "layout");

#endif
