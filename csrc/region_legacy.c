/* Reading a layout-2 region (the shim before per-lane reserves) for tools: mpsd's metrics and
 * `python -m shim usage` must report the containers still running that shim after an mpsd
 * upgrade (docs/shim.md, "Upgrades"). Read-only and never mapped: the file is read with pread
 * into memory of our own, so a container truncating it meanwhile shortens the read (refused)
 * instead of raising SIGBUS. This library never charges a layout-2 region: processes that share
 * one all run the layout-2 shim, which mpsd keeps installed under the name they preload.
 *
 * Layout 2, frozen (csrc/region.h before layout 3): the same header and device words as
 * layout 3; a lane is {pseq, pkind, pdev, pdelta, pnew, dseq, pad to 64, share[64], hseq, pad}
 * (640 bytes), with no reserves; a slot is 128 bytes then 16 lanes. */
#include "region_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The header and device words, as in layout 3 (checked below against ms_hdr's offsets). */
typedef struct ms2_head {
    char magic[8];
    uint32_t version, abi;
    uint64_t file_size;
    uint32_t nslots, ndevices;
    uint32_t nlanes, pad0;
    uint64_t resolved, reclaimed, clamped;
    uint64_t cap[MS_MAX_DEVICES];
    char pad1[64];
    ms_word used[MS_MAX_DEVICES];
} ms2_head;
_Static_assert(offsetof(ms2_head, cap) == offsetof(ms_hdr, cap) && offsetof(ms2_head, used) == offsetof(ms_hdr, used) &&
                   sizeof(ms2_head) == offsetof(ms_hdr, slot), "layout 2");

#define MS2_LANE_SIZE (128 + 8 * MS_MAX_DEVICES)
#define MS2_LANE_SHARE 64
#define MS2_SLOT_SIZE (128 + MS_LANES * MS2_LANE_SIZE)
#define MS2_SLOTS_OFF sizeof(ms2_head)
#define MS2_SIZE (MS2_SLOTS_OFF + (size_t)MS_SLOTS * MS2_SLOT_SIZE)
_Static_assert(MS2_SIZE % 128 == 0, "layout 2");
#define MS2_ABI ((uint32_t)(MS_LANES << 16 | sizeof(void *) << 8 | MS_MAX_DEVICES))

size_t ms_region_file_size(uint32_t layout) {
    return layout == MS_LAYOUT_VERSION ? sizeof(ms_hdr) : layout == 2 ? MS2_SIZE : 0;
}

static uint64_t ms2_u64(const unsigned char *file, size_t off) {
    uint64_t v;
    memcpy(&v, file + off, sizeof v);
    return v;
}

/* Fill `out` from the file's bytes: in use per device from its word, each claimed slot's share
 * as the sum of its lanes (clamped to the device's total, as a racing give-back may be read
 * half-way), liveness tested on lock_fd. */
static void ms2_fill(const ms2_head *head, const unsigned char *file, int lock_fd, ms_snapshot *out) {
    out->version = head->version;
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        out->cap[d] = head->cap[d];
        out->used[d] = head->used[d].val;
    }
    for (int i = 0; i < MS_SLOTS && out->nprocs < MS_SNAPSHOT_MAX_PROCS; i++) {
        size_t slot = MS2_SLOTS_OFF + (size_t)i * MS2_SLOT_SIZE;
        if ((ms2_u64(file, slot) & 0xff) != MS_SLOT_CLAIMED) continue;
        ms_proc_usage *p = &out->procs[out->nprocs++];
        memcpy(&p->pid, file + slot + 8, sizeof p->pid);
        p->alive = ms_locked_by_other(lock_fd, slot);
        for (int d = 0; d < MS_MAX_DEVICES; d++) {
            uint64_t share = 0;
            for (int k = 0; k < MS_LANES; k++)
                share += ms2_u64(file, slot + 128 + (size_t)k * MS2_LANE_SIZE + MS2_LANE_SHARE + 8 * (size_t)d);
            p->used[d] = share > out->used[d] ? out->used[d] : share;
        }
    }
}

int ms_legacy_snapshot(int fd, int lock_fd, ms_snapshot *out, const char *path, char *err, size_t errlen) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return ms_fail(err, errlen, -1, NULL, "region %.200s is not a regular file", path);
    if ((uint64_t)st.st_size != MS2_SIZE)
        return ms_fail(err, errlen, -1, NULL, "region %.200s is %lld bytes, expected %zu (truncated, or not layout 2)",
                       path, (long long)st.st_size, (size_t)MS2_SIZE);
    unsigned char *file = malloc(MS2_SIZE);
    ms2_head *head = aligned_alloc(128, sizeof *head); /* a copy: ms_word's alignment */
    size_t got = 0;
    while (file != NULL && head != NULL && got < MS2_SIZE) {
        ssize_t n = pread(fd, file + got, MS2_SIZE - got, (off_t)got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    int rc = 0;
    if (file == NULL || head == NULL)
        rc = ms_fail(err, errlen, -1, NULL, "region %.200s: out of memory", path);
    else if (got != MS2_SIZE)
        rc = ms_fail(err, errlen, -1, NULL, "region %.200s is corrupted: shrunk while it was read", path);
    else if (memcpy(head, file, sizeof *head), memcmp(head->magic, MS_MAGIC, sizeof head->magic) != 0 || head->version != 2 || head->abi != MS2_ABI ||
             head->file_size != MS2_SIZE || head->nslots != MS_SLOTS || head->ndevices != MS_MAX_DEVICES ||
             head->nlanes != MS_LANES)
        rc = ms_fail(err, errlen, -1, NULL, "region %.200s was written by a shim with another layout (abi %#x, %u slots, "
                     "%u devices)", path, head->abi, head->nslots, head->ndevices);
    else
        ms2_fill(head, file, lock_fd, out);
    free(file);
    free(head);
    return rc;
}
