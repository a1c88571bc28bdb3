/* The tracker's table of device pointers (every cuMemAlloc the shim charges), laid out here
 * so that the allocation hooks (hooks_mem.c) reach its common case inline: an add that finds
 * its first slot free, a free whose entry sits in its first slot, and every free's end. Anything
 * else is the full function of track.c (contract: track.h). */
#ifndef MPSSHIM_TRACK_FAST_H
#define MPSSHIM_TRACK_FAST_H

#include <stddef.h>
#include <stdint.h>

#include "track.h"

/* MS_PTR_SLOTS slots reserved with mmap on first use (pages appear as they are touched). A slot's
 * state word holds its state, generation, device, freers and freed flag; key and size sit beside
 * it. Every transition is one CAS on the word:
 *   add         EMPTY/TOMB -> BUSY (generation + 1), write key and size, then store FULL (release)
 *   free_begin  FULL -> FREEING with 1 freer; or FREEING n -> n + 1 (a racing free joins)
 *   free_end    FREEING n -> n - 1; the last: TOMB if any of them freed, else FULL again
 * A reader loads the word (acquire), then the key; its CAS succeeding proves the word, generation
 * included, did not change, so the slot was not reused and the key belonged to it. EMPTY never
 * comes back, so a lookup may stop at the first EMPTY slot. A probe of MS_PTR_PROBES slots finding
 * no room, or no table, sends the pointer to the locked shards (lookups then look there too). A
 * pointer added twice without a free between (a free the shim did not see) is two entries. After
 * fork a child keeps what other threads were doing: a slot left BUSY is lost to it, an entry left
 * FREEING keeps its charge (CUDA is not usable in such a child anyway). */
#define MS_PTR_BITS 16
#define MS_PTR_SLOTS (1u << MS_PTR_BITS)
#define MS_PTR_PROBES 64

enum { MS_P_EMPTY = 0, MS_P_BUSY = 1, MS_P_FULL = 2, MS_P_FREEING = 3, MS_P_TOMB = 4 };
#define P_STATE(w) ((unsigned)((w) & 7))
#define P_DEV(w) ((int)(((w) >> 3) & 0xff))
#define P_FREED(w) ((unsigned)(((w) >> 11) & 1))
#define P_FREERS(w) ((unsigned)(((w) >> 12) & 0xffff))
#define P_GEN(w) ((uint32_t)((w) >> 32))
#define P_WORD(state, dev, freed, freers, gen) \
    ((uint64_t)(state) | (uint64_t)(dev) << 3 | (uint64_t)(freed) << 11 | (uint64_t)(freers) << 12 | (uint64_t)(gen) << 32)

typedef struct ms_pslot {
    uint64_t word;
    uint64_t key;
    uint64_t bytes;
    uint64_t pad;
} ms_pslot;

extern ms_pslot *ms_ptab __attribute__((visibility("hidden"))); /* NULL until the first add */

/* A pointer's first slot: Fibonacci hashing of the pointer (the driver's are aligned and often
 * consecutive: the multiplication spreads them over the table). */
static inline uint64_t ms_ptr_hash(uint64_t key) { return (key >> 8) * 0x9e3779b97f4a7c15ull >> (64 - MS_PTR_BITS); }

