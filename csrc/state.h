/* The shim's configuration, read once from the environment (first hook call):
 *   MPSSHIM_DISABLE=1                   every hook forwards untouched (also 0/1, true/false, ...)
 *   MPSSHIM_LOG=0..3|error|warn|info|debug   verbosity (default warn)
 *   CUDA_MPS_PINNED_DEVICE_MEM_LIMIT    caps by ordinal or UUID (limits.h); malformed → cuInit
 *                                       fails with CUDA_ERROR_INVALID_VALUE and every
 *                                       allocation is refused, after one line naming it
 *   MPSSHIM_REGION                      accounting file, an absolute path (relative → refused like a
 *                                       malformed limit); default /tmp/mpsshim-<uid>.region, which
 *                                       must belong to this UID; unusable → allocations on capped
 *                                       devices are refused
 *   MPSD_DEVICE_*                       one per mpsd DRA device given to the container; more than
 *                                       one → refused like a malformed limit (one request of one
 *                                       claim per container: docs/dra.md) */
#ifndef MPSSHIM_STATE_H
#define MPSSHIM_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "limits.h"
#include "region.h"

typedef struct ms_state {
    int limits_bad;        /* CUDA_MPS_PINNED_DEVICE_MEM_LIMIT did not parse, MPSSHIM_REGION is relative, or
                              the container has several mpsd devices */
    ms_limits limits;      /* count == 0: nothing capped */
    int limits_by_uuid;    /* some entry is keyed by UUID */
    ms_region *region;     /* NULL when not needed or unusable */
    char region_path[4096];
} ms_state;

/* 1 if MPSSHIM_DISABLE asks for pass-through (cheap; reads only that variable, once). */
int ms_disabled(void);
/* 1 when memory queries report caps: not disabled, and the limits parsed and are not empty
 * (with a malformed limit allocations are refused instead, and queries pass through). */
int ms_caps_reported(void);

/* The configuration (read on first use). */
const ms_state *ms_state_get(void);

/* The region path: $MPSSHIM_REGION if set and non-empty (returns 1), else
 * /tmp/mpsshim-<uid>.region (private to the container's /tmp, never /dev/shm; returns 0). */
int ms_region_path(char *buf, size_t len);

/* The cap of CUDA device `dev` (resolving its UUID through the driver when some limit is
 * keyed by UUID). 1 and *cap when capped, 0 when not, -1 when it cannot be told (then the
 * caller refuses: never uncapped by accident). */
int ms_cap_of_device(int dev, uint64_t *cap);

/* Format a CUDA UUID as "<prefix>-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (prefix GPU or MIG). */
void ms_format_uuid(const unsigned char bytes[16], const char *prefix, char *out, size_t len);

#endif
