/* Opening, creating, validating and mapping a region file (contract in region.h; the design
 * of the accounting is in region_ops.h).
 *  - The file is built under a temporary name, preallocated (posix_fallocate: a full disk is a
 *    refusal here, never a SIGBUS when a later process first writes its slot), and published
 *    with link(2), which fails if the name exists: racing first openers never see a
 *    half-initialised region. An existing file with unallocated blocks (made by someone else)
 *    is allocated before it is mapped, or refused.
 *  - Files are opened as untrusted: O_NOFOLLOW (a symbolic link is refused), O_NONBLOCK (a
 *    FIFO is refused, not waited on), then a regular file of exactly the layout's size; the
 *    header's magic and version are read before the size is judged, so an older layout gets
 *    its own one-line refusal. */
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

void ms_release(int fd, void *map) {
    if (map != NULL && map != MAP_FAILED) ms_guard_remove(map), munmap(map, sizeof(ms_hdr));
    if (fd >= 0) close(fd);
}

/* mmap of the region on fd, guarded against the file shrinking (region_guard.c); MAP_FAILED
 * with errno set if either fails. */
static void *ms_map_guarded(int fd, int prot) {
    void *map = mmap(NULL, sizeof(ms_hdr), prot, MAP_SHARED, fd, 0);
    if (map != MAP_FAILED && ms_guard_add(map) != 0) {
        munmap(map, sizeof(ms_hdr));
        errno = EMFILE;
        map = MAP_FAILED;
    }
    return map;
}

int ms_fail(char *err, size_t errlen, int fd, void *map, const char *fmt, ...) {
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
    } else if ((map = ms_map_guarded(fd, PROT_READ | PROT_WRITE)) == MAP_FAILED) {
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

int ms_map(const char *path, int writable, unsigned mode, unsigned flags, int *fdp, ms_hdr **hp, char *err,
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
    int rc = ms_map_fd(fd, path, writable, flags, hp, err, errlen);
    if (rc < 0) return -1; /* fd closed */
    *fdp = fd;
    return rc;
}

int ms_map_fd(int fd, const char *path, int writable, unsigned flags, ms_hdr **hp, char *err, size_t errlen) {
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
    if ((flags & MS_MAP_LEGACY) && got == (ssize_t)offsetof(ms_hdr, cap) &&
        memcmp(head.magic, MS_MAGIC, sizeof head.magic) == 0 && head.version == 2)
        return MS_MAP_LEGACY; /* fd open, nothing mapped: the caller reads layout 2 itself */
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
    void *map = ms_map_guarded(fd, PROT_READ | (writable ? PROT_WRITE : 0));
    if (map == MAP_FAILED)
        return ms_fail(err, errlen, fd, NULL, "cannot map region %.200s: %s", path, strerror(errno));
    if (ms_layout_check(map, path, err, errlen) != 0) {
        ms_release(fd, map);
        return -1;
    }
    if (!ms_intact(map)) /* shrunk while it was checked (region_guard.c) */
        return ms_fail(err, errlen, fd, map, "region %.200s is corrupted: shrunk or overwritten while it was opened",
                       path);
    *hp = map;
    return 0;
}
