/* Parser for CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (grammar in limits.h, same as mpsd/units.py).
 *
 * Pure: no allocation, no I/O, no locale; works on bytes, so it may run while the dynamic
 * loader is still relocating or while environ is being read. Every malformation is an error
 * with a one-line reason naming the offending text, never "no cap". */
#include "limits.h"

#include <string.h>
#include <strings.h>

#define MS_LIMITS_FORM "DEVICE=SIZE[,DEVICE=SIZE...] with DEVICE an ordinal or GPU UUID (e.g. 0=4G,1=512M)"
#define MS_SIZE_FORM "a byte count with an optional K, M, G or T suffix (e.g. 512M, 4G)"
#define MS_QUOTE_MAX 120 /* longest piece of input quoted in a message */

static int ms_is_digit(char c) { return c >= '0' && c <= '9'; }

static int ms_is_uuid_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || ms_is_digit(c) || c == '-' || c == '/' ||
           c == '_';
}

/* Digits only, at least one; *out saturates at UINT64_MAX and the return says whether it did. */
static int ms_parse_digits(const char *s, size_t len, uint64_t *out) {
    uint64_t v = 0;
    int overflow = 0;
    for (size_t i = 0; i < len; i++) {
        uint64_t d = (uint64_t)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10) {
            overflow = 1;
            v = UINT64_MAX;
        } else if (!overflow) {
            v = v * 10 + d;
        }
    }
    *out = v;
    return overflow;
}

static int ms_unit_shift(char c) {
    switch (c) {
    case 'K': case 'k': return 10;
    case 'M': case 'm': return 20;
    case 'G': case 'g': return 30;
    case 'T': case 't': return 40;
    default: return -1;
    }
}

/* 0 ok, 1 malformed, 2 larger than 2^64-1. */
static int ms_size(const char *s, size_t len, uint64_t *out) {
    size_t n = 0;
    while (n < len && ms_is_digit(s[n])) n++;
    if (n == 0) return 1;
    int shift = 0;
    size_t rest = len - n;
    if (rest > 0) {
        shift = ms_unit_shift(s[n]);
        if (shift < 0) return 1;
        if (rest == 2 && s[n + 1] != 'B' && s[n + 1] != 'b') return 1;
        if (rest > 2) return 1;
    }
    uint64_t v;
    if (ms_parse_digits(s, n, &v)) return 2;
    if (shift > 0 && v > (UINT64_MAX >> shift)) return 2;
    *out = v << shift;
    return 0;
}

int ms_parse_size(const char *s, size_t len, uint64_t *out) {
    uint64_t v = 0;
    if (s == NULL || out == NULL || ms_size(s, len, &v) != 0) return -1;
    *out = v;
    return 0;
}

/* --- messages: a tiny bounded writer, no printf (no allocation, no locale) --- */

typedef struct ms_msg {
    char *buf;
    size_t cap, len;
} ms_msg;

static void ms_msg_char(ms_msg *m, char c) {
    if (m->cap == 0) return;
    if (m->len + 1 < m->cap) m->buf[m->len++] = c;
    m->buf[m->len < m->cap ? m->len : m->cap - 1] = '\0';
}

static void ms_msg_str(ms_msg *m, const char *s) {
    while (*s) ms_msg_char(m, *s++);
}

/* 'text' with quotes and non-printable bytes as \xNN, cut at MS_QUOTE_MAX bytes with "...". */
static void ms_msg_quote(ms_msg *m, const char *s, size_t len) {
    static const char hex[] = "0123456789abcdef";
    ms_msg_char(m, '\'');
    for (size_t i = 0; i < len; i++) {
        if (i == MS_QUOTE_MAX) {
            ms_msg_str(m, "...");
            break;
        }
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c >= 0x7f || c == '\'' || c == '\\') {
            ms_msg_char(m, '\\');
            ms_msg_char(m, 'x');
            ms_msg_char(m, hex[c >> 4]);
            ms_msg_char(m, hex[c & 15]);
        } else {
            ms_msg_char(m, (char)c);
        }
    }
    ms_msg_char(m, '\'');
}

