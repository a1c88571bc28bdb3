/* Drives csrc/track.c from tests.
 *
 *   track_test ops        stdin lines "a KIND KEY DEV BYTES" / "r KIND KEY" / "h KEY DELTA" (a
 *                         handle's references, ms_track_ref_begin/end, one call after another);
 *                         answers "ok"/"fail" for adds, "1 DEV BYTES" or "0" for removes and
 *                         for references that reached zero, "held" or "unknown" for other "h"
 *                         (Python keeps the model); "b KIND KEY" (ms_track_free_begin: "1 TICKET"
 *                         or "0"), "e KIND KEY TICKET FREED" (ms_track_free_end: "1 DEV BYTES"
 *                         or "0").
 *                         "p KEY DEV BYTES" adds a device pointer with ms_track_add_ptr.
 *   track_test threads N OPS SEED
 *                         N threads each run OPS random adds/removes on keys of their own plus
 *                         keys handed over between threads, checked against per-thread models
 *                         (kind 0 through ms_track_add_ptr and free_begin/end, kind 1 through
 *                         add/remove); prints "ok adds=.. removes=.." or "FAIL ..." and exits 1.
 *   track_test race N ITERS
 *                         each round one pointer is added and N threads free it at once through
 *                         free_begin/end, a simulated driver freeing it for the first of them
 *                         (every 5th round for none); prints "ok uncharged=U kept=K" or "FAIL". */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "track.h"

/* "h KEY DELTA": DELTA references added (cuMemMap) or dropped (cuMemRelease) one after the other
 * through ms_track_ref_begin/end, each done by the driver (0: one call the driver refused). */
static const char *refs(unsigned long long key, int delta) {
    static char out[64];
    for (int i = 0; i == 0 || i < abs(delta); i++) {
        uint64_t ticket;
        int d = -7;
        uint64_t b = 7;
        if (!ms_track_ref_begin(key, delta > 0, &ticket)) return "unknown";
        if (ms_track_ref_end(key, ticket, delta > 0, delta != 0, &d, &b)) {
            snprintf(out, sizeof out, "1 %d %llu", d, (unsigned long long)b);
            return out;
        }
    }
    return "held";
}

static int ops(void) {
    char line[256];
    int kind, dev;
    unsigned long long key, bytes;
    while (fgets(line, sizeof line, stdin)) {
        if (sscanf(line, "a %d %llu %d %llu", &kind, &key, &dev, &bytes) == 4) {
            printf("%s\n", ms_track_add(kind, key, dev, bytes) == 0 ? "ok" : "fail");
        } else if (sscanf(line, "r %d %llu", &kind, &key) == 2) {
            int d = -7;
            uint64_t b = 7;
            if (ms_track_remove(kind, key, &d, &b))
                printf("1 %d %llu\n", d, (unsigned long long)b);
            else
                printf("0\n");
        } else if (sscanf(line, "h %llu %d", &key, &dev) == 2) {
            printf("%s\n", refs(key, dev));
        } else if (sscanf(line, "p %llu %d %llu", &key, &dev, &bytes) == 3) {
            printf("%s\n", ms_track_add_ptr(key, dev, bytes) == 0 ? "ok" : "fail");
        } else if (sscanf(line, "b %d %llu", &kind, &key) == 2) {
            uint64_t ticket = 0;
            if (ms_track_free_begin(kind, key, &ticket))
                printf("1 %llu\n", (unsigned long long)ticket);
            else
                printf("0\n");
        } else if (sscanf(line, "e %d %llu %llu %d", &kind, &key, &bytes, &dev) == 4) {
            int d = -7;
            uint64_t b = 7;
            if (ms_track_free_end(kind, key, bytes, dev, &d, &b))
                printf("1 %d %llu\n", d, (unsigned long long)b);
            else
                printf("0\n");
        } else {
            printf("what? %s", line);
        }
        fflush(stdout);
    }
    return 0;
}

#define LIVE 512

typedef struct tstate {
    int id, nthreads;
    long ops;
    uint64_t seed;
    long adds, removes;
    char fail[256];
} tstate;

/* Keys handed from thread i to thread (i+1) % n through a small locked mailbox. */
typedef struct mailbox {
    pthread_mutex_t lock;
    int n;
    uint64_t key[LIVE];
    uint64_t bytes[LIVE];
} mailbox;

static mailbox *boxes;

