/* fake_nvml_gi.c: GPU instances and their profiles in the fake libnvidia-ml.so.1.
 *
 * As nvml.h (NVIDIA/go-nvml gen/nvml/nvml.h) documents them; choices where it is silent are
 * marked "inferred":
 * - nvmlDeviceGetGpuInstanceProfileInfo(device, profile, info): the profile's ID, slice count,
 *   SMs, engines and "memorySizeMB" for one of NVML_GPU_INSTANCE_PROFILE_* (0 .. 0x11);
 *   NVML_ERROR_NOT_SUPPORTED for a profile the GPU does not have, NVML_ERROR_INVALID_ARGUMENT for
 *   an ID past NVML_GPU_INSTANCE_PROFILE_COUNT. Not marked "Requires privileged user": answers
 *   everyone. A GPU supports the profiles of its `giprofile` lines and those its `mig` lines use.
 * - nvmlDeviceGetGpuInstanceById: "Requires privileged user" (NVML_ERROR_NO_PERMISSION without
 *   `privileged`); NVML_ERROR_NOT_FOUND when no GPU instance has that ID.
 * - nvmlGpuInstanceGetInfo: the parent, ID, profile ID and placement (start, size in memory
 *   slices: 1, 2, 4, 4 and 8 for 1, 2, 3, 4 and 7 compute slices, as an A100/H100 places them).
 */
#include <string.h>

#include "fake_nvml.h"

#define FAKE_MAX_GIPROFILES 64
#define FAKE_GI_PROFILE_COUNT 0x12u /* NVML_GPU_INSTANCE_PROFILE_COUNT */

typedef struct {
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

/* a GPU instance handle: one of its compute instances (a MIG device of the static table) */
typedef struct nvmlDevice_st *nvmlGpuInstance_t;

struct giprofile {
    unsigned int gpu;
    nvmlGpuInstanceProfileInfo_t info;
};

static struct giprofile g_profiles[FAKE_MAX_GIPROFILES];
static unsigned int g_nprofiles;

void giprofile_clear(void)
{
    g_nprofiles = 0;
}

const char *parse_giprofile_directive(char **w, int n)
{
    struct giprofile *p;
    unsigned int *fields[9];
    int i;
    if (n != 11)
        return "giprofile needs: gpu id slices mem_mib sms ce dec enc jpg ofa";
    if (g_nprofiles >= FAKE_MAX_GIPROFILES)
        return "too many giprofile lines";
    p = &g_profiles[g_nprofiles];
    memset(p, 0, sizeof(*p));
    fields[0] = &p->gpu;
    fields[1] = &p->info.id;
    fields[2] = &p->info.sliceCount;
    fields[3] = NULL;
    fields[4] = &p->info.multiprocessorCount;
    fields[5] = &p->info.copyEngineCount;
    fields[6] = &p->info.decoderCount;
    fields[7] = &p->info.encoderCount;
    fields[8] = &p->info.jpegCount;
    for (i = 0; i < 9; i++)
        if (fields[i] != NULL && parse_uint(w[i + 1], fields[i]) != 0)
            return "giprofile fields must be non-negative integers";
    if (parse_uint(w[10], &p->info.ofaCount) != 0 || parse_u64(w[4], &p->info.memorySizeMB) != 0)
        return "giprofile fields must be non-negative integers";
    if (p->gpu >= g_ngpus || p->info.id >= FAKE_GI_PROFILE_COUNT)
        return "giprofile needs a gpu defined above and a profile id below 0x12";
    g_nprofiles++;
    return NULL;
}

static unsigned int memory_slices(unsigned int slices)
{
    return slices >= 7 ? 8 : slices == 3 ? 4 : slices;
}

/* The GPU behind a handle that must be a GPU, after the MIG layout was read again. */
static struct nvmlDevice_st *gpu_of(nvmlDevice_t handle)
{
    struct nvmlDevice_st *d = device(handle);
    return (d == NULL || d->is_mig) ? NULL : d;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_t *info);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t handle, unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_t *info)
{
    struct nvmlDevice_st *gpu, *slots;
    unsigned int i;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((gpu = gpu_of(handle)) == NULL || info == NULL || profile >= FAKE_GI_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpu->mig_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    for (i = 0; i < g_nprofiles; i++)
        if (g_profiles[i].gpu == gpu->index && g_profiles[i].info.id == profile) {
            *info = g_profiles[i].info;
            return NVML_SUCCESS;
        }
    slots = mig_slots(gpu->index);
    for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++) {
        const struct nvmlDevice_st *m = &slots[i];
        if (!m->present || m->gip != profile)
            continue;
        memset(info, 0, sizeof(*info));
        info->id = profile;
        info->sliceCount = m->gi_slices;
        info->instanceCount = 7 / m->gi_slices;
        info->multiprocessorCount = m->sm_count * m->gi_slices / m->ci_slices;
        info->copyEngineCount = m->ce;
        info->decoderCount = m->dec;
        info->encoderCount = m->enc;
        info->jpegCount = m->jpg;
        info->ofaCount = m->ofa;
        info->memorySizeMB = m->total >> 20;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                      nvmlGpuInstance_t *gpuInstance);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t handle, unsigned int id,
                                                      nvmlGpuInstance_t *gpuInstance)
{
    struct nvmlDevice_st *gpu, *slots;
    unsigned int i;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((gpu = gpu_of(handle)) == NULL || gpuInstance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpu->mig_supported || gpu->mig != 1)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!fake_nvml_privileged())
        return NVML_ERROR_NO_PERMISSION;
    slots = mig_slots(gpu->index);
    for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++)
        if (slots[i].present && slots[i].gi == id) {
            *gpuInstance = &slots[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info);
FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    struct nvmlDevice_st *m;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((m = mig_device(gpuInstance)) == NULL || info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = m->parent;
    info->id = m->gi;
    info->profileId = m->gip;
    info->placement.start = m->start;
    info->placement.size = memory_slices(m->gi_slices);
    return NVML_SUCCESS;
}