static int ms_fail(ms_msg *m, const char *text, const char *what, const char *piece, size_t plen,
                   const char *why) {
    m->len = 0;
    ms_msg_str(m, "bad limits ");
    ms_msg_quote(m, text, strlen(text));
    ms_msg_str(m, ": ");
    ms_msg_str(m, what);
    if (piece != NULL) {
        ms_msg_char(m, ' ');
        ms_msg_quote(m, piece, plen);
    }
    ms_msg_str(m, why);
    return -1;
}

/* --- keys --- */

static int ms_same_key(const ms_limit *a, const ms_limit *b) {
    if (a->ordinal >= 0 || b->ordinal >= 0) return a->ordinal == b->ordinal;
    return strcmp(a->uuid, b->uuid) == 0;
}

static int ms_is_uuid(const char *s, size_t len) {
    if (len < 5 || (memcmp(s, "GPU-", 4) != 0 && memcmp(s, "MIG-", 4) != 0)) return 0;
    for (size_t i = 4; i < len; i++)
        if (!ms_is_uuid_char(s[i])) return 0;
    return 1;
}

int ms_parse_limits(const char *text, ms_limits *out, char *err, size_t errlen) {
    ms_msg m = {err, errlen, 0};
    if (err != NULL && errlen > 0) err[0] = '\0';
    if (out == NULL) return -1;
    out->count = 0;
    if (text == NULL) return ms_fail(&m, "", "no text", NULL, 0, "");
    if (text[0] == '\0') return 0;

    const char *p = text;
    for (;;) {
        const char *end = strchr(p, ',');
        if (end == NULL) end = p + strlen(p);
        size_t elen = (size_t)(end - p);
        const char *eq = memchr(p, '=', elen);
        if (eq == NULL)
            return ms_fail(&m, text, elen ? "entry" : "empty entry", elen ? p : NULL, elen,
                           ": expected " MS_LIMITS_FORM);

        ms_limit item;
        memset(&item, 0, sizeof item);
        const char *key = p;
        size_t klen = (size_t)(eq - p);
        size_t digits = 0;
        while (digits < klen && ms_is_digit(key[digits])) digits++;
        if (klen > 0 && digits == klen) {
            uint64_t ord;
            if (ms_parse_digits(key, klen, &ord) || ord >= MS_MAX_DEVICES)
                return ms_fail(&m, text, "device", key, klen, ": ordinals run from 0 to 63");
            item.ordinal = (int)ord;
        } else if (ms_is_uuid(key, klen)) {
            if (klen >= MS_UUID_MAX)
                return ms_fail(&m, text, "device", key, klen, ": a UUID has at most 95 characters");
            item.ordinal = -1;
            memcpy(item.uuid, key, klen);
            item.uuid[klen] = '\0';
        } else {
            return ms_fail(&m, text, "device", key, klen,
                           ": expected an ordinal (0, 1, ...) or a GPU UUID (GPU-... or MIG-...)");
        }
        for (int i = 0; i < out->count; i++)
            if (ms_same_key(&out->item[i], &item))
                return ms_fail(&m, text, "device", key, klen, " given twice");
        if (out->count == MS_MAX_DEVICES)
            return ms_fail(&m, text, "more than 64 entries", NULL, 0, "");

        const char *size = eq + 1;
        size_t slen = (size_t)(end - size);
        int rc = ms_size(size, slen, &item.bytes);
        if (rc == 1) return ms_fail(&m, text, "size", size, slen, ": expected " MS_SIZE_FORM);
        if (rc == 2) return ms_fail(&m, text, "size", size, slen, ": larger than 2**64-1 bytes");
        out->item[out->count++] = item;
        if (*end == '\0') return 0;
        p = end + 1;
    }
}

int ms_limits_find(const ms_limits *l, int ordinal, const char *uuid, uint64_t *cap) {
    if (l == NULL) return 0;
    /* An ordinal entry is looked for first, so it wins when both an ordinal and a UUID entry
     * name the same device. UUIDs compare without case: tools print hex in either case. */
    for (int i = 0; i < l->count; i++) {
        if (l->item[i].ordinal >= 0 && l->item[i].ordinal == ordinal) {
            if (cap) *cap = l->item[i].bytes;
            return 1;
        }
    }
    if (uuid == NULL || uuid[0] == '\0') return 0;
    for (int i = 0; i < l->count; i++) {
        if (l->item[i].ordinal < 0 && strcasecmp(l->item[i].uuid, uuid) == 0) {
            if (cap) *cap = l->item[i].bytes;
            return 1;
        }
    }
    return 0;
}
