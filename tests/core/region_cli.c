/* Drives the region core (csrc/region_*.c) from tests.
 *
 *   region_cli repl
 *       one command per stdin line, one answer per stdout line:
 *       open PATH | charge DEV CAP BYTES | uncharge DEV BYTES | used DEV | reclaim | close
 *       snapshot PATH | pid | forkcharge DEV CAP BYTES | cloexec PATH
 *       touchfd PATH (open and close another descriptor of PATH, as a second library copy would)
 *       forksleep (fork a child that never touches the region and sleeps; prints its pid)
 *       tcharge DEV CAP BYTES | tuncharge DEV BYTES (the same as charge/uncharge, on a thread of
 *       their own, while this one keeps its lane: a free on another thread than the charge)
 *   region_cli stress PATH CAP THREADS SECONDS SEED [MAXBYTES]
 *       THREADS threads charge and uncharge random sizes (1..MAXBYTES, default CAP / 8) on
 *       device 0 for SECONDS, checking after
 *       every charge that the region's total is within CAP; at the end give everything back.
 *       Prints "charges=N refused=N maxseen=N" and exits 1 on a violation.
 *   region_cli spin PATH CAP BYTES THREADS
 *       charge BYTES (held for good), print "ready", then charge/uncharge 1..4096 bytes in a
 *       tight loop on every thread until killed (to be SIGKILLed inside charge/uncharge). */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "region.h"

static ms_region *reg;

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int open_or_die(const char *path) {
    char err[512];
    if (ms_region_open(path, &reg, err, sizeof err) != 0) {
        fprintf(stderr, "open: %s\n", err);
        return -1;
    }
    return 0;
}

static void print_snapshot(const char *path) {
    static ms_snapshot s;
    char err[512];
    if (ms_region_snapshot(path, &s, err, sizeof err) != 0) {
        printf("err %s\n", err);
        return;
    }
    printf("ok version=%u nprocs=%u cap0=%llu used0=%llu used1=%llu procs=", s.version, s.nprocs,
           (unsigned long long)s.cap[0], (unsigned long long)s.used[0], (unsigned long long)s.used[1]);
    for (uint32_t i = 0; i < s.nprocs; i++)
        printf("%s%d:%d:%llu", i ? "," : "", s.procs[i].pid, s.procs[i].alive,
               (unsigned long long)s.procs[i].used[0]);
    printf("\n");
}

/* Child charges, reports through a pipe, then dies without closing (like a crash). */
static void forkcharge(int dev, uint64_t cap, uint64_t bytes) {
    int fds[2];
    if (pipe(fds) != 0) {
        printf("err pipe\n");
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        uint64_t in_use = 0;
        int rc = ms_region_charge(reg, dev, cap, bytes, &in_use);
        char buf[128];
        int n = snprintf(buf, sizeof buf, "rc=%d in_use=%llu", rc, (unsigned long long)in_use);
        if (write(fds[1], buf, (size_t)n) != n) _exit(3);
        _exit(0);
    }
    close(fds[1]);
    char buf[128] = {0};
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    printf("child pid=%d %s status=%d\n", (int)pid, n > 0 ? buf : "nothing", status);
}

/* "ok N": N descriptors of this process refer to PATH and all are close-on-exec. */
static void cloexec(const char *path) {
    struct stat want, st;
    if (stat(path, &want) != 0) {
        printf("err stat\n");
        return;
    }
    int n = 0;
    for (int fd = 0; fd < 1024; fd++) {
        if (fstat(fd, &st) != 0 || st.st_dev != want.st_dev || st.st_ino != want.st_ino) continue;
        if (!(fcntl(fd, F_GETFD) & FD_CLOEXEC)) {
            printf("leak fd %d\n", fd);
            return;
        }
        n++;
    }
    printf("ok %d\n", n);
}

typedef struct tcall {
    int dev;
    unsigned long long cap, bytes;
    char out[128];
} tcall;

static void *tcharge(void *arg) {
    tcall *c = arg;
    uint64_t in_use = 12345;
    int rc = ms_region_charge(reg, c->dev, c->cap, c->bytes, &in_use);
    snprintf(c->out, sizeof c->out, "%s %llu", rc == MS_OK ? "ok" : rc == MS_OVER_CAP ? "over" : "error",
             (unsigned long long)in_use);
    return NULL;
}

