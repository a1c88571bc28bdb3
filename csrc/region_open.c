/* Opening, creating and validating the accounting region, its handles across fork, and the
 * read-only snapshot (contract in region.h; the accounting itself, and the design, are in
 * region.c).
 *  - The file is built under a temporary name, preallocated (posix_fallocate: a full disk is a
 *    refusal here, never a SIGBUS when a later process first writes its slot), and published
 *    with link(2), which fails if the name exists: racing first openers never see a
 *    half-initialised region. An existing file with unallocated blocks (made by someone else)
 *    is allocated before it is mapped, or refused.
 *  - Files are opened as untrusted: O_NOFOLLOW (a symbolic link is refused), O_NONBLOCK (a
 *    FIFO is refused, not waited on), then a regular file of exactly the layout's size; the
 *    header's magic and version are read before the size is judged, so an older layout gets
 *    its own one-line refusal.
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
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

pthread_mutex_t ms_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t ms_once = PTHREAD_ONCE_INIT;
static ms_region *ms_reg_head;

static void ms_layout_fill(ms_hdr *h) {
    h->version = MS_LAYOUT_VERSION;
    h->abi = MS_ABI;
    h->file_size = sizeof(ms_hdr);
    h->nslots = MS_SLOTS;
    h->ndevices = MS_MAX_DEVICES;
    h->nlanes = MS_LANES;
    uint64_t magic;
    memcpy(&magic, MS_MAGIC, sizeof magic);
    __atomic_store_n((uint64_t *)(void *)h->magic, magic, __ATOMIC_RELEASE); /* last: the header is whole */
}

/* Magic and version, from the first bytes (before the size is judged). */
static int ms_version_check(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    if (memcmp(h->magic, MS_MAGIC, sizeof h->magic) != 0) {
        snprintf(err, errlen, "region %.200s has a bad magic number: not an mpsshim region, or overwritten", path);
        return -1;
    }
    if (h->version != MS_LAYOUT_VERSION) {
        snprintf(err, errlen,
                 "region %.200s has layout version %u; this shim reads only version %d (a region of another "
                 "shim version: remove it once no process uses it)",
                 path, h->version, MS_LAYOUT_VERSION);
        return -1;
    }
    return 0;
}

static int ms_layout_check(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    if (ms_version_check(h, path, err, errlen) != 0) return -1;
    if (h->abi != MS_ABI || h->file_size != sizeof(ms_hdr) || h->nslots != MS_SLOTS ||
        h->ndevices != MS_MAX_DEVICES || h->nlanes != MS_LANES) {
        snprintf(err, errlen, "region %.200s was written by a shim with another layout (abi %#x, %u slots, %u devices)",
                 path, h->abi, h->nslots, h->ndevices);
        return -1;
    }
    for (int i = 0; i < MS_SLOTS; i++) {
        uint64_t st = __atomic_load_n(&h->slot[i].state, __ATOMIC_RELAXED);
        if ((st & 0xff) > MS_SLOT_CLAIMED || (st != 0 && (st >> 8) == 0)) {
            snprintf(err, errlen, "region %.200s is corrupted: process slot %d has state %#llx", path, i,
                     (unsigned long long)st);
            return -1;
        }
    }
    return 0;
}

/* The invariant, per device, where it can be told without a lock: no operation in flight on
 * the device, and its word unchanged while the slots were summed (one pass over the file). */
