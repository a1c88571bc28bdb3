/* Prints the layout of ms_snapshot (csrc/region.h) as the C compiler sees it, one
 * "name value" per line, for comparison with the cffi mirror in shim/_usage.py. */
#include <stddef.h>
#include <stdio.h>

#include "region.h"

#define SHOW(expr) printf("%s %zu\n", #expr, (size_t)(expr))

int main(void) {
    SHOW(sizeof(ms_snapshot));
    SHOW(sizeof(ms_proc_usage));
    SHOW(offsetof(ms_snapshot, version));
    SHOW(offsetof(ms_snapshot, nprocs));
    SHOW(offsetof(ms_snapshot, cap));
    SHOW(offsetof(ms_snapshot, used));
    SHOW(offsetof(ms_snapshot, procs));
    SHOW(offsetof(ms_proc_usage, pid));
    SHOW(offsetof(ms_proc_usage, alive));
    SHOW(offsetof(ms_proc_usage, used));
    SHOW(MS_MAX_DEVICES);
    SHOW(MS_SNAPSHOT_MAX_PROCS);
    return 0;
}
