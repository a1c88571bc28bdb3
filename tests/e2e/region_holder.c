/* Test helper: opens an accounting region with A1's core (csrc/region_*.c), charges what the
 * arguments say, reports, then holds the charges until stdin closes (or it is killed).
 *   region_holder PATH DEV:CAP:BYTES...   -> prints "ready" or "refused DEV in_use=N" or "error: ..." */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "region.h"

int main(int argc, char **argv) {
    char err[256];
    ms_region *r;
    if (argc < 2) return 2;
    if (ms_region_open(argv[1], &r, err, sizeof err) != 0) {
        printf("error: %s\n", err);
        return 1;
    }
    for (int i = 2; i < argc; i++) {
        int dev;
        uint64_t cap, bytes, in_use = 0;
        if (sscanf(argv[i], "%d:%" SCNu64 ":%" SCNu64, &dev, &cap, &bytes) != 3) return 2;
        int rc = ms_region_charge(r, dev, cap, bytes, &in_use);
        if (rc != MS_OK) {
            printf("refused %d in_use=%" PRIu64 "\n", dev, in_use);
            fflush(stdout);
            return 3;
        }
    }
    printf("ready\n");
    fflush(stdout);
    while (getchar() != EOF) {
    }
    ms_region_close(r);
    return 0;
}
