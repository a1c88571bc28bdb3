/* cuclient's own SIGBUS (the application's, not the region's): a handler that reports and
 * exits, and a fault on a file of its own. Included by cuclient.c only. */
#ifndef CUBUS_H
#define CUBUS_H

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void own_bus_handler(int sig, siginfo_t *info, void *ctx)
{
    (void)sig, (void)info, (void)ctx;
    static const char line[] = "ownbus rc=0 caught=1\n";
    if (write(1, line, sizeof line - 1) < 0)
        _exit(3);
    _exit(0);
}

static void own_bus_plain(int sig)
{
    own_bus_handler(sig, NULL, NULL);
}

static int install_bus_handler(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = own_bus_handler;
    sa.sa_flags = SA_SIGINFO;
    return sigaction(SIGBUS, &sa, NULL);
}

/* Touch a mapping of a file of our own after truncating it: SIGBUS, the application's own. */
static int own_bus(int handler)
{
    if (handler && install_bus_handler() != 0)
        return -1;
    FILE *f = tmpfile();
    if (f == NULL || ftruncate(fileno(f), 8192) != 0)
        return -1;
    volatile char *m = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fileno(f), 0);
    if (m == MAP_FAILED || ftruncate(fileno(f), 0) != 0)
        return -1;
    fflush(stdout);
    m[4096] = 1; /* beyond the end of the file */
    return -2;   /* not reached */
}

#endif
