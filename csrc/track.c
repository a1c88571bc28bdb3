/* Allocation tracker (contract in track.h): (kind, key) -> (device, bytes, aux, references).
 *
 * 64 shards chosen by the top bits of a 64-bit mix of the key, each an open-addressing table
 * with linear probing and tombstones, guarded by its own small spinlock: threads that free
 * different pointers rarely meet. A shard grows (doubling, or rehashing in place when it is
 * mostly tombstones) once live entries plus tombstones pass 3/4 of it, so probes stay short
 * and no operation scans more than a cluster. Lock hold times are a few dozen instructions,
 * hence a spinlock that yields after a while rather than a futex. An atfork handler holds
 * every shard across fork so a child never inherits a lock taken by a thread that is gone.
 *
 * Frees in flight (ms_track_free_begin/end): the entry is not taken out while the driver frees,
 * it is marked FREEING with a count of the frees in flight and a ticket (the shard's generation
 * number at marking). A second free of the same key that starts meanwhile joins it (count + 1)
 * instead of finding nothing; each reports whether the driver freed; the last one out forgets
 * the entry if any of them freed it (and only that caller uncharges) or makes it live again if
 * none did. A FREEING entry is invisible to add/remove/ref: an allocation the driver hands
 * out at the same address meanwhile gets an entry of its own.
 *
 * Device pointers added with ms_track_add_ptr (every cuMemAlloc of the shim) live in one fixed
 * open-addressing table instead, where each operation is a single compare-and-swap on a slot's
 * state word and no lock is taken (end of the file). */
#include "track_fast.h"
#include "track_impl.h"

#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <pthread.h>
#include <sys/mman.h>

ms_shard ms_shards[MS_SHARDS];

static inline void ms_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void ms_spin_lock(int *l) {
    for (unsigned n = 0;; n++) {
        if (__atomic_load_n(l, __ATOMIC_RELAXED) == 0 && !__atomic_exchange_n(l, 1, __ATOMIC_ACQUIRE)) return;
        if (n >= 64) sched_yield();
        else ms_cpu_relax();
    }
}

void ms_spin_unlock(int *l) { __atomic_store_n(l, 0, __ATOMIC_RELEASE); }

static void ms_track_prefork(void) {
    for (int i = 0; i < MS_SHARDS; i++) ms_spin_lock(&ms_shards[i].lock);
}

static void ms_track_postfork(void) {
    for (int i = MS_SHARDS - 1; i >= 0; i--) ms_spin_unlock(&ms_shards[i].lock);
}

__attribute__((constructor)) static void ms_track_init(void) {
    pthread_atfork(ms_track_prefork, ms_track_postfork, ms_track_postfork);
}

