/* Virtual memory management: cuMemCreate charges, and the charge is given back when the
 * driver frees the memory, which is NOT at cuMemRelease alone. The driver frees a handle's
 * memory once it is released AND unmapped ("backing memory allocations will be freed if there
 * are no existing mappings and there are no unreleased memory handles", cuMemUnmap), so a
 * program may release right after mapping (the CUDA samples' idiom; NCCL retains and releases
 * handles of live buffers) and keep using the memory. The shim follows the same rule: a
 * charged handle holds one reference for itself, one per cuMemRetainAllocationHandle and one
 * per mapping, counted as the driver confirms them (track.h's ms_track_ref_*), so threads racing
 * on one handle cannot uncharge memory the driver still holds nor keep a charge it freed: the
 * call that ends last when the driver has freed it uncharges it, once.
 *
 * Mappings are remembered by address (with their size and handle, also for handles the shim
 * did not charge) so that one cuMemUnmap covering several adjacent mappings drops a reference
 * from each. cuMemCreate's device is prop->location.id when location.type is DEVICE (other
 * locations, e.g. host NUMA memory, are not device memory and pass through uncharged). */
#include <string.h>

#include "charge.h"
#include "hooks.h"
#include "log.h"
#include "track.h"

CUresult ms_hk_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags)
{
    __typeof(ms_hk_cuMemCreate) *real = MS_REAL(cuMemCreate);
    if (real == NULL)
        return ms_no_driver("cuMemCreate");
    int type = 0, dev = 0;
    if (prop != NULL) {
        memcpy(&type, (const char *)prop + MS_PROP_LOCATION_TYPE_OFFSET, sizeof type);
        memcpy(&dev, (const char *)prop + MS_PROP_LOCATION_ID_OFFSET, sizeof dev);
    }
    if (prop == NULL || type != CU_MEM_LOCATION_TYPE_DEVICE || dev < 0)
        return real(handle, size, prop, flags); /* not device memory, or the driver refuses it */
    ms_charge c;
    CUresult rc = ms_charge_begin("cuMemCreate", dev, size, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(handle, size, prop, flags);
    return ms_charge_end("cuMemCreate", &c, rc, MS_TRACK_HANDLE, rc == CUDA_SUCCESS ? *handle : 0, MS_UNDO_RELEASE);
}
MS_EXPORT_AS(cuMemCreate)

/* A call that may drop a reference of a tracked handle has ended (ok: the driver did it). */
static void ref_end(CUmemGenericAllocationHandle handle, uint64_t ticket, int add, int ok)
{
    int dev;
    uint64_t bytes;
    if (ms_track_ref_end(handle, ticket, add, ok, &dev, &bytes) == 1)
        ms_uncharge(dev, bytes);
}

CUresult ms_hk_cuMemRelease(CUmemGenericAllocationHandle handle)
{
    __typeof(ms_hk_cuMemRelease) *real = MS_REAL(cuMemRelease);
    if (real == NULL)
        return ms_no_driver("cuMemRelease");
    uint64_t ticket;
    int tracked = ms_tracking() && ms_track_ref_begin(handle, 0, &ticket);
    CUresult rc = real(handle);
    if (tracked)
        ref_end(handle, ticket, 0, rc == CUDA_SUCCESS);
    return rc;
}
MS_EXPORT_AS(cuMemRelease)

/* The mapping counts as an add in flight until the driver answers: a release or unmap ending
 * meanwhile cannot uncharge memory the map may be keeping. */
CUresult ms_hk_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags)
{
    __typeof(ms_hk_cuMemMap) *real = MS_REAL(cuMemMap);
    if (real == NULL)
        return ms_no_driver("cuMemMap");
    if (!ms_tracking())
        return real(ptr, size, offset, handle, flags);
    uint64_t ticket;
    int tracked = ms_track_ref_begin(handle, 1, &ticket);
    CUresult rc = real(ptr, size, offset, handle, flags);
    if (rc == CUDA_SUCCESS && ms_track_add_aux(MS_TRACK_MAP, ptr, -1, size, handle) != 0) {
        __typeof(ms_hk_cuMemUnmap) *unmap = MS_REAL(cuMemUnmap);
        if (unmap != NULL)
            unmap(ptr, size);
        ms_log(MS_LOG_ERROR, "cuMemMap refused: no memory to remember the mapping");
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (tracked)
        ref_end(handle, ticket, 1, rc == CUDA_SUCCESS);
    return rc;
}
MS_EXPORT_AS(cuMemMap)

typedef struct mapping {
    uint64_t va, size, handle, ticket;
    int tracked; /* the handle is tracked: a drop of its reference is in flight (ticket) */
} mapping;

/* Forget the mapping that starts at `va` if it lies inside [va, end); 0 if there is none. */
static int take_mapping(uint64_t va, uint64_t end, mapping *m)
{
    int dev;
    if (!ms_track_remove_aux(MS_TRACK_MAP, va, &dev, &m->size, &m->handle))
        return 0;
    m->va = va;
    if (m->size == 0 || m->size > end - va) { /* not a whole mapping: the driver refuses it */
        ms_track_add_aux(MS_TRACK_MAP, va, dev, m->size, m->handle);
        return 0;
    }
    m->tracked = ms_track_ref_begin(m->handle, 0, &m->ticket);
    return 1;
}

enum { UNMAP_BATCH = 64 };

/* The mappings in [ptr, ptr + size) are forgotten before the driver unmaps (an address mapped
 * again right after must not be forgotten instead) and remembered again if it refuses; each
 * mapped handle's reference is dropped once the driver has answered. */
CUresult ms_hk_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    __typeof(ms_hk_cuMemUnmap) *real = MS_REAL(cuMemUnmap);
    if (real == NULL)
        return ms_no_driver("cuMemUnmap");
    if (!ms_tracking())
        return real(ptr, size);
    uint64_t end = ptr + size < ptr ? UINT64_MAX : ptr + size, va = ptr;
    mapping m[UNMAP_BATCH];
    int n = 0;
    while (n < UNMAP_BATCH && va < end && take_mapping(va, end, &m[n]))
        va += m[n++].size;
    CUresult rc = real(ptr, size);
    for (int i = 0; i < n; i++) {
        if (rc != CUDA_SUCCESS)
            ms_track_add_aux(MS_TRACK_MAP, m[i].va, -1, m[i].size, m[i].handle);
        if (m[i].tracked)
            ref_end(m[i].handle, m[i].ticket, 0, rc == CUDA_SUCCESS);
    }
    mapping more; /* a range of more than one batch of mappings: the rest are gone too */
    while (rc == CUDA_SUCCESS && va < end && take_mapping(va, end, &more)) {
        if (more.tracked)
            ref_end(more.handle, more.ticket, 0, 1);
        va += more.size;
    }
    return rc;
}
MS_EXPORT_AS(cuMemUnmap)

/* The driver hands back the very handle value that was mapped; it must be released once more.
 * Which handle it is is known only once the driver answers, so while the call is in flight no
 * handle's last reference is taken as gone (track.h). */
CUresult ms_hk_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    __typeof(ms_hk_cuMemRetainAllocationHandle) *real = MS_REAL(cuMemRetainAllocationHandle);
    if (real == NULL)
        return ms_no_driver("cuMemRetainAllocationHandle");
    if (!ms_tracking())
        return real(handle, addr);
    ms_track_retain_begin();
    CUresult rc = real(handle, addr);
    int ok = rc == CUDA_SUCCESS && handle != NULL;
    ms_track_retain_end(ok, ok ? *handle : 0, ms_uncharge);
    return rc;
}
MS_EXPORT_AS(cuMemRetainAllocationHandle)
