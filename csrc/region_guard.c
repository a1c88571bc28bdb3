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
 * Every other SIGBUS goes where it went before the guard: to the application's action (the
 * one installed when the guard was, or one the application set since through the shim's
 * sigaction/signal, ms_region_sigbus_action, which records it instead of displacing the
 * guard), delivered as the kernel would deliver it: the guard's own disposition carries the
 * application's sa_mask, SA_NODEFER and SA_RESTART (kept in step with every change the
 * application makes), so the handler runs with the mask and the restart behaviour the kernel
 * would give it; SA_RESETHAND is done by the guard (the kernel's disposition must stay the
 * guard): the recorded action becomes SIG_DFL on entry to the handler, exactly once when
 * threads race, so a handler that returns from a fault, or raises SIGBUS again, meets the
 * default action as it would without the shim. The handler is called as it asked (SA_SIGINFO
 * or not). The guard keeps SA_ONSTACK whatever the application asked (runtimes such as Go's
 * require it of every handler): with an alternate stack set up, the application's handler
 * runs on it. Or the signal goes to the default action
 * (restored, then the fault repeats, or the signal is raised again once this handler
 * returns), or nowhere if it was ignored and not a fault.
 * Async-signal-safety: the handler reads the table with atomic loads and the application's
 * action under a sequence counter (its writers block every signal and take a spin lock, so no
 * writer is ever interrupted by the handler on its own thread), and calls only mmap,
 * sigaction, pthread_sigmask and raise (system calls); it keeps errno. Taking an SA_RESETHAND
 * action is a write: the handler does it as the writers do, every signal blocked, the spin
 * lock held for a copy. The kernel's disposition is changed
 * with __sigaction, glibc's own, so the shim's interposed sigaction is not re-entered. Threads: a fault is handled in the
 * faulting thread; others that touch the mapping meanwhile either fault too (and replace it
 * again, harmlessly) or read the zero pages. A mapping is unregistered before it is unmapped,
 * and no thread uses a mapping while it is unmapped (region.h), so the handler never maps over
 * memory that is no longer a region's. */
#include "region_impl.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>

/* Called through the shim's sigaction by sanitizer runtimes while they initialise, before a
 * ThreadSanitizer build could instrument a call: these functions are not instrumented. */
#define MS_UNINSTRUMENTED __attribute__((no_sanitize_thread))

/* glibc's sigaction under its own name (the shim exports an interposed sigaction) */
extern int __sigaction(int sig, const struct sigaction *act, struct sigaction *old);

#define MS_GUARDS 64
static uintptr_t ms_guarded[MS_GUARDS]; /* base addresses of region mappings; 0: free entry */
static struct sigaction ms_prev;        /* the application's SIGBUS action, which the guard chains */
static unsigned ms_prev_seq;            /* odd while ms_prev is being written */
static int ms_spin;                     /* serialises the writers of the disposition and ms_prev */
static int ms_installed;                /* the guard's handler is the kernel's disposition */

static void ms_on_sigbus(int sig, siginfo_t *si, void *uc);

/* Writers hold every signal off (so the handler never runs on a writer's thread mid-write) and
 * the spin lock (held for a system call at most). */
MS_UNINSTRUMENTED static void ms_lock(sigset_t *saved) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, saved);
    while (__atomic_exchange_n(&ms_spin, 1, __ATOMIC_ACQUIRE)) {
    }
}
MS_UNINSTRUMENTED static void ms_unlock(const sigset_t *saved) {
    __atomic_store_n(&ms_spin, 0, __ATOMIC_RELEASE);
    pthread_sigmask(SIG_SETMASK, saved, NULL);
}

/* Under ms_lock. */
MS_UNINSTRUMENTED static void ms_prev_write(const struct sigaction *act) {
    __atomic_add_fetch(&ms_prev_seq, 1, __ATOMIC_ACQ_REL); /* odd; the copy stays after it */
    memcpy(&ms_prev, act, sizeof ms_prev);
    __atomic_add_fetch(&ms_prev_seq, 1, __ATOMIC_RELEASE);
}

/* The kernel's disposition for the application's action ``app``: the guard's handler with the
 * application's sa_mask and the flags that shape a delivery (SA_NODEFER, SA_RESTART). */
MS_UNINSTRUMENTED static void ms_guard_for(const struct sigaction *app, struct sigaction *guard) {
    memset(guard, 0, sizeof *guard);
    guard->sa_sigaction = ms_on_sigbus;
    guard->sa_mask = app->sa_mask;
    guard->sa_flags = SA_SIGINFO | SA_ONSTACK | (app->sa_flags & (SA_NODEFER | SA_RESTART));
}

