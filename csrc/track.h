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

/* 0 on success, -1 if memory for the table could not be had. Adding a key that is already there
 * replaces its values (a handle's references: 1), unless calls on that handle are in flight
 * (ms_track_ref_begin): then the driver freed the old one and handed its value out again, and
 * the new entry is a separate one. */
int ms_track_add(int kind, uint64_t key, int dev, uint64_t bytes);
/* Same, carrying a second value along. */
int ms_track_add_aux(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t aux);
/* 1 and the recorded device and size if the key was known (and is now forgotten), else 0. */
int ms_track_remove(int kind, uint64_t key, int *dev, uint64_t *bytes);
/* Same, also giving back the second value (0 if none was added). */
int ms_track_remove_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux);
/* A cuMemCreate handle's references (HANDLE entries, track_refs.c), counted as the driver counts
 * them, safe when threads race on one handle. A new entry has one (cuMemCreate's). Around each
 * driver call that may add a reference (cuMemMap: add 1) or drop one (cuMemRelease, cuMemUnmap:
 * add 0): ms_track_ref_begin before it, 1 and a ticket if the handle is tracked (else 0: nothing
 * to do after); ms_track_ref_end after it with ok = the driver did it. ms_track_ref_end returns 1,
 * with *dev and *bytes (either may be NULL), to the one caller that sees the driver must have
 * freed the memory (no confirmed reference left, no add in flight, no retain in flight anywhere):
 * the entry is then forgotten and that caller uncharges it; otherwise 0.
 * cuMemRetainAllocationHandle: ms_track_retain_begin before the driver, ms_track_retain_end
 * after it (ok: it succeeded and gave `handle`), which calls give_back(dev, bytes) for each
 * handle whose end waited on retains in flight. */
int ms_track_ref_begin(uint64_t handle, int add, uint64_t *ticket);
int ms_track_ref_end(uint64_t handle, uint64_t ticket, int add, int ok, int *dev, uint64_t *bytes);
void ms_track_retain_begin(void);
void ms_track_retain_end(int ok, uint64_t handle, void (*give_back)(int dev, uint64_t bytes));

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
 * Such an entry is found by ms_track_free_begin/end only (not by ms_track_remove/ref), and a
 * pointer added twice without a free between is two entries rather than replaced. */
int ms_track_add_ptr(uint64_t key, int dev, uint64_t bytes);

#endif
