/* Opening and closing a process's handle on a region (contract in region.h): the file is
 * mapped and checked (region_map.c), dead processes' slots are reclaimed and a slot claimed
 * (region_slots.c).
 *  - Opening the same file twice in one process returns the same handle: a registry keyed by
 *    device and inode, reference counted, one slot per process (region_handles.c). */
#include "region_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint64_t ms_nonce(void) {
    uint64_t n = 0;
    if (getrandom(&n, sizeof n, GRND_NONBLOCK) != (ssize_t)sizeof n) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        n = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)&ts;
    }
    n &= (1ull << 56) - 1;
    return n ? n : 1;
}

/* For a new handle: check, reclaim, claim. 0 or -1 with a reason. */
static int ms_join(ms_region *r, const char *path, char *err, size_t errlen) {
    if (ms_check_totals(r->hdr, path, err, errlen) != 0) return -1;
    ms_reclaim(r);
    if (ms_claim(r) == 0) {
        if (ms_intact(r->hdr)) return 0;
        ms_release_own(r);
        return ms_fail(err, errlen, -1, NULL, "region %.200s is corrupted: shrunk or overwritten while it was opened",
                       path);
    }
    if (errno != 0 && errno != EAGAIN && errno != EACCES)
        return ms_fail(err, errlen, -1, NULL, "cannot lock a process slot in region %.200s: %s (OFD record locks needed)",
                       path, strerror(errno));
    return ms_fail(err, errlen, -1, NULL, "region %.200s: all %d process slots are held by live processes", path,
                   MS_SLOTS);
}

int ms_region_open(const char *path, ms_region **out, char *err, size_t errlen) {
    return ms_region_open_ex(path, MS_MODE_UMASK, 0, out, err, errlen);
}

int ms_region_open_mode(const char *path, unsigned mode, ms_region **out, char *err, size_t errlen) {
    return ms_region_open_ex(path, mode, 0, out, err, errlen);
}

int ms_region_open_ex(const char *path, unsigned mode, unsigned flags, ms_region **out, char *err, size_t errlen) {
    char dummy[1];
    if (err == NULL || errlen == 0) err = dummy, errlen = sizeof dummy;
    err[0] = '\0';
    if (path == NULL || path[0] == '\0' || out == NULL) return ms_fail(err, errlen, -1, NULL, "no region path given");
    ms_handles_init();
    pthread_mutex_lock(&ms_reg_lock);
    ms_region *r = ms_reg_find(path);
    int rc = 0;
    if (r != NULL) {
        r->refs++;
    } else if ((r = calloc(1, sizeof *r)) == NULL) {
        rc = ms_fail(err, errlen, -1, NULL, "out of memory opening region %.200s", path);
    } else if (ms_map(path, 1, mode, flags, &r->fd, &r->hdr, err, errlen) != 0) {
        rc = -1;
    } else {
        struct stat st;
        fstat(r->fd, &st);
        *r = (ms_region){.refs = 1, .fd = r->fd, .path = strdup(path), .st_dev = st.st_dev,
                         .st_ino = st.st_ino, .hdr = r->hdr, .slot = -1, .forkgen = ~0UL, .nonce = ms_nonce(),
                         .id = ms_new_id()};
        pthread_mutex_init(&r->shared_lane, NULL);
        pthread_mutex_init(&r->reclaim_lock, NULL);
        if (r->path == NULL) rc = ms_fail(err, errlen, -1, NULL, "out of memory opening region %.200s", path);
        else rc = ms_join(r, path, err, errlen);
        if (rc == 0) ms_reg_add(r);
        else ms_release(r->fd, r->hdr), free(r->path);
    }
    if (rc != 0) free(r), r = NULL;
    pthread_mutex_unlock(&ms_reg_lock);
    *out = r;
    return rc;
}

void ms_region_close(ms_region *r) {
    if (r == NULL) return;
    pthread_mutex_lock(&ms_reg_lock);
    if (--r->refs > 0) {
        pthread_mutex_unlock(&ms_reg_lock);
        return;
    }
    ms_reg_remove(r);
    pthread_mutex_unlock(&ms_reg_lock);
    if (ms_bound(r)) ms_release_own(r); /* a forked child never touches its parent's slot */
    ms_release(r->fd, r->hdr);          /* closing drops the liveness lock */
    pthread_mutex_destroy(&r->shared_lane);
    pthread_mutex_destroy(&r->reclaim_lock);
    free(r->path);
    free(r);
}