static void *tuncharge(void *arg) {
    tcall *c = arg;
    snprintf(c->out, sizeof c->out, "left %llu", (unsigned long long)ms_region_uncharge(reg, c->dev, c->bytes));
    return NULL;
}

static void on_thread(void *(*fn)(void *), tcall *c) {
    pthread_t t;
    pthread_create(&t, NULL, fn, c);
    pthread_join(t, NULL);
    printf("%s\n", c->out);
}

static int repl(void) {
    char line[4096], a[4096];
    int opens = 0;
    int dev;
    unsigned long long x, y;
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = '\0';
        unsigned mode;
        if (sscanf(line, "openmode %o %4095s", &mode, a) == 2) {
            char err[512];
            if (ms_region_open_mode(a, mode, &reg, err, sizeof err) == 0) opens++, printf("ok\n");
            else printf("err %s\n", err);
        } else if (sscanf(line, "open %4095s", a) == 1) {
            char err[512];
            if (ms_region_open(a, &reg, err, sizeof err) == 0) opens++, printf("ok\n");
            else printf("err %s\n", err);
        } else if (sscanf(line, "tcharge %d %llu %llu", &dev, &x, &y) == 3) {
            tcall c = {.dev = dev, .cap = x, .bytes = y};
            on_thread(tcharge, &c);
        } else if (sscanf(line, "tuncharge %d %llu", &dev, &x) == 2) {
            tcall c = {.dev = dev, .bytes = x};
            on_thread(tuncharge, &c);
        } else if (sscanf(line, "charge %d %llu %llu", &dev, &x, &y) == 3) {
            uint64_t in_use = 12345;
            int rc = ms_region_charge(reg, dev, x, y, &in_use);
            printf("%s %llu\n", rc == MS_OK ? "ok" : rc == MS_OVER_CAP ? "over" : "error",
                   (unsigned long long)in_use);
        } else if (sscanf(line, "uncharge %d %llu", &dev, &x) == 2) {
            printf("left %llu\n", (unsigned long long)ms_region_uncharge(reg, dev, x));
        } else if (sscanf(line, "used %d", &dev) == 1) {
            printf("%llu\n", (unsigned long long)ms_region_used(reg, dev));
        } else if (strcmp(line, "reclaim") == 0) {
            printf("%d\n", ms_region_reclaim(reg));
        } else if (strcmp(line, "close") == 0) {
            ms_region_close(reg);
            if (--opens == 0) reg = NULL; /* opening twice returns the same handle */
            printf("ok\n");
        } else if (sscanf(line, "snapshot %4095s", a) == 1) {
            print_snapshot(a);
        } else if (sscanf(line, "cloexec %4095s", a) == 1) {
            cloexec(a);
        } else if (sscanf(line, "touchfd %4095s", a) == 1) {
            int fd = open(a, O_RDONLY | O_CLOEXEC);
            printf("%s\n", fd >= 0 && close(fd) == 0 ? "ok" : "err");
        } else if (strcmp(line, "forksleep") == 0) {
            /* The pid is printed once the child is past fork(), i.e. its atfork handler has
             * dropped the inherited descriptor: before that the child still held the parent's
             * liveness lock, and a test killing the parent at once raced with it. */
            int ready[2];
            char byte = 0;
            if (pipe(ready) != 0) {
                printf("err pipe\n");
                fflush(stdout);
                continue;
            }
            pid_t pid = fork();
            if (pid == 0) {
                close(ready[0]);
                if (write(ready[1], "r", 1) != 1) _exit(1);
                close(ready[1]);
                for (;;) pause();
            }
            close(ready[1]);
            if (pid < 0 || read(ready[0], &byte, 1) != 1) pid = -1;
            close(ready[0]);
            printf("%d\n", (int)pid);
        } else if (strcmp(line, "pid") == 0) {
            printf("%d\n", (int)getpid());
        } else if (sscanf(line, "forkcharge %d %llu %llu", &dev, &x, &y) == 3) {
            forkcharge(dev, x, y);
        } else {
            printf("what? %s\n", line);
        }
        fflush(stdout);
    }
    return 0;
}

typedef struct worker {
    uint64_t cap, maxbytes, seed, charges, refused, maxseen;
    double until;
    int bad;
} worker;