/* In the handler: a consistent copy (a writer on another thread finishes in a few instructions). */
static void ms_prev_read(struct sigaction *out) {
    for (;;) {
        unsigned seq = __atomic_load_n(&ms_prev_seq, __ATOMIC_ACQUIRE);
        if (seq & 1) continue;
        memcpy(out, &ms_prev, sizeof *out);
        if (__atomic_fetch_add(&ms_prev_seq, 0, __ATOMIC_ACQ_REL) == seq) return; /* the copy stays before it */
    }
}

/* The default action for a signal that is not the guard's business. */
static void ms_default(int sig, const siginfo_t *si) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    __sigaction(sig, &dfl, NULL);
    __atomic_store_n(&ms_installed, 0, __ATOMIC_RELAXED); /* the process is on its way out */
    if (si == NULL || si->si_code <= 0) raise(sig); /* sent, not a fault: pending until we return */
    /* a fault: the instruction runs again when this handler returns, and faults again */
}

static int ms_is_handler(const struct sigaction *act) {
    return (act->sa_flags & SA_SIGINFO) ? act->sa_sigaction != NULL
                                        : act->sa_handler != SIG_DFL && act->sa_handler != SIG_IGN;
}

/* The application's action for the SIGBUS being delivered now. With SA_RESETHAND the recorded
 * action is SIG_DFL from here on (its flags and mask kept, as the kernel keeps them), and of
 * threads racing to it only the first gets the handler. */
static void ms_prev_take(struct sigaction *out) {
    ms_prev_read(out);
    if (!(out->sa_flags & SA_RESETHAND) || !ms_is_handler(out)) return;
    sigset_t saved;
    ms_lock(&saved);
    memcpy(out, &ms_prev, sizeof *out);
    if ((out->sa_flags & SA_RESETHAND) && ms_is_handler(out)) {
        struct sigaction reset = *out;
        reset.sa_handler = SIG_DFL; /* sa_sigaction shares its storage */
        ms_prev_write(&reset);
    }
    ms_unlock(&saved);
}

static void ms_chain(int sig, siginfo_t *si, void *uc) {
    struct sigaction prev;
    ms_prev_take(&prev);
    if (prev.sa_flags & SA_SIGINFO) {
        if (prev.sa_sigaction != NULL) prev.sa_sigaction(sig, si, uc);
        else ms_default(sig, si);
    } else if (prev.sa_handler == SIG_IGN) {
        if (si != NULL && si->si_code > 0) ms_default(sig, si); /* a fault cannot be ignored */
    } else if (prev.sa_handler == SIG_DFL) {
        ms_default(sig, si);
    } else {
        prev.sa_handler(sig);
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

/* The guard's handler as the kernel's disposition (once; again if the default action was
 * restored meanwhile). 0, or -1. */
static int ms_guard_install(void) {
    if (__atomic_load_n(&ms_installed, __ATOMIC_ACQUIRE)) return 0;
    sigset_t saved;
    ms_lock(&saved);
    int rc = 0;
    if (!ms_installed) {
        struct sigaction sa, old;
        rc = __sigaction(SIGBUS, NULL, &old);
        if (rc == 0) {
            ms_guard_for(&old, &sa);
            rc = __sigaction(SIGBUS, &sa, NULL);
        }
        if (rc == 0) {
            ms_prev_write(&old);
            __atomic_store_n(&ms_installed, 1, __ATOMIC_RELEASE);
        }
    }
    ms_unlock(&saved);
    return rc;
}

MS_UNINSTRUMENTED int ms_region_sigbus_action(const struct sigaction *act, struct sigaction *old) {
    sigset_t saved;
    ms_lock(&saved);
    int rc = 0;
    if (ms_installed) { /* record it: the guard chains to it, and stays the kernel's */
        struct sigaction guard;
        if (act != NULL) ms_guard_for(act, &guard);
        if (act != NULL && __sigaction(SIGBUS, &guard, NULL) != 0) {
            rc = -1; /* act's mask or flags refused (errno EINVAL): nothing changed */
        } else {
            if (old != NULL) memcpy(old, &ms_prev, sizeof *old);
            if (act != NULL) ms_prev_write(act);
        }
    } else {
        rc = __sigaction(SIGBUS, act, old);
    }
    ms_unlock(&saved);
    return rc;
}

int ms_guard_add(const void *base) {
    if (ms_guard_install() != 0) return -1;
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
