/* sigaction and signal, interposed for SIGBUS only: the region's SIGBUS guard (region_guard.c)
 * must stay the kernel's disposition once a region is mapped, or a co-tenant truncating the
 * region would kill this process through a handler the application installed later. The
 * application's action is recorded instead and gets every SIGBUS that is not the region's
 * (and sigaction reports it back as the current one). Other signals, and SIGBUS before any
 * region is mapped, go to glibc unchanged. Not covered: bsd_signal, sysv_signal, sigset and
 * raw rt_sigaction system calls (the Go runtime's), which still replace the guard.
 * Not instrumented by ThreadSanitizer: its runtime calls sigaction while it initialises. */
#include <signal.h>
#include <string.h>

#include "hooks.h"
#include "region.h"

extern int __sigaction(int sig, const struct sigaction *act, struct sigaction *old);
extern __sighandler_t bsd_signal(int sig, __sighandler_t handler); /* glibc's signal() */

__attribute__((no_sanitize_thread)) MS_EXPORT int sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
    if (sig != SIGBUS)
        return __sigaction(sig, act, old);
    return ms_region_sigbus_action(act, old);
}

/* glibc's signal(): BSD semantics (the signal blocked in its handler, SA_RESTART). */
__attribute__((no_sanitize_thread)) MS_EXPORT __sighandler_t signal(int sig, __sighandler_t handler)
{
    if (sig != SIGBUS)
        return bsd_signal(sig, handler);
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    sigemptyset(&act.sa_mask);
    sigaddset(&act.sa_mask, sig);
    act.sa_flags = SA_RESTART;
    if (handler == SIG_ERR || ms_region_sigbus_action(&act, &old) != 0)
        return SIG_ERR;
    return old.sa_handler;
}
