/* The region file's layout (region.h): filling a new header, validating a file, and the
 * invariant (totals == the sum of the slots' shares and reserves). Pure functions of the mapped file; the
 * bottom layer of the region core, calling nothing else of it. */
#include "region_impl.h"

#include <stdio.h>
#include <string.h>

uint64_t ms_slot_share(const ms_slot *s, int d) {
    uint64_t sum = 0;
    for (int i = 0; i < MS_LANES; i++) sum += ms_ld(&s->lane[i].share[d]);
    return sum;
}

uint64_t ms_slot_rsv(const ms_slot *s, int d) {
    uint64_t sum = 0;
    if (d < MS_RSV_DEVS)
        for (int i = 0; i < MS_LANES; i++) sum += ms_ld(&s->lane[i].rsv[d].val);
    return sum;
}

uint64_t ms_region_rsv(const ms_hdr *h, int d) {
    uint64_t sum = 0;
    if (d < MS_RSV_DEVS)
        for (int i = 0; i < MS_SLOTS; i++)
            if (__atomic_load_n(&h->slot[i].state, __ATOMIC_ACQUIRE) != 0) sum += ms_slot_rsv(&h->slot[i], d);
    return sum;
}

void ms_layout_fill(ms_hdr *h) {
    h->version = MS_LAYOUT_VERSION;
    h->abi = MS_ABI;
    h->file_size = sizeof(ms_hdr);
    h->nslots = MS_SLOTS;
    h->ndevices = MS_MAX_DEVICES;
    h->nlanes = MS_LANES;
    uint64_t magic;
    memcpy(&magic, MS_MAGIC, sizeof magic);
    __atomic_store_n((uint64_t *)(void *)h->magic, magic, __ATOMIC_RELEASE); /* last: the header is whole */
}

/* Magic and version, from the first bytes (before the size is judged). */
int ms_version_check(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    if (memcmp(h->magic, MS_MAGIC, sizeof h->magic) != 0) {
        snprintf(err, errlen, "region %.200s has a bad magic number: not an mpsshim region, or overwritten", path);
        return -1;
    }
    if (h->version != MS_LAYOUT_VERSION) {
        snprintf(err, errlen,
                 "region %.200s has layout version %u; this shim reads only version %d (a region of another "
                 "shim version: remove it once no process uses it)",
                 path, h->version, MS_LAYOUT_VERSION);
        return -1;
    }
    return 0;
}

int ms_layout_check(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    if (ms_version_check(h, path, err, errlen) != 0) return -1;
    if (h->abi != MS_ABI || h->file_size != sizeof(ms_hdr) || h->nslots != MS_SLOTS ||
        h->ndevices != MS_MAX_DEVICES || h->nlanes != MS_LANES) {
        snprintf(err, errlen, "region %.200s was written by a shim with another layout (abi %#x, %u slots, %u devices)",
                 path, h->abi, h->nslots, h->ndevices);
        return -1;
    }
    for (int i = 0; i < MS_SLOTS; i++) {
        uint64_t st = __atomic_load_n(&h->slot[i].state, __ATOMIC_RELAXED);
        if ((st & 0xff) > MS_SLOT_CLAIMED || (st != 0 && (st >> 8) == 0)) {
            snprintf(err, errlen, "region %.200s is corrupted: process slot %d has state %#llx", path, i,
                     (unsigned long long)st);
            return -1;
        }
    }
    return 0;
}

/* Every lane's sequence numbers, summed: they only grow, so an unchanged sum means no
 * operation began or ended anywhere in the file meanwhile. */
static uint64_t ms_seq_sum(const ms_hdr *h) {
    uint64_t sum = 0;
    for (int i = 0; i < MS_SLOTS; i++)
        for (int k = 0; k < MS_LANES; k++)
            sum += __atomic_load_n(&h->slot[i].lane[k].pseq, __ATOMIC_ACQUIRE) + ms_ld(&h->slot[i].lane[k].dseq);
    return sum;
}

/* The invariant, per device, where it can be told without a lock: no operation in flight on
 * the device, and none begun or ended while the slots were summed (a charge from a reserve
 * leaves the device's word alone, so its tag cannot tell). */
int ms_check_totals(const ms_hdr *h, const char *path, char *err, size_t errlen) {
    uint64_t val[MS_MAX_DEVICES], sum[MS_MAX_DEVICES] = {0};
    char busy[MS_MAX_DEVICES] = {0};
    uint64_t seqs = ms_seq_sum(h);
    for (int d = 0; d < MS_MAX_DEVICES; d++) val[d] = ms_ld(&h->used[d].val);
    for (int i = 0; i < MS_SLOTS; i++)
        for (int k = 0; k < MS_LANES; k++) {
            const ms_lane *L = &h->slot[i].lane[k];
            uint32_t dev = __atomic_load_n(&L->pdev, __ATOMIC_RELAXED) & 0x7f;
            if (ms_ld(&L->pseq) != ms_ld(&L->dseq)) {
                if (dev >= MS_MAX_DEVICES) return 0; /* in flight on a device we cannot tell */
                busy[dev] = 1;
            }
            for (int d = 0; d < MS_MAX_DEVICES; d++) sum[d] += ms_ld(&L->share[d]);
            for (int d = 0; d < MS_RSV_DEVS; d++) sum[d] += ms_ld(&L->rsv[d].val);
        }
    if (ms_seq_sum(h) != seqs) return 0; /* operations ran meanwhile: no verdict */
    for (int d = 0; d < MS_MAX_DEVICES; d++) {
        if (busy[d] || ms_ld(&h->used[d].val) != val[d]) continue;
        if (sum[d] != val[d]) {
            snprintf(err, errlen, "region %.200s is corrupted: device %d total %llu differs from its processes' sum %llu",
                     path, d, (unsigned long long)val[d], (unsigned long long)sum[d]);
            return -1;
        }
    }
    return 0;
}
