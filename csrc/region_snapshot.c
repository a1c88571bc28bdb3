/* The read-only snapshot for tools (region.h; shim.usage() reaches it through mpsshim_usage):
 * maps the file on a descriptor of its own and claims no slot. A layout-2 file (the shim
 * before reserves, still preloaded by containers started before an mpsd upgrade) is read by
 * region_legacy.c instead. */
#include "region_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>

int ms_region_snapshot(const char *path, ms_snapshot *out, char *err, size_t errlen) {
    return ms_region_snapshot_ex(path, 0, out, err, errlen);
}

static int ms_snapshot_of(int fd, int lock_fd, ms_hdr *h, ms_snapshot *out, const char *path, char *err,
                          size_t errlen);

/* A layout-2 file read (region_legacy.c): close its descriptor, pass the result on. */
static int ms_legacy_done(int fd, int rc) {
    ms_release(fd, NULL);
    return rc;
}

int ms_region_snapshot_ex(const char *path, unsigned flags, ms_snapshot *out, char *err, size_t errlen) {
    char dummy[1];
    if (err == NULL || errlen == 0) err = dummy, errlen = sizeof dummy;
    err[0] = '\0';
    if (path == NULL || out == NULL) return ms_fail(err, errlen, -1, NULL, "no region path given");
    memset(out, 0, sizeof *out);
    /* A descriptor of our own (closing it drops no OFD lock), so even this process's own slot,
     * held through another descriptor, is tested like any other. */
    int fd;
    ms_hdr *h;
    int rc = ms_map(path, 0, MS_MODE_UMASK, flags | MS_MAP_LEGACY, &fd, &h, err, errlen);
    if (rc < 0) return -1;
    if (rc == (int)MS_MAP_LEGACY) return ms_legacy_done(fd, ms_legacy_snapshot(fd, fd, out, path, err, errlen));
    return ms_snapshot_of(fd, fd, h, out, path, err, errlen);
}

int ms_region_snapshot_fd(int fd, int lock_fd, ms_snapshot *out, char *err, size_t errlen) {
    char dummy[1], name[32];
    if (err == NULL || errlen == 0) err = dummy, errlen = sizeof dummy;
    err[0] = '\0';
    if (out == NULL) return ms_fail(err, errlen, -1, NULL, "no snapshot given");
    memset(out, 0, sizeof *out);
    snprintf(name, sizeof name, "/proc/self/fd/%d", fd);
    /* The caller's descriptor stays open and its own: a duplicate is checked, mapped and closed. */
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return ms_fail(err, errlen, -1, NULL, "region %s: %s", name, strerror(errno));
    ms_hdr *h;
    int rc = ms_map_fd(own, name, 0, MS_MAP_LEGACY, &h, err, errlen);
    if (rc < 0) return -1;
    if (rc == (int)MS_MAP_LEGACY)
        return ms_legacy_done(own, ms_legacy_snapshot(own, lock_fd >= 0 ? lock_fd : own, out, name, err, errlen));
    return ms_snapshot_of(own, lock_fd >= 0 ? lock_fd : own, h, out, name, err, errlen);
}

/* Fill `out` from the mapped region, testing liveness on `lock_fd` (the region file itself:
 * `fd` may be a private copy of it, which holds no locks), and release fd and mapping. -1 and
 * a reason (nothing in `out`) if the file shrank while it was read (region_guard.c). */
static int ms_snapshot_of(int fd, int lock_fd, ms_hdr *h, ms_snapshot *out, const char *path, char *err,
                          size_t errlen) {
    out->version = h->version;
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        out->cap[d] = ms_ld(&h->cap[d]);
        uint64_t rsv = ms_region_rsv(h, d), used = ms_ld(&h->used[d].val);
        out->used[d] = used > rsv ? used - rsv : 0; /* in use: reserves are free to whoever charges */
    }
    for (int i = 0; i < MS_SLOTS && out->nprocs < MS_SNAPSHOT_MAX_PROCS; i++) {
        uint64_t st = __atomic_load_n(&h->slot[i].state, __ATOMIC_ACQUIRE);
        if ((st & 0xff) != MS_SLOT_CLAIMED) continue;
        ms_proc_usage *p = &out->procs[out->nprocs++];
        p->pid = h->slot[i].pid;
        p->alive = ms_locked_by_other(lock_fd, MS_SLOT_OFF(i));
        for (int d = 0; d < MS_MAX_DEVICES; d++) {
            uint64_t share = ms_slot_share(&h->slot[i], d);
            p->used[d] = share > out->used[d] ? out->used[d] : share; /* a racing give-back, read mid-way */
        }
    }
    if (!ms_intact(h)) {
        memset(out, 0, sizeof *out);
        return ms_fail(err, errlen, fd, h, "region %.200s is corrupted: shrunk or overwritten while it was read", path);
    }
    ms_release(fd, h);
    return 0;
}