static uint64_t rnd(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* Kind 0 keys are device pointers (the shim's hot path), kind 1 keys go through add/remove. */
static int add_key(uint64_t key, int dev, uint64_t bytes) {
    return key & 1 ? ms_track_add(1, key, dev, bytes) : ms_track_add_ptr(key, dev, bytes);
}

static int take_key(uint64_t key, int *dev, uint64_t *bytes) {
    uint64_t ticket;
    if (key & 1) return ms_track_remove(1, key, dev, bytes);
    return ms_track_free_begin(0, key, &ticket) && ms_track_free_end(0, key, ticket, 1, dev, bytes);
}

static void *worker(void *arg) {
    tstate *t = arg;
    uint64_t key[LIVE], bytes[LIVE];
    int n = 0;
    uint64_t next = ((uint64_t)t->id << 40) | 0x1000;
    mailbox *in = &boxes[t->id], *out = &boxes[(t->id + 1) % t->nthreads];
    for (long k = 0; k < t->ops && !t->fail[0]; k++) {
        uint64_t r = rnd(&t->seed);
        int kind = (int)(r >> 60) & 1;
        if (n < LIVE && (r % 3 != 0 || n == 0)) {
            key[n] = next += 0x200 * (1 + (r >> 20) % 7);
            key[n] |= (uint64_t)kind; /* the kind is the low bit, so remove knows it */
            bytes[n] = 1 + (r >> 8) % 100000;
            if (add_key(key[n], t->id % 8, bytes[n]) != 0) {
                snprintf(t->fail, sizeof t->fail, "add failed");
                break;
            }
            n++;
            t->adds++;
        } else if (n > 0 && (r >> 32) % 8 == 0) { /* hand one over to the next thread */
            int i = (int)((r >> 4) % (uint64_t)n);
            pthread_mutex_lock(&out->lock);
            if (out->n < LIVE) {
                out->key[out->n] = key[i];
                out->bytes[out->n++] = bytes[i];
                key[i] = key[--n];
                bytes[i] = bytes[n];
            }
            pthread_mutex_unlock(&out->lock);
        } else if (n > 0) {
            int i = (int)((r >> 4) % (uint64_t)n);
            int d = -1;
            uint64_t b = 0;
            if (!take_key(key[i], &d, &b) || b != bytes[i]) {
                snprintf(t->fail, sizeof t->fail, "thread %d: key %#llx lost or wrong size %llu != %llu", t->id,
                         (unsigned long long)key[i], (unsigned long long)b, (unsigned long long)bytes[i]);
                break;
            }
            if (take_key(key[i], &d, &b)) {
                snprintf(t->fail, sizeof t->fail, "key %#llx removed twice", (unsigned long long)key[i]);
                break;
            }
            key[i] = key[--n];
            bytes[i] = bytes[n];
            t->removes++;
        }
        if ((k & 63) == 0) { /* take handed-over keys and free them as ours */
            pthread_mutex_lock(&in->lock);
            while (in->n > 0 && n < LIVE) {
                in->n--;
                key[n] = in->key[in->n];
                bytes[n++] = in->bytes[in->n];
            }
            pthread_mutex_unlock(&in->lock);
        }
    }
    for (int i = 0; i < n && !t->fail[0]; i++) {
        uint64_t b = 0;
        if (!take_key(key[i], NULL, &b) || b != bytes[i])
            snprintf(t->fail, sizeof t->fail, "final remove of %#llx failed", (unsigned long long)key[i]);
    }
    return NULL;
}

static int threads(int nthreads, long nops, uint64_t seed) {
    tstate *t = calloc((size_t)nthreads, sizeof *t);
    pthread_t *tid = calloc((size_t)nthreads, sizeof *tid);
    boxes = calloc((size_t)nthreads, sizeof *boxes);
    for (int i = 0; i < nthreads; i++) /* all before any thread starts: thread i uses box i + 1 */
        pthread_mutex_init(&boxes[i].lock, NULL);
    for (int i = 0; i < nthreads; i++) {
        t[i] = (tstate){.id = i, .nthreads = nthreads, .ops = nops, .seed = seed * 31 + (uint64_t)i + 1};
        pthread_create(&tid[i], NULL, worker, &t[i]);
    }
    long adds = 0, removes = 0;
    int bad = 0;
    for (int i = 0; i < nthreads; i++) {
        pthread_join(tid[i], NULL);
        adds += t[i].adds;
        removes += t[i].removes;
        if (t[i].fail[0]) {
            printf("FAIL %s\n", t[i].fail);
            bad = 1;
        }
    }
    /* keys still in mailboxes after every thread stopped: they must all be known */
    for (int i = 0; i < nthreads; i++)
        for (int j = 0; j < boxes[i].n; j++) {
            uint64_t b = 0;
            if (!take_key(boxes[i].key[j], NULL, &b) || b != boxes[i].bytes[j]) {
                printf("FAIL mailbox key %#llx lost\n", (unsigned long long)boxes[i].key[j]);
                bad = 1;
            }
        }
    if (!bad) printf("ok adds=%ld removes=%ld\n", adds, removes);
    free(t);
    free(tid);
    free(boxes);
    return bad;
}

/* race mode */
static int r_threads;
static long r_iters, r_round, r_done, r_uncharged, r_bad;
static uint64_t r_key;
static int r_driver_freed; /* the simulated driver: 0 until one free of this round "succeeds" */

static void *racer(void *arg) {
    (void)arg;
    for (long r = 1; r <= r_iters; r++) {
        for (unsigned n = 0; __atomic_load_n(&r_round, __ATOMIC_ACQUIRE) < r; n++)
            if (n > 200) sched_yield();
        uint64_t key = __atomic_load_n(&r_key, __ATOMIC_RELAXED), ticket;
        if (ms_track_free_begin(0, key, &ticket)) {
            int freed = r % 5 != 0 && !__atomic_exchange_n(&r_driver_freed, 1, __ATOMIC_ACQ_REL);
            int dev;
            uint64_t bytes;
            if (ms_track_free_end(0, key, ticket, freed, &dev, &bytes)) {
                __atomic_add_fetch(&r_uncharged, 1, __ATOMIC_RELAXED);
                if (dev != 5 || bytes != (uint64_t)r) __atomic_add_fetch(&r_bad, 1, __ATOMIC_RELAXED);
            }
        } else if (r % 5 == 0 || !__atomic_load_n(&r_driver_freed, __ATOMIC_ACQUIRE)) {
            __atomic_add_fetch(&r_bad, 1, __ATOMIC_RELAXED); /* lost while nobody had freed it */
        }
        __atomic_add_fetch(&r_done, 1, __ATOMIC_ACQ_REL);
    }
    return NULL;
}

static int race(int nthreads, long iters) {
    pthread_t tid[64];
    r_threads = nthreads < 2 ? 2 : nthreads > 64 ? 64 : nthreads;
    r_iters = iters;
    for (int i = 0; i < r_threads; i++) pthread_create(&tid[i], NULL, racer, NULL);
    long kept = 0;
    for (long r = 1; r <= iters; r++) {
        uint64_t key = 0x7A0000000000ULL + (uint64_t)r * 0x200, ticket;
        if (ms_track_add_ptr(key, 5, (uint64_t)r) != 0) return printf("FAIL add\n"), 1;
        __atomic_store_n(&r_driver_freed, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&r_key, key, __ATOMIC_RELAXED);
        __atomic_store_n(&r_round, r, __ATOMIC_RELEASE);
        for (unsigned n = 0; __atomic_load_n(&r_done, __ATOMIC_ACQUIRE) < r * r_threads; n++)
            if (n > 200) sched_yield();
        /* every 5th round nobody freed it: it must be there, whole; else it must be gone */
        int found = ms_track_free_begin(0, key, &ticket);
        int dev;
        uint64_t bytes;
        if (found != (r % 5 == 0)) return printf("FAIL round %ld: entry %s\n", r, found ? "left" : "lost"), 1;
        if (found && (!ms_track_free_end(0, key, ticket, 1, &dev, &bytes) || bytes != (uint64_t)r))
            return printf("FAIL round %ld: kept entry wrong\n", r), 1;
        kept += found;
    }
    for (int i = 0; i < r_threads; i++) pthread_join(tid[i], NULL);
    long want = iters - iters / 5;
    if (r_uncharged != want || r_bad != 0)
        return printf("FAIL uncharged=%ld want=%ld bad=%ld\n", r_uncharged, want, r_bad), 1;
    printf("ok uncharged=%ld kept=%ld\n", r_uncharged, kept);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "ops") == 0) return ops();
    if (argc == 5 && strcmp(argv[1], "threads") == 0)
        return threads(atoi(argv[2]), atol(argv[3]), strtoull(argv[4], NULL, 0));
    if (argc == 4 && strcmp(argv[1], "race") == 0) return race(atoi(argv[2]), atol(argv[3]));
    fprintf(stderr, "usage: %s ops | threads N OPS SEED | race N ITERS\n", argv[0]);
    return 2;
}
