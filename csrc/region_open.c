/* Opening, creating and validating the accounting region, its handles across fork, and the
 * read-only snapshot (contract in region.h; the accounting itself, and the design, are in
 * region.c).
 *  - The file is built under a temporary name and published with link(2), which fails if
 *    the name exists: racing first openers never see a half-initialised region.
 *  - Opening the same file twice in one process returns the same handle: a registry keyed by
 *    device and inode, reference counted, one slot per process. */
#include "region_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(sizeof(pthread_mutex_t) <= 64, "pthread_mutex_t fits its pad");

pthread_mutex_t ms_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t ms_once = PTHREAD_ONCE_INIT;
static ms_region *ms_reg_head;

static void ms_layout_fill(ms_hdr *h) {
    h->version = MS_LAYOUT_VERSION;
    h->abi = MS_ABI;
    h->file_size = sizeof(ms_hdr);
    h->nslots = MS_SLOTS;
    h->ndevices = MS_MAX_DEVICES;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy(h->magic, MS_MAGIC, sizeof h->magic);
}

static int ms_layout_check(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    if (memcmp(h->magic, MS_MAGIC, sizeof h->magic) != 0) {
        snprintf(err, errlen, "region %.200s has a bad magic number: not an mpsshim region, or overwritten", path);
        return -1;
    }
    if (h->version != MS_LAYOUT_VERSION) {
        snprintf(err, errlen, "region %.200s has layout version %u; this shim reads only version %d", path,
                 h->version, MS_LAYOUT_VERSION);
        return -1;
    }
    if (h->abi != MS_ABI || h->file_size != sizeof(ms_hdr) || h->nslots != MS_SLOTS ||
        h->ndevices != MS_MAX_DEVICES) {
        snprintf(err, errlen, "region %.200s was written by a shim with another layout (abi %#x, %u slots, %u devices)",
                 path, h->abi, h->nslots, h->ndevices);
        return -1;
    }
    for (int i = 0; i < MS_SLOTS; i++) {
        if (h->slot[i].state != MS_SLOT_FREE && h->slot[i].state != MS_SLOT_CLAIMED) {
            snprintf(err, errlen, "region %.200s is corrupted: process slot %d has state %u", path, i,
                     h->slot[i].state);
            return -1;
        }
    }
    return 0;
}


/* Under the mutex: the invariant; -1 and a reason if the file was corrupted. */
int ms_check_totals(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        uint64_t sum = ms_slot_sum(h, d);
        if (sum != h->used[d]) {
            snprintf(err, errlen, "region %.200s is corrupted: device %d total %llu differs from its processes' sum %llu",
                     path, d, (unsigned long long)h->used[d], (unsigned long long)sum);
            return -1;
        }
    }
    return 0;
}

/* The registry lock is held across fork so a child never inherits it locked by a thread that
 * does not exist in the child, and the child handler can walk the registry. */
static void ms_atfork_prepare(void) { pthread_mutex_lock(&ms_reg_lock); }
static void ms_atfork_parent(void) { pthread_mutex_unlock(&ms_reg_lock); }
/* In the child, each handle gets a descriptor and a mapping of its own (the inherited mapping
 * references the parent's open file description just as the descriptor does, and either would
 * keep the parent's liveness lock alive). The new mapping replaces the old one at the same
 * address; if the file cannot be reopened, a private zero page stands in and the handle is
 * dead in the child (charges there are errors). Only the forking thread runs here. */
