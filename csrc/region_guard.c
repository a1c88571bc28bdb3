/* The SIGBUS guard of the region core: a mapped region file that another process shrinks
 * (any process of the container can ftruncate the 0666 file) must end in refusals, never in a
 * signal that kills this one. Calls nothing else of the region core.
 *
 * How: every mapping of a region (always sizeof(ms_hdr) bytes) is registered here. A SIGBUS
 * handler, installed once at the first registration, looks at the faulting address: if the
 * kernel raised the signal (si_code > 0) for an address inside a registered mapping, the
 * handler replaces that whole mapping, at the same address, with private zero pages
 * (mmap MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS) and returns; the faulting access runs again,
 * on memory that cannot fault. The region's magic number reads 0 there, which the region core
 * checks before and after every charge and give-back (ms_intact): from then on this process's
 * handle refuses (MS_ERROR, "region ... corrupted"), for good. Nothing is added to the fast
 * path but that one load of a read-mostly line.
 * Every other SIGBUS goes where it went before the guard: to the handler that was installed
 * when the guard was (called as that handler asked: SA_SIGINFO or not), or to the default
 * action (restored, then the fault repeats, or the signal is raised again once this handler
 * returns), or nowhere if it was ignored and not a fault.
 * Async-signal-safety: the handler reads the table with atomic loads and calls only mmap,
 * sigaction and raise (system calls); it keeps errno. Threads: a fault is handled in the
 * faulting thread; others that touch the mapping meanwhile either fault too (and replace it
 * again, harmlessly) or read the zero pages. A mapping is unregistered before it is unmapped,
 * and no thread uses a mapping while it is unmapped (region.h), so the handler never maps over
 * memory that is no longer a region's. */
#include "region_impl.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>

#define MS_GUARDS 64
static uintptr_t ms_guarded[MS_GUARDS]; /* base addresses of region mappings; 0: free entry */
static struct sigaction ms_prev;        /* the SIGBUS action before the guard's */
static pthread_once_t ms_guard_once = PTHREAD_ONCE_INIT;
static int ms_guard_ok;

/* The default action for a signal that is not the guard's business. */
static void ms_default(int sig, const siginfo_t *si) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (si == NULL || si->si_code <= 0) raise(sig); /* sent, not a fault: pending until we return */
    /* a fault: the instruction runs again when this handler returns, and faults again */
}

static void ms_chain(int sig, siginfo_t *si, void *uc) {
    if (ms_prev.sa_flags & SA_SIGINFO) {
        if (ms_prev.sa_sigaction != NULL) ms_prev.sa_sigaction(sig, si, uc);
        else ms_default(sig, si);
    } else if (ms_prev.sa_handler == SIG_IGN) {
        if (si != NULL && si->si_code > 0) ms_default(sig, si); /* a fault cannot be ignored */
    } else if (ms_prev.sa_handler == SIG_DFL) {
        ms_default(sig, si);
    } else {
        ms_prev.sa_handler(sig);
    }
}

static void ms_on_sigbus(int sig, siginfo_t *si, void *uc) {
    int saved = errno;
    if (si != NULL && si->si_code > 0) { /* raised by the kernel for an access */
        uintptr_t a = (uintptr_t)si->si_addr;
        for (int i = 0; i < MS_GUARDS; i++) {
            uintptr_t b = __atomic_load_n(&ms_guarded[i], __ATOMIC_ACQUIRE);
            if (b == 0 || a < b || a - b >= sizeof(ms_hdr)) continue;
            if (mmap((void *)b, sizeof(ms_hdr), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
                     0) != MAP_FAILED) {
                errno = saved;
                return;
            }
            break; /* cannot replace it (no memory): the signal takes its course */
        }
    }
    ms_chain(sig, si, uc);
    errno = saved;
}

static void ms_guard_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = ms_on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ms_guard_ok = sigaction(SIGBUS, &sa, &ms_prev) == 0;
}

int ms_guard_add(const void *base) {
    pthread_once(&ms_guard_once, ms_guard_install);
    if (!ms_guard_ok) return -1;
    for (int i = 0; i < MS_GUARDS; i++) {
        uintptr_t free_entry = 0;
        if (__atomic_compare_exchange_n(&ms_guarded[i], &free_entry, (uintptr_t)base, 0, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED))
            return 0;
    }
    return -1;
}

void ms_guard_remove(const void *base) {
    for (int i = 0; i < MS_GUARDS; i++) {
        uintptr_t mine = (uintptr_t)base;
        if (__atomic_compare_exchange_n(&ms_guarded[i], &mine, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) return;
    }
}