uint64_t ms_mix(int kind, uint64_t key) {
    uint64_t x = key ^ ((uint64_t)(kind + 1) * 0x9e3779b97f4a7c15ULL);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* Slot of (kind, key) if present, else -1. */
int64_t ms_find(const ms_shard *s, int kind, uint64_t key, uint64_t h) {
    if (s->cap == 0) return -1;
    uint32_t mask = s->cap - 1;
    for (uint32_t i = (uint32_t)h & mask, n = 0; n < s->cap; i = (i + 1) & mask, n++) {
        const ms_entry *e = &s->e[i];
        if (e->state == MS_E_EMPTY) return -1;
        if (e->state == MS_E_FULL && e->key == key && e->kind == kind) return i;
    }
    return -1;
}

/* Slot of the FREEING entry of (kind, key) with `ticket`, or (ticket 0) the most recently marked
 * one; -1 if none. */
static int64_t ms_find_freeing(const ms_shard *s, int kind, uint64_t key, uint64_t h, uint32_t ticket) {
    if (s->cap == 0) return -1;
    uint32_t mask = s->cap - 1;
    int64_t best = -1;
    for (uint32_t i = (uint32_t)h & mask, n = 0; n < s->cap; i = (i + 1) & mask, n++) {
        const ms_entry *e = &s->e[i];
        if (e->state == MS_E_EMPTY) break;
        if (e->state != MS_E_FREEING || e->key != key || e->kind != kind) continue;
        if (ticket != 0 && e->ticket == ticket) return i;
        if (ticket == 0 && (best < 0 || (int32_t)(e->ticket - s->e[best].ticket) > 0)) best = i;
    }
    return best;
}

static int ms_in_use(const ms_entry *e) {
    return e->state == MS_E_FULL || e->state == MS_E_FREEING || e->state == MS_E_DEAD;
}

static void ms_put(ms_entry *tab, uint32_t cap, const ms_entry *src, uint64_t h) {
    uint32_t mask = cap - 1, i = (uint32_t)h & mask;
    while (tab[i].state != MS_E_EMPTY) i = (i + 1) & mask;
    tab[i] = *src;
}

static int ms_grow(ms_shard *s) {
    uint32_t cap = s->cap == 0 ? MS_SHARD_MIN : (s->live * 2 >= s->cap / 2 ? s->cap * 2 : s->cap);
    if (cap < s->cap) return -1; /* 2^32 entries in one shard: give up rather than wrap */
    ms_entry *tab = calloc(cap, sizeof *tab);
    if (tab == NULL) return -1;
    for (uint32_t i = 0; i < s->cap; i++)
        if (ms_in_use(&s->e[i])) ms_put(tab, cap, &s->e[i], ms_mix(s->e[i].kind, s->e[i].key));
    free(s->e);
    s->e = tab;
    s->cap = cap;
    s->tombs = 0;
    return 0;
}

static int ms_ptr_locked; /* a device pointer was added to the shards: lookups look there too */

int ms_track_add_aux(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t aux) {
    uint64_t h = ms_mix(kind, key);
    if (kind == MS_TRACK_PTR && !__atomic_load_n(&ms_ptr_locked, __ATOMIC_RELAXED))
        __atomic_store_n(&ms_ptr_locked, 1, __ATOMIC_SEQ_CST);
    ms_shard *s = &ms_shards[h >> (64 - MS_SHARD_BITS)];
    int rc = 0;
    ms_spin_lock(&s->lock);
    int64_t at = ms_find(s, kind, key, h);
    if (at >= 0 && (s->e[at].ops > 0 || s->e[at].zero)) {
        /* a handle value the driver freed and hands out again while calls on the old one are
         * still in flight (or its end waits on retains): the old entry is settled by those */
        s->e[at].state = MS_E_DEAD;
        at = -1;
    }
    if (at >= 0) { /* the driver reused a live key: the newest allocation wins */
        s->e[at].dev = dev;
        s->e[at].bytes = bytes;
        s->e[at].aux = aux;
        s->e[at].holds = 1;
    } else if ((uint64_t)(s->live + s->tombs + 1) * 4 > (uint64_t)s->cap * 3 && ms_grow(s) != 0) {
        rc = -1;
    } else {
        uint32_t mask = s->cap - 1, i = (uint32_t)h & mask;
        while (ms_in_use(&s->e[i])) i = (i + 1) & mask;
        if (s->e[i].state == MS_E_TOMB) s->tombs--;
        if (++s->tickets == 0) s->tickets = 1; /* 0 means "any" to ms_find_freeing */
        s->e[i] = (ms_entry){.key = key, .bytes = bytes, .aux = aux, .dev = dev, .holds = 1, .ticket = s->tickets,
                             .state = MS_E_FULL, .kind = (uint8_t)kind};
        s->live++;
    }
    ms_spin_unlock(&s->lock);
    return rc;
}

int ms_track_add(int kind, uint64_t key, int dev, uint64_t bytes) { return ms_track_add_aux(kind, key, dev, bytes, 0); }

/* Under the shard lock: forget entry `at`, giving its values back. */
void ms_forget(ms_shard *s, int64_t at, int *dev, uint64_t *bytes, uint64_t *aux) {
    ms_entry *e = &s->e[at];
    if (e->zero) __atomic_sub_fetch(&ms_refs_zeros, 1, __ATOMIC_SEQ_CST);
    e->zero = 0;
    if (dev) *dev = e->dev;
    if (bytes) *bytes = e->bytes;
    if (aux) *aux = e->aux;
    e->state = MS_E_TOMB;
    s->live--;
    s->tombs++;
}

int ms_track_remove_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux) {
    uint64_t h = ms_mix(kind, key);
    ms_shard *s = &ms_shards[h >> (64 - MS_SHARD_BITS)];
    ms_spin_lock(&s->lock);
    int64_t at = ms_find(s, kind, key, h);
    if (at >= 0) ms_forget(s, at, dev, bytes, aux);
    ms_spin_unlock(&s->lock);
    return at >= 0;
}