static inline int ms_pcas(uint64_t *w, uint64_t *old, uint64_t new_word) {
    return __atomic_compare_exchange_n(w, old, new_word, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* The full functions (track.c). */
int ms_ptr_free_begin(uint64_t key, uint64_t *ticket) __attribute__((visibility("hidden")));

static inline __attribute__((always_inline)) int ms_track_add_ptr_fast(uint64_t key, int dev, uint64_t bytes) {
    ms_pslot *t = __atomic_load_n(&ms_ptab, __ATOMIC_ACQUIRE);
    if (__builtin_expect(t != NULL && (unsigned)dev <= 0xff, 1)) {
        ms_pslot *p = &t[ms_ptr_hash(key)];
        uint64_t w = __atomic_load_n(&p->word, __ATOMIC_ACQUIRE);
        if ((P_STATE(w) == MS_P_EMPTY || P_STATE(w) == MS_P_TOMB) &&
            ms_pcas(&p->word, &w, P_WORD(MS_P_BUSY, 0, 0, 0, P_GEN(w) + 1))) {
            __atomic_store_n(&p->key, key, __ATOMIC_RELAXED);
            __atomic_store_n(&p->bytes, bytes, __ATOMIC_RELAXED);
            __atomic_store_n(&p->word, P_WORD(MS_P_FULL, dev, 0, 0, P_GEN(w) + 1), __ATOMIC_RELEASE);
            return 0;
        }
    }
    return ms_track_add_ptr(key, dev, bytes);
}

/* The common case of ms_track_free_begin(MS_TRACK_PTR, key): the entry in the pointer's first
 * slot, FULL, marked FREEING by this free alone. The slot, and the word written (the end expects
 * it), or NULL: then ms_ptr_free_begin does the rest (track.c). */
static inline __attribute__((always_inline)) ms_pslot *ms_ptr_mark_first(uint64_t key, uint64_t *word) {
    ms_pslot *t = __atomic_load_n(&ms_ptab, __ATOMIC_ACQUIRE);
    if (__builtin_expect(t == NULL, 0)) return NULL;
    ms_pslot *p = &t[ms_ptr_hash(key)];
    uint64_t w = __atomic_load_n(&p->word, __ATOMIC_ACQUIRE);
    /* FULL has freed and freers 0: FREEING with one freer is w + 1 + (1 << 12) */
    *word = w + (MS_P_FREEING - MS_P_FULL) + ((uint64_t)1 << 12);
    if (P_STATE(w) == MS_P_FULL && __atomic_load_n(&p->key, __ATOMIC_RELAXED) == key && ms_pcas(&p->word, &w, *word))
        return p;
    return NULL;
}

/* The ticket of a free marked by ms_ptr_mark_first (generation << 32 | slot << 1 | 1). */
static inline uint64_t ms_ptr_ticket(const ms_pslot *p, uint64_t word) {
    return (uint64_t)P_GEN(word) << 32 | (uint64_t)(p - ms_ptab) << 1 | 1;
}

/* The common end of such a free: the driver freed and no other free of the pointer joined, so the
 * slot still holds `word`: FREEING -> TOMB, 1 and the entry's device and size. 0 otherwise (then
 * ms_ptr_free_end with the ticket). */
static inline __attribute__((always_inline)) int ms_ptr_unmark_freed(ms_pslot *p, uint64_t word, int *dev,
                                                                     uint64_t *bytes) {
    uint64_t size = __atomic_load_n(&p->bytes, __ATOMIC_RELAXED); /* before the slot can be reused */
    if (!ms_pcas(&p->word, &word, word - ((uint64_t)1 << 12) - MS_P_FREEING + MS_P_TOMB)) return 0;
    *dev = P_DEV(word);
    *bytes = size;
    return 1;
}

/* The end of a free begun by ms_ptr_free_begin (ticket & 1): the entry's slot is in the ticket. */
static inline int ms_ptr_free_end(uint64_t ticket, int freed, int *dev, uint64_t *bytes) {
    ms_pslot *p = &ms_ptab[(ticket >> 1) & 0x7fffffff];
    uint64_t w = __atomic_load_n(&p->word, __ATOMIC_ACQUIRE);
    for (;;) {
        if (P_STATE(w) != MS_P_FREEING || P_GEN(w) != (uint32_t)(ticket >> 32)) return 0; /* not ours: a bug */
        unsigned n = P_FREERS(w) - 1, fr = P_FREED(w) | (freed != 0);
        uint64_t size = __atomic_load_n(&p->bytes, __ATOMIC_RELAXED); /* before the slot can be reused */
        uint64_t next = n > 0 ? P_WORD(MS_P_FREEING, P_DEV(w), fr, n, P_GEN(w))
                              : P_WORD(fr ? MS_P_TOMB : MS_P_FULL, P_DEV(w), 0, 0, P_GEN(w));
        if (!ms_pcas(&p->word, &w, next)) continue;
        if (n > 0 || !fr) return 0;
        if (dev) *dev = P_DEV(w);
        if (bytes) *bytes = size;
        return 1;
    }
}

#endif