int ms_check_totals(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    uint64_t tag[MS_MAX_DEVICES], val[MS_MAX_DEVICES], sum[MS_MAX_DEVICES] = {0};
    char busy[MS_MAX_DEVICES] = {0};
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        tag[d] = __atomic_load_n(&h->used[d].tag, __ATOMIC_ACQUIRE);
        val[d] = ms_ld(&h->used[d].val);
    }
    for (int i = 0; i < MS_SLOTS; i++)
        for (int k = 0; k < MS_LANES; k++) {
            const ms_lane *L = &h->slot[i].lane[k];
            uint32_t pdev = __atomic_load_n(&L->pdev, __ATOMIC_RELAXED);
            if (ms_ld(&L->pseq) != ms_ld(&L->dseq)) {
                if (pdev >= MS_MAX_DEVICES) return 0; /* in flight on a device we cannot tell */
                busy[pdev] = 1;
            }
            for (int d = 0; d < MS_MAX_DEVICES; d++) sum[d] += ms_ld(&L->share[d]);
        }
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        if (busy[d] || __atomic_load_n(&h->used[d].tag, __ATOMIC_ACQUIRE) != tag[d] || ms_ld(&h->used[d].val) != val[d])
            continue;
        if (sum[d] != val[d]) {
            snprintf(err, errlen, "region %.200s is corrupted: device %d total %llu differs from its processes' sum %llu",
                     path, d, (unsigned long long)val[d], (unsigned long long)sum[d]);
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
 * dead in the child (charges there are errors). Only the forking thread runs here: the
 * handle's lanes, process-local locks and holdings start afresh. */
static void ms_atfork_child(void) {
    __atomic_add_fetch(&ms_forkgen, 1, __ATOMIC_RELAXED);
    for (ms_region *r = ms_reg_head; r; r = r->next) {
        struct stat st;
        int fd = open(r->path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
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
        r->id = ms_new_id();
        r->lanes_taken = 0;
        memset(r->held, 0, sizeof r->held);
        pthread_mutex_init(&r->shared_lane, NULL);
        pthread_mutex_init(&r->reclaim_lock, NULL);
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
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666); /* the umask applies */
    if (fd < 0) return ms_fail(err, errlen, -1, NULL, "cannot create region %.200s: %s", tmp, strerror(errno));
    void *map = MAP_FAILED;
    int rc = -1, e;
    if (mode != MS_MODE_UMASK && fchmod(fd, (mode_t)mode) != 0) {
        ms_fail(err, errlen, -1, NULL, "cannot set mode %o on region %.200s: %s", mode, tmp, strerror(errno));
    } else if ((e = posix_fallocate(fd, 0, (off_t)sizeof(ms_hdr))) != 0) {
        ms_fail(err, errlen, -1, NULL, "cannot preallocate region %.200s (%zu bytes): %s", path, sizeof(ms_hdr),
                strerror(e));
    } else if ((map = mmap(NULL, sizeof(ms_hdr), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        ms_fail(err, errlen, -1, NULL, "cannot map region %.200s: %s", tmp, strerror(errno));
    } else {
        ms_layout_fill(map);
        rc = 0;
        /* link(2) fails if the name exists: then another process won the race, and its file
         * (complete, like ours) is the one everybody opens. */
        if (link(tmp, path) != 0 && errno != EEXIST)
            rc = ms_fail(err, errlen, -1, NULL, "cannot publish region %.200s: %s", path, strerror(errno));
    }
    unlink(tmp);
    ms_release(fd, map);
    return rc;
}

/* Open (creating if missing when writable) and validate; the fd and mapping on success. */
static int ms_map_fd(int fd, const char *path, int writable, unsigned flags, ms_hdr **hp, char *err, size_t errlen);

static int ms_map(const char *path, int writable, unsigned mode, unsigned flags, int *fdp, ms_hdr **hp, char *err,
                  size_t errlen) {
    int fd = -1;
    for (int attempt = 0; fd < 0; attempt++) {
        fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0) break;
        if (errno == ELOOP)
            return ms_fail(err, errlen, -1, NULL, "region %.200s is a symbolic link: refused", path);
        if (errno != ENOENT || !writable || attempt == 3)
            return ms_fail(err, errlen, -1, NULL, "cannot open region %.200s: %s", path, strerror(errno));
        if (ms_create(path, mode, err, errlen) != 0) return -1;
    }
    if (ms_map_fd(fd, path, writable, flags, hp, err, errlen) != 0) return -1; /* fd closed */
    *fdp = fd;
    return 0;
}

/* Check and map the open region `fd` (named `path` in messages); on failure fd is closed. */
static int ms_map_fd(int fd, const char *path, int writable, unsigned flags, ms_hdr **hp, char *err, size_t errlen) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return ms_fail(err, errlen, fd, NULL, "region %.200s is not a regular file", path);
    if ((flags & MS_OPEN_OWNED) && st.st_uid != geteuid())
        return ms_fail(err, errlen, fd, NULL,
                       "region %.200s belongs to uid %u, not to this process's uid %u: refused (remove it, or set "
                       "MPSSHIM_REGION)",
                       path, (unsigned)st.st_uid, (unsigned)geteuid());
    ms_hdr head;
    ssize_t got = pread(fd, &head, offsetof(ms_hdr, cap), 0);
    if (got == (ssize_t)offsetof(ms_hdr, cap) && ms_version_check(&head, path, err, errlen) != 0) {
        ms_release(fd, NULL);
        return -1;
    }
    if ((uint64_t)st.st_size != sizeof(ms_hdr))
        return ms_fail(err, errlen, fd, NULL,
                       "region %.200s is %lld bytes, expected %zu (truncated, or not this shim's layout %d)", path,
                       (long long)st.st_size, sizeof(ms_hdr), MS_LAYOUT_VERSION);
    /* Someone else's sparse file: allocate it now (fallocate(2) itself: glibc's fallback for
     * filesystems without it writes bytes into the live file), or refuse it on a full disk. */
    if (writable && (uint64_t)st.st_blocks * 512 < sizeof(ms_hdr) && fallocate(fd, 0, 0, (off_t)sizeof(ms_hdr)) != 0 &&
        errno != EOPNOTSUPP)
        return ms_fail(err, errlen, fd, NULL, "cannot preallocate region %.200s (%zu bytes): %s", path,
                       sizeof(ms_hdr), strerror(errno));
    void *map = mmap(NULL, sizeof(ms_hdr), PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        return ms_fail(err, errlen, fd, NULL, "cannot map region %.200s: %s", path, strerror(errno));
    if (ms_layout_check(map, path, err, errlen) != 0) {
        ms_release(fd, map);
        return -1;
    }
    *hp = map;
    return 0;
}

static ms_region *ms_reg_find(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return NULL;
    for (ms_region *r = ms_reg_head; r; r = r->next)
        if (r->st_dev == st.st_dev && r->st_ino == st.st_ino) return r;
    return NULL;
}

ms_region *ms_reg_by_id(unsigned long id) {
    for (ms_region *r = ms_reg_head; r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

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
    if (ms_claim(r) == 0) return 0;
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
    pthread_once(&ms_once, ms_init_once);
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
        *r = (ms_region){.next = ms_reg_head, .refs = 1, .fd = r->fd, .path = strdup(path), .st_dev = st.st_dev,
                         .st_ino = st.st_ino, .hdr = r->hdr, .slot = -1, .forkgen = ~0UL, .nonce = ms_nonce(),
                         .id = ms_new_id()};
        pthread_mutex_init(&r->shared_lane, NULL);
        pthread_mutex_init(&r->reclaim_lock, NULL);
        if (r->path == NULL) rc = ms_fail(err, errlen, -1, NULL, "out of memory opening region %.200s", path);
        else rc = ms_join(r, path, err, errlen);
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
    if (ms_bound(r)) ms_release_own(r); /* a forked child never touches its parent's slot */
    ms_release(r->fd, r->hdr);          /* closing drops the liveness lock */
    pthread_mutex_destroy(&r->shared_lane);
    pthread_mutex_destroy(&r->reclaim_lock);
    free(r->path);
    free(r);
}

/* --- read-only snapshot for tools --- */

int ms_region_snapshot(const char *path, ms_snapshot *out, char *err, size_t errlen) {
    return ms_region_snapshot_ex(path, 0, out, err, errlen);
}

static void ms_snapshot_of(int fd, int lock_fd, ms_hdr *h, ms_snapshot *out);

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
    if (ms_map(path, 0, MS_MODE_UMASK, flags, &fd, &h, err, errlen) != 0) return -1;
    ms_snapshot_of(fd, fd, h, out);
    return 0;
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
    if (ms_map_fd(own, name, 0, 0, &h, err, errlen) != 0) return -1;
    ms_snapshot_of(own, lock_fd >= 0 ? lock_fd : own, h, out);
    return 0;
}

/* Fill `out` from the mapped region, testing liveness on `lock_fd` (the region file itself:
 * `fd` may be a private copy of it, which holds no locks), and release fd and mapping. */
static void ms_snapshot_of(int fd, int lock_fd, ms_hdr *h, ms_snapshot *out) {
    out->version = h->version;
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        out->cap[d] = ms_ld(&h->cap[d]);
        out->used[d] = ms_ld(&h->used[d].val);
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
    ms_release(fd, h);
}
