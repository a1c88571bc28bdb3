/* mpsshim_usage: the region snapshot for tools (the Python reader, shim.usage()).
 * path NULL or "" means the path this process would use (MPSSHIM_REGION or the default). */
#include "hooks.h"
#include "state.h"

MS_EXPORT int mpsshim_usage(const char *path, ms_snapshot *out, char *err, size_t errlen);

MS_EXPORT int mpsshim_usage(const char *path, ms_snapshot *out, char *err, size_t errlen)
{
    char buf[4096];
    if (path == NULL || path[0] == '\0') {
        ms_region_path(buf, sizeof buf);
        path = buf;
    }
    return ms_region_snapshot(path, out, err, errlen);
}
