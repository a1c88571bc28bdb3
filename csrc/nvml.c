/* NVML memory queries (nvidia-smi, pynvml, framework probes) report the cap too.
 *
 * Which NVML device is capped: a limit keyed by UUID matches the NVML device with that UUID
 * (nvmlDeviceGetUUID); a limit keyed by ordinal matches the NVML device of that index
 * (nvmlDeviceGetIndex), or, for a MIG device handle (whose index counts MIG devices under its
 * GPU), the CUDA device with the MIG device's UUID. NVML indices are not renumbered by CUDA_VISIBLE_DEVICES (inside a
 * container they follow the devices the container sees, in PCI order), so when CUDA and NVML
 * numbering can differ, key the limit by UUID. The region's usage is kept per CUDA ordinal;
 * for the NVML device the ordinal is the CUDA device with the same UUID when this process
 * has the driver loaded and initialised, else the NVML index.
 * Reported: total = min(cap, total); used = min(region usage, total); free = min(free,
 * total - used). Uncapped devices and failed queries are untouched. */
#include <string.h>

#include "hooks.h"
#include "log.h"
#include "state.h"

enum { NVML_ERROR_LIBRARY_NOT_FOUND = 12 };

/* CUDA ordinal of the device with this UUID, if libcuda is loaded and initialised here. */
static int cuda_ordinal_of(const char *uuid)
{
    ms_cuDeviceGetCount_fn count_fn = (ms_cuDeviceGetCount_fn)ms_real_fn_loaded(MS_ID_cuDeviceGetCount);
    ms_cuDeviceGetUuid_fn uuid_fn = (ms_cuDeviceGetUuid_fn)ms_real_fn_loaded(MS_ID_cuDeviceGetUuid_v2);
    if (uuid_fn == NULL)
        uuid_fn = (ms_cuDeviceGetUuid_fn)ms_real_fn_loaded(MS_ID_cuDeviceGetUuid);
    int n = 0;
    if (count_fn == NULL || uuid_fn == NULL || count_fn(&n) != CUDA_SUCCESS)
        return -1;
    for (int d = 0; d < n && d < MS_MAX_DEVICES; d++) {
        CUuuid u;
        char text[64];
        if (uuid_fn(&u, d) != CUDA_SUCCESS)
            continue;
        ms_format_uuid(u.bytes, strncmp(uuid, "MIG-", 4) == 0 ? "MIG" : "GPU", text, sizeof text);
        if (strcmp(text, uuid) == 0)
            return d;
    }
    return -1;
}

/* 1 with the cap and the region ordinal if the NVML device is capped, else 0. */
static int nvml_cap(nvmlDevice_t device, uint64_t *cap, int *ordinal)
{
    if (!ms_caps_reported())
        return 0;
    const ms_state *s = ms_state_get();
    ms_nvmlDeviceGetIndex_fn index_fn = (ms_nvmlDeviceGetIndex_fn)ms_real_fn(MS_ID_nvmlDeviceGetIndex);
    ms_nvmlDeviceGetUUID_fn uuid_fn = (ms_nvmlDeviceGetUUID_fn)ms_real_fn(MS_ID_nvmlDeviceGetUUID);
    unsigned int index = 0;
    char uuid[96] = "";
    int have_index = index_fn != NULL && index_fn(device, &index) == NVML_SUCCESS && index < MS_MAX_DEVICES;
    if (uuid_fn == NULL || uuid_fn(device, uuid, sizeof uuid) != NVML_SUCCESS)
        uuid[0] = '\0';
    int d = uuid[0] ? cuda_ordinal_of(uuid) : -1;
    /* A MIG device handle's NVML index is its index under its GPU, not an ordinal: it is matched
     * by its UUID or by the CUDA device with that UUID (in a MIG container: device 0). */
    int mig = strncmp(uuid, "MIG-", 4) == 0;
    int key = mig ? d : have_index ? (int)index : -1;
    if (!ms_limits_find(&s->limits, key, uuid[0] ? uuid : NULL, cap))
        return 0;
    *ordinal = d >= 0 ? d : mig ? -1 : have_index ? (int)index : -1;
    return 1;
}

static void clamp(uint64_t cap, int ordinal, unsigned long long *total, unsigned long long *free_b,
                  unsigned long long *used)
{
    ms_region *r = ms_state_get()->region;
    uint64_t t = cap < *total ? cap : *total;
    uint64_t u = (r != NULL && ordinal >= 0) ? ms_region_used_live(r, ordinal) : (r == NULL ? t : 0);
    if (u > t)
        u = t;
    if (*free_b > t - u)
        *free_b = t - u;
    *total = t;
    *used = u;
}

nvmlReturn_t ms_hk_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    __typeof(ms_hk_nvmlDeviceGetMemoryInfo) *real = MS_REAL(nvmlDeviceGetMemoryInfo);
    if (real == NULL)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real(device, memory);
    uint64_t cap;
    int ordinal;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_cap(device, &cap, &ordinal))
        clamp(cap, ordinal, &memory->total, &memory->free, &memory->used);
    return rc;
}
MS_EXPORT_AS(nvmlDeviceGetMemoryInfo)

nvmlReturn_t ms_hk_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    __typeof(ms_hk_nvmlDeviceGetMemoryInfo_v2) *real = MS_REAL(nvmlDeviceGetMemoryInfo_v2);
    if (real == NULL)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real(device, memory);
    uint64_t cap;
    int ordinal;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_cap(device, &cap, &ordinal))
        clamp(cap, ordinal, &memory->total, &memory->free, &memory->used);
    return rc;
}
MS_EXPORT_AS(nvmlDeviceGetMemoryInfo_v2)
