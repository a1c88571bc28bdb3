/* mpsshim_usage: the region snapshot for tools (the Python reader, shim.usage()).
 * path NULL or "" means the path this process would use (MPSSHIM_REGION or the default, which,
 * as when the shim opens it, must be this UID's own file). mpsshim_usage_fd reads a region the
 * caller opened and checked (shim.usage(): a name in a pod's directory is opened once), or a
 * private copy of it with liveness tested on the file itself (lock_fd). */
#include "hooks.h"
#include "state.h"

MS_EXPORT int mpsshim_usage(const char *path, ms_snapshot *out, char *err, size_t errlen);
MS_EXPORT int mpsshim_usage_fd(int fd, int lock_fd, ms_snapshot *out, char *err, size_t errlen);
MS_EXPORT size_t mpsshim_region_size(void);
MS_EXPORT size_t mpsshim_region_size_of(uint32_t layout);
MS_EXPORT int mpsshim_layout(void);

MS_EXPORT int mpsshim_usage(const char *path, ms_snapshot *out, char *err, size_t errlen)
{
    char buf[4096];
    unsigned flags = 0;
    if (path == NULL || path[0] == '\0') {
        flags = ms_region_path(buf, sizeof buf) ? 0 : MS_OPEN_OWNED;
        path = buf;
    }
    return ms_region_snapshot_ex(path, flags, out, err, errlen);
}

MS_EXPORT int mpsshim_usage_fd(int fd, int lock_fd, ms_snapshot *out, char *err, size_t errlen)
{
    return ms_region_snapshot_fd(fd, lock_fd, out, err, errlen);
}

/* The size of every region file of this layout: a reader checks a file's size with it before
 * it copies a byte (shim.usage), rather than copying a pod's oversized file to refuse it. */
MS_EXPORT size_t mpsshim_region_size(void)
{
    return sizeof(ms_hdr);
}

/* The size of a region file of `layout` that mpsshim_usage reads (this one, and layout 2); 0
 * for any other. A reader checks a file's size with the layout its header names. */
MS_EXPORT size_t mpsshim_region_size_of(uint32_t layout)
{
    return ms_region_file_size(layout);
}

/* The layout of the regions this library creates and charges: mpsd installs it for containers
 * as libmpsshim.so.<layout> (docs/shim.md, "Upgrades"). */
MS_EXPORT int mpsshim_layout(void)
{
    return MS_LAYOUT_VERSION;
}
