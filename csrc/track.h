/* Process-local map from an allocation (device pointer, or cuMemCreate handle) to the device
 * and size it was charged with, so a free uncharges exactly what was charged, once. Thread-safe;
 * device pointers (ms_track_add_ptr, ms_track_free_begin/end) take no lock and allocate nothing
 * after the first add; other keys use locked shards with amortised growth. Unknown keys are
 * reported as such (the caller forwards the free without uncharging). */
#ifndef MPSSHIM_TRACK_H
#define MPSSHIM_TRACK_H

#include <stdint.h>

/* PTR: a device pointer; HANDLE: a cuMemCreate handle; MAP: a cuMemMap mapping (key = its
 * address, bytes = its size, aux = the handle mapped there). */
enum { MS_TRACK_PTR = 0, MS_TRACK_HANDLE = 1, MS_TRACK_MAP = 2 };

/* 0 on success, -1 if memory for the table could not be had. A new entry has one hold; adding
 * a key that is already there replaces its values (and its holds: 1). */
int ms_track_add(int kind, uint64_t key, int dev, uint64_t bytes);
/* Same, carrying a second value along. */
int ms_track_add_aux(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t aux);
/* 1 and the recorded device and size if the key was known (and is now forgotten), else 0. */
int ms_track_remove(int kind, uint64_t key, int *dev, uint64_t *bytes);
/* Same, also giving back the second value (0 if none was added). */
int ms_track_remove_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux);
/* Counted entries (a cuMemCreate handle lives while it is unreleased or mapped): add `delta` to
 * the entry's holds. -1 if the key is unknown; 0 if it is still held; 1 if its holds reached 0:
 * the entry is then forgotten and *dev, *bytes say what it was charged with. */
int ms_track_hold(int kind, uint64_t key, int delta, int *dev, uint64_t *bytes);

/* A free of (kind, key) around the driver's free, safe when several threads free one key at
 * once (a program's racing double free: the driver frees it once and refuses the others).
 * ms_track_free_begin, before the driver is asked: 1 and a ticket if the key is known (its entry
 * stays, marked as being freed, so that a free of the same key starting meanwhile joins this one
 * instead of finding nothing), else 0 (forward the free, nothing to give back).
 * ms_track_free_end, after it answered (`freed`: it freed): the last of the frees in flight of
 * one entry settles it. If any of them freed, the entry is forgotten and that caller alone gets 1
 * and *dev, *bytes (to uncharge exactly once); if none did, the entry is live again. Every other
 * call returns 0. */
int ms_track_free_begin(int kind, uint64_t key, uint64_t *ticket);
int ms_track_free_end(int kind, uint64_t key, uint64_t ticket, int freed, int *dev, uint64_t *bytes);

/* ms_track_add for a device pointer (MS_TRACK_PTR) on the shim's hot path: lock-free (track.c).
 * Such an entry is found by ms_track_free_begin/end only (not by ms_track_remove/hold), and a
 * pointer added twice without a free between is two entries rather than replaced. */
int ms_track_add_ptr(uint64_t key, int dev, uint64_t bytes);

#endif