int ms_track_remove(int kind, uint64_t key, int *dev, uint64_t *bytes) {
    return ms_track_remove_aux(kind, key, dev, bytes, NULL);
}

static int ms_locked_free_begin(int kind, uint64_t key, uint32_t *ticket) {
    uint64_t h = ms_mix(kind, key);
    ms_shard *s = &ms_shards[h >> (64 - MS_SHARD_BITS)];
    ms_spin_lock(&s->lock);
    int64_t at = ms_find(s, kind, key, h);
    if (at >= 0) {
        ms_entry *e = &s->e[at];
        if (++s->tickets == 0) s->tickets = 1; /* 0 means "any" to ms_find_freeing */
        e->state = MS_E_FREEING;
        e->ticket = s->tickets;
        e->freers = 1;
        e->freed = 0;
    } else if ((at = ms_find_freeing(s, kind, key, h, 0)) >= 0 && s->e[at].freers < UINT16_MAX) {
        s->e[at].freers++; /* another free of this key is in flight: join it */
    } else {
        at = -1;
    }
    if (at >= 0) *ticket = s->e[at].ticket;
    ms_spin_unlock(&s->lock);
    return at >= 0;
}

static int ms_locked_free_end(int kind, uint64_t key, uint32_t ticket, int freed, int *dev, uint64_t *bytes) {
    uint64_t h = ms_mix(kind, key);
    ms_shard *s = &ms_shards[h >> (64 - MS_SHARD_BITS)];
    int rc = 0;
    ms_spin_lock(&s->lock);
    int64_t at = ms_find_freeing(s, kind, key, h, ticket);
    if (at >= 0) {
        ms_entry *e = &s->e[at];
        e->freed |= freed != 0;
        if (--e->freers == 0) {
            if (e->freed) {
                ms_forget(s, at, dev, bytes, NULL);
                rc = 1;
            } else {
                e->state = MS_E_FULL; /* the driver kept it: so does the tracker */
            }
        }
    }
    ms_spin_unlock(&s->lock);
    return rc;
}

/* ---- Device pointers: the lock-free table (its layout and fast paths: track_fast.h) ---- */
ms_pslot *ms_ptab;
static int ms_ptab_failed;

