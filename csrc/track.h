/* Process-local map from an allocation (device pointer, or cuMemCreate handle) to the device
 * and size it was charged with, so a free uncharges exactly what was charged. Thread-safe,
 * no allocation on the fast path beyond amortised table growth. Unknown keys are reported as
 * such (the caller forwards the free without uncharging). */
#ifndef MPSSHIM_TRACK_H
#define MPSSHIM_TRACK_H

#include <stdint.h>

enum { MS_TRACK_PTR = 0, MS_TRACK_HANDLE = 1 };

/* 0 on success, -1 if memory for the table could not be had. */
int ms_track_add(int kind, uint64_t key, int dev, uint64_t bytes);
/* 1 and the recorded device and size if the key was known (and is now forgotten), else 0. */
int ms_track_remove(int kind, uint64_t key, int *dev, uint64_t *bytes);

#endif
