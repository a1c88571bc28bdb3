/* The process's open region handles: the registry (one handle per file, reference counted),
 * handle ids, and what fork does to them. Calls nothing else of the region core. */
#include "region_impl.h"

#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

pthread_mutex_t ms_reg_lock = PTHREAD_MUTEX_INITIALIZER;
unsigned long ms_forkgen;
static unsigned long ms_ids;
static pthread_once_t ms_once = PTHREAD_ONCE_INIT;
static ms_region *ms_reg_head;

unsigned long ms_new_id(void) { return __atomic_add_fetch(&ms_ids, 1, __ATOMIC_RELAXED); }

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
void ms_handles_init(void) { pthread_once(&ms_once, ms_init_once); }

ms_region *ms_reg_find(const char *path) {
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

void ms_reg_add(ms_region *r) {
    r->next = ms_reg_head;
    ms_reg_head = r;
}

void ms_reg_remove(ms_region *r) {
    for (ms_region **p = &ms_reg_head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return;
        }
}