static ms_pslot *ms_ptab_get(int create) {
    ms_pslot *t = __atomic_load_n(&ms_ptab, __ATOMIC_ACQUIRE);
    if (t != NULL || !create || __atomic_load_n(&ms_ptab_failed, __ATOMIC_RELAXED)) return t;
    size_t len = (size_t)MS_PTR_SLOTS * sizeof(ms_pslot);
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        __atomic_store_n(&ms_ptab_failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    if (!__atomic_compare_exchange_n(&ms_ptab, &t, (ms_pslot *)m, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        munmap(m, len); /* another thread installed one first: use that (t) */
        return t;
    }
    return (ms_pslot *)m;
}

int ms_track_add_ptr(uint64_t key, int dev, uint64_t bytes) {
    ms_pslot *t = dev >= 0 && dev <= 0xff ? ms_ptab_get(1) : NULL;
    uint64_t h = ms_ptr_hash(key);
    for (uint32_t i = 0; t != NULL && i < MS_PTR_PROBES; i++) {
        ms_pslot *p = &t[(h + i) & (MS_PTR_SLOTS - 1)];
        uint64_t w = __atomic_load_n(&p->word, __ATOMIC_ACQUIRE);
        while (P_STATE(w) == MS_P_EMPTY || P_STATE(w) == MS_P_TOMB) {
            uint32_t gen = P_GEN(w) + 1;
            if (!ms_pcas(&p->word, &w, P_WORD(MS_P_BUSY, 0, 0, 0, gen))) continue; /* w reloaded */
            __atomic_store_n(&p->key, key, __ATOMIC_RELAXED);
            __atomic_store_n(&p->bytes, bytes, __ATOMIC_RELAXED);
            __atomic_store_n(&p->word, P_WORD(MS_P_FULL, dev, 0, 0, gen), __ATOMIC_RELEASE);
            return 0;
        }
    }
    return ms_track_add(MS_TRACK_PTR, key, dev, bytes); /* no room nearby, or no table */
}

/* Lock-free free_begin; a ticket is (generation << 32 | slot << 1 | 1). */
int ms_ptr_free_begin(uint64_t key, uint64_t *ticket) {
    ms_pslot *t = ms_ptab_get(0);
    uint64_t h = ms_ptr_hash(key);
    while (t != NULL) {
        ms_pslot *join = NULL; /* the newest FREEING entry of the key seen, if there is no FULL one */
        uint64_t join_w = 0;
        uint32_t i = 0;
        for (; i < MS_PTR_PROBES; i++) {
            ms_pslot *p = &t[(h + i) & (MS_PTR_SLOTS - 1)];
            uint64_t w = __atomic_load_n(&p->word, __ATOMIC_ACQUIRE);
            unsigned st = P_STATE(w);
            if (st == MS_P_EMPTY) break;
            if ((st != MS_P_FULL && st != MS_P_FREEING) || __atomic_load_n(&p->key, __ATOMIC_RELAXED) != key) continue;
            if (st == MS_P_FULL) {
                if (!ms_pcas(&p->word, &w, P_WORD(MS_P_FREEING, P_DEV(w), 0, 1, P_GEN(w)))) {
                    i--; /* changed under us: look at this slot again */
                    continue;
                }
                *ticket = (uint64_t)P_GEN(w) << 32 | (uint64_t)((h + i) & (MS_PTR_SLOTS - 1)) << 1 | 1;
                return 1;
            }
            if (join == NULL || (int32_t)(P_GEN(w) - P_GEN(join_w)) > 0) join = p, join_w = w;
        }
        if (join == NULL || P_FREERS(join_w) == 0xffff) break;
        uint64_t w = join_w;
        if (ms_pcas(&join->word, &w, join_w + ((uint64_t)1 << 12))) {
            *ticket = (uint64_t)P_GEN(join_w) << 32 | (uint64_t)(join - t) << 1 | 1;
            return 1;
        }
        /* the entry moved on (its last free ended, or another joined): look again */
    }
    uint32_t small;
    if (!__atomic_load_n(&ms_ptr_locked, __ATOMIC_SEQ_CST) || !ms_locked_free_begin(MS_TRACK_PTR, key, &small))
        return 0;
    *ticket = (uint64_t)small << 1;
    return 1;
}

int ms_track_free_begin(int kind, uint64_t key, uint64_t *ticket) {
    if (kind == MS_TRACK_PTR) return ms_ptr_free_begin(key, ticket);
    uint32_t small;
    if (!ms_locked_free_begin(kind, key, &small)) return 0;
    *ticket = (uint64_t)small << 1;
    return 1;
}

int ms_track_free_end(int kind, uint64_t key, uint64_t ticket, int freed, int *dev, uint64_t *bytes) {
    if (ticket & 1) return ms_ptr_free_end(ticket, freed, dev, bytes);
    return ms_locked_free_end(kind, key, (uint32_t)(ticket >> 1), freed, dev, bytes);
}