static void *stress_thread(void *arg) {
    worker *w = arg;
    uint64_t held[64], nheld = 0;
    while (now() < w->until) {
        for (int k = 0; k < 256; k++) {
            uint64_t r = xorshift(&w->seed);
            if (nheld < 64 && (r & 1)) {
                uint64_t bytes = 1 + (xorshift(&w->seed) % w->maxbytes);
                uint64_t in_use = 0;
                int rc = ms_region_charge(reg, 0, w->cap, bytes, &in_use);
                if (rc == MS_OK) {
                    held[nheld++] = bytes;
                    w->charges++;
                } else if (rc == MS_OVER_CAP) {
                    w->refused++;
                } else {
                    w->bad = 1;
                }
                if (in_use > w->cap) w->bad = 1;
                uint64_t seen = ms_region_used(reg, 0);
                if (seen > w->cap) w->bad = 1;
                if (seen > w->maxseen) w->maxseen = seen;
            } else if (nheld > 0) {
                uint64_t i = r % nheld;
                if (ms_region_uncharge(reg, 0, held[i]) != 0) w->bad = 1;
                held[i] = held[--nheld];
            }
        }
    }
    while (nheld > 0)
        if (ms_region_uncharge(reg, 0, held[--nheld]) != 0) w->bad = 1;
    return NULL;
}

static int stress(const char *path, uint64_t cap, int nthreads, double seconds, uint64_t seed, uint64_t maxbytes) {
    if (open_or_die(path) != 0) return 2;
    worker *w = calloc((size_t)nthreads, sizeof *w);
    pthread_t *t = calloc((size_t)nthreads, sizeof *t);
    double until = now() + seconds;
    for (int i = 0; i < nthreads; i++) {
        w[i] = (worker){.cap = cap, .maxbytes = maxbytes ? maxbytes : cap / 8, .seed = seed * 1000003 + (uint64_t)i + 1, .until = until};
        pthread_create(&t[i], NULL, stress_thread, &w[i]);
    }
    uint64_t charges = 0, refused = 0, maxseen = 0;
    int bad = 0;
    for (int i = 0; i < nthreads; i++) {
        pthread_join(t[i], NULL);
        charges += w[i].charges;
        refused += w[i].refused;
        bad |= w[i].bad;
        if (w[i].maxseen > maxseen) maxseen = w[i].maxseen;
    }
    printf("charges=%llu refused=%llu maxseen=%llu bad=%d\n", (unsigned long long)charges,
           (unsigned long long)refused, (unsigned long long)maxseen, bad);
    ms_region_close(reg);
    free(w);
    free(t);
    return bad;
}

static uint64_t spin_cap;

static void *spin_thread(void *arg) {
    uint64_t seed = (uint64_t)(uintptr_t)arg * 7919 + 1;
    for (;;) {
        uint64_t bytes = 1 + xorshift(&seed) % 4096;
        if (ms_region_charge(reg, 0, spin_cap, bytes, NULL) == MS_OK) ms_region_uncharge(reg, 0, bytes);
    }
    return NULL;
}

#ifdef MS_REGION_PARANOID
extern void (*ms_region_test_midop)(void);

static void midop_pause(void) { /* tens of microseconds between the slot and total updates */
    for (volatile int i = 0; i < 50000; i++) {
    }
}
#endif

static int spin(const char *path, uint64_t cap, uint64_t bytes, int nthreads) {
#ifdef MS_REGION_PARANOID
    ms_region_test_midop = midop_pause;
#endif
    if (open_or_die(path) != 0) return 2;
    spin_cap = cap;
    if (ms_region_charge(reg, 0, cap, bytes, NULL) != MS_OK) {
        fprintf(stderr, "spin: could not charge %llu\n", (unsigned long long)bytes);
        return 1;
    }
    pthread_t t;
    for (int i = 1; i < nthreads; i++) pthread_create(&t, NULL, spin_thread, (void *)(uintptr_t)i);
    printf("ready\n");
    fflush(stdout);
    spin_thread((void *)(uintptr_t)0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "repl") == 0) return repl();
    if ((argc == 7 || argc == 8) && strcmp(argv[1], "stress") == 0)
        return stress(argv[2], strtoull(argv[3], NULL, 0), atoi(argv[4]), atof(argv[5]), strtoull(argv[6], NULL, 0),
                      argc == 8 ? strtoull(argv[7], NULL, 0) : 0);
    if (argc == 6 && strcmp(argv[1], "spin") == 0)
        return spin(argv[2], strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0), atoi(argv[5]));
    fprintf(stderr, "usage: %s repl | stress PATH CAP THREADS SECONDS SEED | spin PATH CAP BYTES THREADS\n", argv[0]);
    return 2;
}
