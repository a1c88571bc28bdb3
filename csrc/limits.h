/* Parsing of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, MPS's syntax. Pure: no allocation, no I/O.
 *
 * Grammar (mpsd/units.py implements the same; tests compare the two):
 *   size   := DIGITS [UNIT]        UNIT := (K|M|G|T) [B], case-insensitive, powers of 1024
 *   key    := DIGITS (ordinal < MS_MAX_DEVICES) | UUID ("GPU-" or "MIG-" then [A-Za-z0-9/_-]+)
 *   limits := key "=" size ("," key "=" size)*
 * No whitespace, no duplicate key, no value above 2^64-1. "" means no limits.
 * Bounds of the fixed table (units.py has none): at most MS_MAX_DEVICES entries, UUIDs of at
 * most MS_UUID_MAX - 1 characters; beyond them the string is refused, never cut. */
#ifndef MPSSHIM_LIMITS_H
#define MPSSHIM_LIMITS_H

#include <stddef.h>
#include <stdint.h>

#define MS_MAX_DEVICES 64
#define MS_UUID_MAX 96 /* including the NUL */

typedef struct ms_limit {
    int ordinal;              /* -1 when keyed by UUID */
    char uuid[MS_UUID_MAX];   /* "" when keyed by ordinal */
    uint64_t bytes;
} ms_limit;

typedef struct ms_limits {
    int count;
    ms_limit item[MS_MAX_DEVICES];
} ms_limits;

/* Parse exactly `len` bytes of `s` as a size. 0 on success, -1 on any malformation or overflow. */
int ms_parse_size(const char *s, size_t len, uint64_t *out);

/* Parse a whole limit string. 0 on success; -1 with a one-line reason in err (always NUL-terminated). */
int ms_parse_limits(const char *text, ms_limits *out, char *err, size_t errlen);

/* The cap for a device known by ordinal and (optionally, may be NULL) UUID; an ordinal entry
 * wins over a UUID entry only if both match. Returns 1 and sets *cap if capped, 0 if not. */
int ms_limits_find(const ms_limits *l, int ordinal, const char *uuid, uint64_t *cap);

#endif
