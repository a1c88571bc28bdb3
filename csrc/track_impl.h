/* The tracker's locked shards, shared by track.c (generic entries, device pointers) and
 * track_refs.c (cuMemCreate handles' references). Not part of the tracker's contract (track.h). */
#ifndef MPSSHIM_TRACK_IMPL_H
#define MPSSHIM_TRACK_IMPL_H

#include "track.h"

#define MS_SHARD_BITS 6
#define MS_SHARDS (1 << MS_SHARD_BITS)
#define MS_SHARD_MIN 64

/* DEAD: a handle's entry whose value the driver handed out again while calls on it were in
 * flight (track_refs.c); found by its ticket only. */
enum { MS_E_EMPTY = 0, MS_E_FULL = 1, MS_E_TOMB = 2, MS_E_FREEING = 3, MS_E_DEAD = 4 };

typedef struct ms_entry {
    uint64_t key;
    uint64_t bytes;
    uint64_t aux;
    int32_t dev;
    int32_t holds;   /* HANDLE: references the driver confirmed (track_refs.c) */
    uint32_t ticket; /* which entry this is (a new one at each add, and at each FREEING marking) */
    int32_t adds;    /* HANDLE: calls in flight that may add a reference (cuMemMap) */
    uint32_t ops;    /* HANDLE: calls in flight on this entry (found again by ticket) */
    uint16_t freers; /* FREEING: frees in flight */
    uint8_t freed;   /* FREEING: one of them was done by the driver */
    uint8_t zero;    /* HANDLE: no reference left, waiting for retains in flight (track_refs.c) */
    uint8_t state;
    uint8_t kind;
} ms_entry;

typedef struct ms_shard {
    int lock;
    uint32_t cap; /* power of two, or 0 before the first add */
    uint32_t live, tombs; /* live: FULL, FREEING and DEAD entries */
    uint32_t tickets;     /* the last ticket handed out */
    ms_entry *e;
} __attribute__((aligned(64))) ms_shard;

extern ms_shard ms_shards[MS_SHARDS];
extern int ms_refs_zeros; /* entries with `zero` set (track_refs.c) */

void ms_spin_lock(int *l);
void ms_spin_unlock(int *l);
uint64_t ms_mix(int kind, uint64_t key);
/* Slot of the FULL entry of (kind, key), else -1. */
int64_t ms_find(const ms_shard *s, int kind, uint64_t key, uint64_t h);
/* Under the shard lock: forget entry `at`, giving its values back (any pointer may be NULL). */
void ms_forget(ms_shard *s, int64_t at, int *dev, uint64_t *bytes, uint64_t *aux);

static inline ms_shard *ms_shard_of(uint64_t h) { return &ms_shards[h >> (64 - MS_SHARD_BITS)]; }

#endif