static void ms_atfork_child(void) {
    __atomic_add_fetch(&ms_forkgen, 1, __ATOMIC_RELAXED);
    for (ms_region *r = ms_reg_head; r; r = r->next) {
        struct stat st;
        int fd = open(r->path, O_RDWR | O_CLOEXEC);
        void *m = MAP_FAILED;
        if (fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == r->st_dev && st.st_ino == r->st_ino)
            m = mmap(r->hdr, sizeof(ms_hdr), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
        if (m == MAP_FAILED) {
            mmap(r->hdr, sizeof(ms_hdr), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (fd >= 0) close(fd);
            fd = -1;
        }
        if (r->fd >= 0) close(r->fd);
        r->fd = fd;
    }
    pthread_mutex_unlock(&ms_reg_lock);
}
static void ms_init_once(void) { pthread_atfork(ms_atfork_prepare, ms_atfork_parent, ms_atfork_child); }

static void ms_release(int fd, void *map) {
    if (map != NULL && map != MAP_FAILED) munmap(map, sizeof(ms_hdr));
    if (fd >= 0) close(fd);
}

/* Formats a one-line reason into err, releases the fd and mapping if given; returns -1. */
__attribute__((format(printf, 5, 6))) static int ms_fail(char *err, size_t errlen, int fd, void *map,
                                                         const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    ms_release(fd, map);
    return -1;
}

/* mode: the new file's permission bits, or MS_MODE_UMASK for 0666 & ~umask. An explicit mode
 * is set with fchmod before the file is published under its name, so no process ever sees it
 * with other bits. */
static int ms_create(const char *path, unsigned mode, char *err, size_t errlen) {
    static unsigned long seq;
    char tmp[4096];
    int n = snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%lu", path, (long)getpid(),
                     __atomic_add_fetch(&seq, 1, __ATOMIC_RELAXED));
    if (n < 0 || (size_t)n >= sizeof tmp) return ms_fail(err, errlen, -1, NULL, "region path %.200s is too long", path);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666); /* the umask applies */
    if (fd < 0) return ms_fail(err, errlen, -1, NULL, "cannot create region %.200s: %s", tmp, strerror(errno));
    if (mode != MS_MODE_UMASK && fchmod(fd, (mode_t)mode) != 0) {
        ms_fail(err, errlen, fd, NULL, "cannot set mode %o on region %.200s: %s", mode, tmp, strerror(errno));
        unlink(tmp);
        return -1;
    }
    void *map = MAP_FAILED;
    int rc = -1;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (ftruncate(fd, (off_t)sizeof(ms_hdr)) != 0 ||
        (map = mmap(NULL, sizeof(ms_hdr), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        ms_fail(err, errlen, -1, NULL, "cannot size or map region %.200s: %s", tmp, strerror(errno));
    } else if ((rc = pthread_mutex_init(&((ms_hdr *)map)->mutex.m, &a)) != 0) {
        ms_fail(err, errlen, -1, NULL, "cannot initialise the region lock: %s", strerror(rc));
        rc = -1;
    } else {
        ms_layout_fill(map);
        /* link(2) fails if the name exists: then another process won the race, and its file
         * (complete, like ours) is the one everybody opens. */
        if (link(tmp, path) != 0 && errno != EEXIST)
            rc = ms_fail(err, errlen, -1, NULL, "cannot publish region %.200s: %s", path, strerror(errno));
    }
    pthread_mutexattr_destroy(&a);
    unlink(tmp);
    ms_release(fd, map);
    return rc;
}

/* Open (creating if missing when writable) and validate; the fd and mapping on success. */
static int ms_map(const char *path, int writable, unsigned mode, int *fdp, ms_hdr **hp, char *err, size_t errlen) {
    int fd = -1;
    for (int attempt = 0; fd < 0; attempt++) {
        fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
        if (fd >= 0) break;
        if (errno != ENOENT || !writable || attempt == 3)
            return ms_fail(err, errlen, -1, NULL, "cannot open region %.200s: %s", path, strerror(errno));
        if (ms_create(path, mode, err, errlen) != 0) return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return ms_fail(err, errlen, fd, NULL, "region %.200s is not a regular file", path);
    if ((uint64_t)st.st_size != sizeof(ms_hdr))
        return ms_fail(err, errlen, fd, NULL,
                       "region %.200s is %lld bytes, expected %zu (truncated, or not this shim's layout %d)", path,
                       (long long)st.st_size, sizeof(ms_hdr), MS_LAYOUT_VERSION);
    void *map = mmap(NULL, sizeof(ms_hdr), PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        return ms_fail(err, errlen, fd, NULL, "cannot map region %.200s: %s", path, strerror(errno));
    if (ms_layout_check(map, path, err, errlen) != 0) {
        ms_release(fd, map);
        return -1;
    }
    *fdp = fd;
    *hp = map;
    return 0;
}

static ms_region *ms_reg_find(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return NULL;
    for (ms_region *r = ms_reg_head; r; r = r->next)
        if (r->st_dev == st.st_dev && r->st_ino == st.st_ino) return r;
    return NULL;
}

/* Under the region mutex, for a new handle: check, reclaim, claim. 0 or -1 with a reason. */
static int ms_join_locked(ms_region *r, const char *path, char *err, size_t errlen) {
    if (ms_check_totals(r->hdr, path, err, errlen) != 0) return -1;
    ms_reclaim_locked(r);
    errno = 0;
    if (ms_claim_locked(r) == 0) return 0;
    if (errno != 0 && errno != EAGAIN && errno != EACCES)
        return ms_fail(err, errlen, -1, NULL, "cannot lock a process slot in region %.200s: %s (POSIX record locks needed)",
                       path, strerror(errno));
    return ms_fail(err, errlen, -1, NULL, "region %.200s: all %d process slots are held by live processes", path,
                   MS_SLOTS);
}

int ms_region_open(const char *path, ms_region **out, char *err, size_t errlen) {
    return ms_region_open_mode(path, MS_MODE_UMASK, out, err, errlen);
}

int ms_region_open_mode(const char *path, unsigned mode, ms_region **out, char *err, size_t errlen) {
    char dummy[1];
    if (err == NULL || errlen == 0) err = dummy, errlen = sizeof dummy;
    err[0] = '\0';
    if (path == NULL || path[0] == '\0' || out == NULL) return ms_fail(err, errlen, -1, NULL, "no region path given");
    pthread_once(&ms_once, ms_init_once);
    pthread_mutex_lock(&ms_reg_lock);
    ms_region *r = ms_reg_find(path);
    int rc = 0;
    if (r != NULL) {
        r->refs++;
    } else if ((r = calloc(1, sizeof *r)) == NULL) {
        rc = ms_fail(err, errlen, -1, NULL, "out of memory opening region %.200s", path);
    } else if (ms_map(path, 1, mode, &r->fd, &r->hdr, err, errlen) != 0) {
        rc = -1;
    } else {
        struct stat st;
        fstat(r->fd, &st);
        *r = (ms_region){.next = ms_reg_head, .refs = 1, .fd = r->fd, .path = strdup(path), .st_dev = st.st_dev,
                         .st_ino = st.st_ino, .hdr = r->hdr, .slot = -1, .forkgen = ~0UL};
        int lrc = r->path ? ms_lock(r) : 0;
        if (r->path == NULL) {
            rc = ms_fail(err, errlen, -1, NULL, "out of memory opening region %.200s", path);
        } else if (lrc != 0) {
            rc = ms_fail(err, errlen, -1, NULL, "region %.200s: its lock is unusable (%s); the file is corrupted",
                         path, strerror(lrc));
        } else {
            rc = ms_join_locked(r, path, err, errlen);
            pthread_mutex_unlock(&r->hdr->mutex.m);
        }
        if (rc == 0) ms_reg_head = r;
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
    for (ms_region **p = &ms_reg_head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            break;
        }
    pthread_mutex_unlock(&ms_reg_lock);
    if (ms_bound(r) && ms_lock(r) == 0) { /* a forked child never touches its parent's slot */
        ms_release_slot(r->hdr, r->slot);
        ms_unlock(r);
    }
    ms_release(r->fd, r->hdr); /* closing drops the liveness lock */
    free(r->path);
    free(r);
}

/* --- read-only snapshot for tools --- */

int ms_region_snapshot(const char *path, ms_snapshot *out, char *err, size_t errlen) {
    char dummy[1];
    if (err == NULL || errlen == 0) err = dummy, errlen = sizeof dummy;
    err[0] = '\0';
    if (path == NULL || out == NULL) return ms_fail(err, errlen, -1, NULL, "no region path given");
    memset(out, 0, sizeof *out);
    /* A descriptor of our own (closing it drops no OFD lock), so even this process's own slot,
     * held through another descriptor, is tested like any other. */
    int fd;
    ms_hdr *h;
    if (ms_map(path, 0, MS_MODE_UMASK, &fd, &h, err, errlen) != 0) return -1;
    out->version = h->version;
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        out->cap[d] = ms_ld(&h->cap[d]);
        out->used[d] = ms_ld(&h->used[d]);
    }
    for (int i = 0; i < MS_SLOTS && out->nprocs < MS_SNAPSHOT_MAX_PROCS; i++) {
        if (__atomic_load_n(&h->slot[i].state, __ATOMIC_ACQUIRE) != MS_SLOT_CLAIMED) continue;
        ms_proc_usage *p = &out->procs[out->nprocs++];
        p->pid = h->slot[i].pid;
        p->alive = ms_slot_alive(fd, i);
        for (int d = 0; d < MS_MAX_DEVICES; d++) p->used[d] = ms_ld(&h->slot[i].used[d]);
    }
    ms_release(fd, h);
    return 0;
}
