/* A program's own SIGBUS handler, run with and without libmpsshim.so preloaded
 * (tests/shim/test_sigbus_semantics.py): everything it prints, and how it ends, must be the
 * same either way. The shim's region guard is the kernel's SIGBUS disposition once the region
 * is mapped (CUDA initialised with a cap), so it must hand on the program's SIGBUS exactly as
 * the kernel would: SA_RESETHAND (the disposition back to SIG_DFL on entry), SA_NODEFER (SIGBUS
 * not blocked in the handler), sa_mask (blocked in the handler), SA_RESTART.
 *
 *   sigsem ORDER FLAGS TRIGGER
 *   ORDER    before | after: the handler installed before or after cuInit maps the region
 *   FLAGS    +-joined: siginfo, resethand, nodefer, mask (SIGUSR1 in sa_mask), restart, reraise
 *            (the handler calls raise(SIGBUS), as crash reporters do), or none
 *   TRIGGER  fault (a truncated mapping of its own file), raise (raise(SIGBUS) from main), or
 *            restart (a timer's SIGBUS while read() waits on a pipe; the handler writes a byte)
 *
 * The handler prints one line per entry (its depth, what is blocked, what sigaction reports
 * now) and gives up with exit 42 at its third entry, so a handler the kernel would call again
 * and again ends; "mapped=N" (the region's mappings) goes to stderr. */
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static int entries, depth, reraise, pipefd[2];

static void say(const char *text)
{
    size_t n = strlen(text);
    if (write(1, text, n) != (ssize_t)n)
        _exit(3);
}

static void say_num(const char *key, long v)
{
    char buf[32], *p = buf + sizeof buf;
    int neg = v < 0;
    unsigned long u = neg ? -(unsigned long)v : (unsigned long)v;
    *--p = '\0';
    do
        *--p = (char)('0' + u % 10);
    while ((u /= 10) != 0);
    if (neg)
        *--p = '-';
    say(key);
    say(p);
}

static void on_bus(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    int saved = errno;
    entries++;
    depth++;
    sigset_t now;
    sigprocmask(SIG_BLOCK, NULL, &now);
    struct sigaction cur;
    sigaction(SIGBUS, NULL, &cur);
    say_num("enter n=", entries);
    say_num(" depth=", depth);
    say_num(" sig=", sig);
    say_num(" code=", si != NULL ? si->si_code : 99999);
    say_num(" bus_blocked=", sigismember(&now, SIGBUS));
    say_num(" usr1_blocked=", sigismember(&now, SIGUSR1));
    say_num(" dfl_now=", cur.sa_handler == SIG_DFL);
    say("\n");
    if (entries >= 3) {
        say("limit\n");
        _exit(42);
    }
    if (pipefd[1] > 0 && write(pipefd[1], "x", 1) != 1)
        _exit(4);
    if (reraise) {
        raise(SIGBUS);
        say_num("after-raise n=", entries);
        say("\n");
    }
    depth--;
    errno = saved;
}

static void on_bus_plain(int sig)
{
    on_bus(sig, NULL, NULL);
}

static int install(const char *flags)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    if (strstr(flags, "siginfo")) {
        sa.sa_flags |= SA_SIGINFO;
        sa.sa_sigaction = on_bus;
    } else {
        sa.sa_handler = on_bus_plain;
    }
    if (strstr(flags, "resethand"))
        sa.sa_flags |= SA_RESETHAND;
    if (strstr(flags, "nodefer"))
        sa.sa_flags |= SA_NODEFER;
    if (strstr(flags, "restart"))
        sa.sa_flags |= SA_RESTART;
    if (strstr(flags, "mask"))
        sigaddset(&sa.sa_mask, SIGUSR1);
    reraise = strstr(flags, "reraise") != NULL;
    return sigaction(SIGBUS, &sa, NULL);
}

/* cuInit through the driver found on the library path: under the shim, with a cap, it maps the
 * region and installs the guard. The number of mappings of MPSSHIM_REGION, on stderr. */
static void init_cuda(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int (*cu_init)(unsigned) = lib ? (int (*)(unsigned))dlsym(lib, "cuInit") : NULL;
    if (cu_init == NULL || cu_init(0) != 0) {
        fprintf(stderr, "cuInit failed\n");
        exit(5);
    }
    const char *region = getenv("MPSSHIM_REGION");
    int mapped = 0;
    char line[4096];
    FILE *maps = fopen("/proc/self/maps", "r");
    while (region != NULL && maps != NULL && fgets(line, sizeof line, maps) != NULL)
        mapped += strstr(line, region) != NULL;
    if (maps != NULL)
        fclose(maps);
    fprintf(stderr, "mapped=%d\n", mapped);
}

static void fault(void)
{
    FILE *f = tmpfile();
    if (f == NULL || ftruncate(fileno(f), 8192) != 0)
        exit(6);
    volatile char *m = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fileno(f), 0);
    if (m == MAP_FAILED || ftruncate(fileno(f), 0) != 0)
        exit(6);
    m[4096] = 1; /* beyond the end of the file: SIGBUS, BUS_ADRERR */
    say("after-fault\n");
}

/* read() on an empty pipe, interrupted by a timer's SIGBUS: with SA_RESTART it is restarted and
 * gets the byte the handler wrote; without, it fails with EINTR. */
static void restart(void)
{
    if (pipe(pipefd) != 0)
        exit(7);
    timer_t timer;
    struct sigevent ev;
    memset(&ev, 0, sizeof ev);
    ev.sigev_notify = SIGEV_SIGNAL;
    ev.sigev_signo = SIGBUS;
    struct itimerspec when = {.it_value = {.tv_nsec = 50 * 1000 * 1000}};
    if (timer_create(CLOCK_MONOTONIC, &ev, &timer) != 0 || timer_settime(timer, 0, &when, NULL) != 0)
        exit(7);
    char c;
    ssize_t n = read(pipefd[0], &c, 1);
    say_num("read n=", (long)n);
    say_num(" eintr=", n < 0 && errno == EINTR);
    say("\n");
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: sigsem before|after FLAGS fault|raise|restart\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    int before = strcmp(argv[1], "before") == 0;
    if (before && install(argv[2]) != 0)
        return 8;
    init_cuda();
    if (!before && install(argv[2]) != 0)
        return 8;
    if (strcmp(argv[3], "fault") == 0) {
        fault();
    } else if (strcmp(argv[3], "raise") == 0) {
        raise(SIGBUS);
        say("after-raise-main\n");
        raise(SIGBUS);
        say("after-second-raise-main\n");
    } else if (strcmp(argv[3], "restart") == 0) {
        restart();
    } else {
        return 2;
    }
    say("end\n");
    return 0;
}
