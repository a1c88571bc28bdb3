/* Test hooks of the region core: fault injection (-DMS_FAULT_INJECT, region_impl.h) and the
 * mid-operation pause of the sanitizer builds (-DMS_REGION_PARANOID). Empty otherwise. */
#include "region_impl.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MS_REGION_PARANOID
/* Test builds only: called between the CAS and the fold of a charge or uncharge, so a test can
 * widen the window a SIGKILL must hit to leave an operation in flight. */
void (*ms_region_test_midop)(void);
#endif

#ifdef MS_FAULT_INJECT
/* MPSSHIM_FAULT=STEP[:N][:stop]: at the Nth passage (default 1) through STEP, SIGKILL (or, with
 * ":stop", SIGSTOP: a process frozen there, e.g. holding a repair lock). */
static char ms_fault_step[64];
static long ms_fault_at, ms_fault_hits;
static int ms_fault_sig = SIGKILL;
static pthread_once_t ms_fault_once = PTHREAD_ONCE_INIT;
static void ms_fault_init(void) {
    const char *env = getenv("MPSSHIM_FAULT");
    if (env == NULL || env[0] == '\0') return;
    snprintf(ms_fault_step, sizeof ms_fault_step, "%s", env);
    char *stop = strstr(ms_fault_step, ":stop");
    if (stop) *stop = '\0', ms_fault_sig = SIGSTOP;
    char *colon = strchr(ms_fault_step, ':');
    ms_fault_at = colon ? atol(colon + 1) : 1;
    if (colon) *colon = '\0';
}
void ms_fault_point(const char *step) {
    pthread_once(&ms_fault_once, ms_fault_init);
    if (ms_fault_step[0] && strcmp(step, ms_fault_step) == 0 &&
        __atomic_add_fetch(&ms_fault_hits, 1, __ATOMIC_RELAXED) == ms_fault_at)
        raise(ms_fault_sig);
}
#endif
