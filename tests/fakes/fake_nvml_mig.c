/* fake_nvml_mig.c: MIG devices in the fake libnvidia-ml.so.1.
 *
 * Each behaviour follows the function's comment in nvml.h (NVIDIA/go-nvml gen/nvml/nvml.h,
 * NVML API 13, quoted in "..."); where nvml.h is silent the choice is marked "inferred".
 *
 * - A MIG device handle "maps to a MIG compute instance" and can be used "interchangeably with a
 *   GPU device handle to execute queries at a per-compute instance granularity"
 *   (nvmlDeviceIsMigDeviceHandle): nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetMemoryInfo(_v2),
 *   nvmlDeviceGetIndex and nvmlDeviceGetCudaComputeCapability answer for the instance
 *   (fake_nvml.c). Its UUID is "globally unique" and "immutable for the lifetime of a MIG device"
 *   (nvmlDeviceGetUUID); its name is the MIG device name, "<GPU name> MIG <profile>"
 *   (nvmlDeviceGetName: "MIG device names which can be used to identify devices based on their
 *   attributes"; the form is what nvidia-smi -L prints); its index is "unique within a device" and
 *   can be "passed to nvmlDeviceGetMigDeviceHandleByIndex" (nvmlDeviceGetIndex).
 * - MIG devices are not counted by nvmlDeviceGetCount ("A compute device is a single GPU"); they
 *   are found under their parent: nvmlDeviceGetMaxMigDeviceCount ("Returns zero if MIG is not
 *   supported or enabled"; 7 here, the compute slices of an A100/H100), then
 *   nvmlDeviceGetMigDeviceHandleByIndex (NVML_ERROR_NOT_FOUND "if no valid MIG device was found
 *   at index"; an index at or above the maximum count, 0 when MIG is disabled, is
 *   NVML_ERROR_INVALID_ARGUMENT, "if device, index or migDevice reference is invalid").
 * - "If the compute instance is destroyed ... the MIG device handle would remain invalid and must
 *   be requested again using this API. Handles may be reused and their properties can change in
 *   the process." (nvmlDeviceGetMigDeviceHandleByIndex): the layout is live. Each enumeration
 *   re-reads the `mig` lines of FAKE_NVML_CONFIG when the file changed since it was last read,
 *   so a test changes the layout while NVML stays initialised, as the MIG manager does under a
 *   running mpsd. A handle is a slot of a static table: a vanished instance's handle is invalid
 *   (NVML_ERROR_INVALID_ARGUMENT), a new instance in that slot reuses it. A malformed file
 *   keeps the last good layout (one line on stderr). MIG mode itself is read at init only:
 *   changing it "may require device unbind or reset" (nvmlDeviceGetMigMode).
 * - nvmlDeviceGetGpuInstanceId / nvmlDeviceGetComputeInstanceId: "for the given MIG device
 *   handle"; a GPU handle is NVML_ERROR_NOT_SUPPORTED ("if this query is not supported by the
 *   device", inferred for a GPU handle).
 * - nvmlDeviceGetAttributes_v2: "This API currently only supports MIG device handles" (a GPU
 *   handle: NVML_ERROR_NOT_SUPPORTED); multiprocessorCount, the slice counts and memorySizeMB
 *   ("Device memory size (in MiB)") of the instance; the shared engine counts are its GPU
 *   instance's (`ce= dec= enc= jpg= ofa=` on its line, 0 by default).
 * - Compute instances of one GPU instance share its memory: each reports the GPU instance's
 *   (a second line of one GPU instance must give the same total and used).
 * - Indices are compacted: nvmlDeviceGetMigDeviceHandleByIndex(i) is the i-th present instance in
 *   the order of the lines' mig_index, so a destroyed instance moves the indices after it (inferred).
 * - A MIG device that vanished never comes back with its UUID: a layout that gives it again is
 *   refused (a created instance gets a new UUID).
 * - nvmlDeviceGetDeviceHandleFromMigDeviceHandle: the parent; a GPU handle is
 *   NVML_ERROR_INVALID_ARGUMENT ("if migDevice or device is invalid", inferred).
 * - nvmlDeviceGetMinorNumber: "/dev/nvidia[minor number]" of a GPU; a MIG device has no such
 *   node (its access goes through /dev/nvidia-caps, numbered in
 *   /proc/driver/nvidia-caps/mig-minors): NVML_ERROR_NOT_SUPPORTED (inferred).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fake_nvml.h"

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct nvmlDevice_st mig_table[FAKE_MAX_GPUS][FAKE_MAX_MIG_PER_GPU];

static mig_table g_migs;
static mig_table g_next;               /* a layout being read while NVML is initialised */
static mig_table *g_target = &g_migs;  /* where parse_mig_directive writes */
static void refresh(void);
static const struct nvmlDevice_st *mig_by_uuid_in(const mig_table *t, const char *uuid);
static char g_path[4096];
static struct stat g_seen;             /* the file as last read */
#define FAKE_MAX_GONE 256
static char g_gone[FAKE_MAX_GONE][96]; /* UUIDs of destroyed MIG devices: never given again */
static unsigned int g_ngone;

void mig_clear(void)
{
    memset(g_migs, 0, sizeof(g_migs));
    g_path[0] = '\0';
    g_ngone = 0;
}

/* NVML's MIG device indices count the present instances of a GPU in order, so destroying one
 * compacts the indices of those after it (inferred; nvml.h: an index "unique within a device"). */
static void renumber(mig_table *t)
{
    unsigned int g, i, next;
    for (g = 0; g < FAKE_MAX_GPUS; g++)
        for (i = 0, next = 0; i < FAKE_MAX_MIG_PER_GPU; i++)
            if ((*t)[g][i].present)
                (*t)[g][i].index = next++;
}

static int gone(const char *uuid)
{
    unsigned int i;
    for (i = 0; i < g_ngone; i++)
        if (strcmp(g_gone[i], uuid) == 0)
            return 1;
    return 0;
}

/* A new layout: a MIG device that vanished is destroyed, its UUID never comes back (nvml.h: the
 * UUID is "immutable for the lifetime of a MIG device"; a device created again is a new one). */
static const char *retire(const mig_table *from, const mig_table *to)
{
    unsigned int g, i;
    for (g = 0; g < FAKE_MAX_GPUS; g++)
        for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++)
            if ((*to)[g][i].present && gone((*to)[g][i].uuid))
                return "a destroyed MIG device's UUID is not given again: a created instance has a new one";
    for (g = 0; g < FAKE_MAX_GPUS; g++)
        for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++) {
            const struct nvmlDevice_st *m = &(*from)[g][i];
            if (m->present && mig_by_uuid_in(to, m->uuid) == NULL && g_ngone < FAKE_MAX_GONE)
                copy_str(g_gone[g_ngone++], sizeof(g_gone[0]), m->uuid);
        }
    return NULL;
}

struct nvmlDevice_st *mig_slots(unsigned int gpu)
{
    pthread_mutex_lock(&g_lock);
    refresh();
    pthread_mutex_unlock(&g_lock);
    return gpu < FAKE_MAX_GPUS ? g_migs[gpu] : NULL;
}

/* NVML's profile ID of a GPU or compute instance of `slices` slices (nvml.h NVML_*_PROFILE_<n>_SLICE) */
static unsigned int profile_for_slices(unsigned int slices)
{
    static const unsigned int ids[9] = {0, 0x0, 0x1, 0x2, 0x3, 0x3, 0x6, 0x4, 0x5};
    return slices <= 8 ? ids[slices] : 0;
}

/* The optional words after the profile: gip= cip= start= ce= dec= enc= jpg= ofa= */
static const char *parse_options(struct nvmlDevice_st *m, char **w, int n)
{
    static const char *keys[] = {"gip=", "cip=", "start=", "ce=", "dec=", "enc=", "jpg=", "ofa="};
    unsigned int *fields[] = {&m->gip, &m->cip, &m->start, &m->ce, &m->dec, &m->enc, &m->jpg, &m->ofa};
    int i;
    size_t k;
    for (i = 12; i < n; i++) {
        for (k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
            if (strncmp(w[i], keys[k], strlen(keys[k])) == 0)
                break;
        if (k == sizeof(keys) / sizeof(keys[0]) || parse_uint(w[i] + strlen(keys[k]), fields[k]) != 0)
            return "mig options are gip= cip= start= ce= dec= enc= jpg= ofa= with integer values";
    }
    return NULL;
}

/* Compute instances of one GPU instance share its memory and engines (CUPTI on MIG; the MIG user
 * guide's device names: three 1c.3g.20gb are all 20gb): a second line of a GPU instance must say
 * what the first said of it. */
static const char *same_gpu_instance(const struct nvmlDevice_st *m, const struct nvmlDevice_st *o)
{
    if (o->gi_slices != m->gi_slices || o->gip != m->gip || o->start != m->start)
        return "compute instances of one GPU instance have its gi_slices, gip and start";
    if (o->total != m->total || o->used != m->used)
        return "compute instances of one GPU instance share its memory: total/used must be the GPU instance's";
    if (o->ce != m->ce || o->dec != m->dec || o->enc != m->enc || o->jpg != m->jpg || o->ofa != m->ofa)
        return "compute instances of one GPU instance share its engines";
    return NULL;
}

const char *parse_mig_directive(char **w, int n)
{
    unsigned int gpu, slot, gi, ci, gs, cs, sms, i;
    unsigned long long total, used;
    struct nvmlDevice_st *m, *parent, next;
    const char *problem;
    if (n < 12)
        return "mig needs: gpu_index mig_index MIG-uuid gi ci gi_slices ci_slices sm_count total used profile [options]";
    if (parse_uint(w[1], &gpu) != 0 || gpu >= g_ngpus)
        return "mig gpu_index must name a gpu defined above";
    parent = &g_gpus[gpu];
    if (!parent->mig_supported || parent->mig != 1)
        return "mig needs a gpu whose MIG mode is 1";
    if (parse_uint(w[2], &slot) != 0 || slot >= FAKE_MAX_MIG_PER_GPU)
        return "mig_index must be 0..6";
    m = &(*g_target)[gpu][slot];
    if (m->present)
        return "mig_index already used on this gpu";
    if (strncmp(w[3], "MIG-", 4) != 0 || strlen(w[3]) >= sizeof(m->uuid))
        return "a MIG device UUID starts with MIG-";
    if (parse_uint(w[4], &gi) != 0 || parse_uint(w[5], &ci) != 0 || parse_uint(w[6], &gs) != 0 ||
        parse_uint(w[7], &cs) != 0 || parse_uint(w[8], &sms) != 0 || gs < 1 || gs > 7 || cs < 1 ||
        cs > gs || sms < 1)
        return "gi, ci, sm_count must be integers, 1 <= ci_slices <= gi_slices <= 7, sm_count >= 1";
    if (parse_u64(w[9], &total) != 0 || parse_u64(w[10], &used) != 0 || used > total)
        return "total/used must be byte counts with used <= total";
    memset(&next, 0, sizeof(next));
    next.gip = profile_for_slices(gs);
    next.cip = profile_for_slices(cs);
    next.start = gi;
    if ((problem = parse_options(&next, w, n)) != NULL)
        return problem;
    next.is_mig = next.present = 1;
    next.parent = parent;
    copy_str(next.uuid, sizeof(next.uuid), w[3]);
    snprintf(next.name, sizeof(next.name), "%.60s MIG %.30s", parent->name, w[11]);
    next.total = total;
    next.used = used;
    next.cc_major = parent->cc_major;
    next.cc_minor = parent->cc_minor;
    next.gi = gi;
    next.ci = ci;
    next.gi_slices = gs;
    next.ci_slices = cs;
    next.sm_count = sms;
    for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++) {
        struct nvmlDevice_st *o = &(*g_target)[gpu][i];
        if (o->present && o->gi == gi && o->ci == ci)
            return "gi/ci pair already used on this gpu";
        if (o->present && o->gi == gi && (problem = same_gpu_instance(&next, o)) != NULL)
            return problem;
    }
    *m = next;
    return NULL;
}

static int same_file(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

void mig_note_file(const char *path)
{
    renumber(&g_migs);
    copy_str(g_path, sizeof(g_path), path);
    if (stat(path, &g_seen) != 0)
        memset(&g_seen, 0, sizeof(g_seen));
}

/* Reads the `mig` lines again if the file changed; called with g_lock held. */
static void refresh(void)
{
    struct stat now;
    char line[1024];
    const char *problem = NULL;
    int lineno = 0;
    FILE *f;
    if (g_path[0] == '\0' || stat(g_path, &now) != 0 || same_file(&now, &g_seen))
        return;
    g_seen = now;
    if ((f = fopen(g_path, "r")) == NULL)
        return;
    memset(g_next, 0, sizeof(g_next));
    g_target = &g_next;
    while (problem == NULL && fgets(line, sizeof(line), f) != NULL) {
        char *w[24] = {0}, *save = NULL, *tok, *hash;
        int n = 0;
        lineno++;
        if ((hash = strchr(line, '#')) != NULL)
            *hash = '\0';
        for (tok = strtok_r(line, " \t\r\n", &save); tok != NULL && n < 24; tok = strtok_r(NULL, " \t\r\n", &save))
            w[n++] = tok;
        if (n > 0 && strcmp(w[0], "mig") == 0)
            problem = parse_mig_directive(w, n);
    }
    fclose(f);
    g_target = &g_migs;
    if (problem == NULL && (problem = retire(&g_migs, &g_next)) != NULL)
        lineno = 0;
    if (problem != NULL) {
        fprintf(stderr, "fake_nvml: %s:%d: %s (MIG layout kept)\n", g_path, lineno, problem);
        return;
    }
    renumber(&g_next);
    memcpy(g_migs, g_next, sizeof(g_migs));
}

struct nvmlDevice_st *mig_device(nvmlDevice_t handle)
{
    struct nvmlDevice_st *first = &g_migs[0][0];
    if (handle < first || handle >= first + FAKE_MAX_GPUS * FAKE_MAX_MIG_PER_GPU || !handle->present)
        return NULL;
    return handle;
}

static const struct nvmlDevice_st *mig_by_uuid_in(const mig_table *t, const char *uuid)
{
    unsigned int g, i;
    for (g = 0; g < FAKE_MAX_GPUS; g++)
        for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++)
            if ((*t)[g][i].present && strcmp((*t)[g][i].uuid, uuid) == 0)
                return &(*t)[g][i];
    return NULL;
}

struct nvmlDevice_st *mig_by_uuid(const char *uuid)
{
    unsigned int g, i;
    for (g = 0; g < g_ngpus; g++)
        for (i = 0; i < FAKE_MAX_MIG_PER_GPU; i++)
            if (g_migs[g][i].present && strcmp(g_migs[g][i].uuid, uuid) == 0)
                return &g_migs[g][i];
    return NULL;
}

/* The GPU behind a handle that must be a GPU (not a MIG device), after a refresh. */
static nvmlReturn_t enter_gpu(const char *function, nvmlDevice_t handle, struct nvmlDevice_st **out)
{
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_lock);
    refresh();
    pthread_mutex_unlock(&g_lock);
    *out = device(handle);
    return (*out == NULL || (*out)->is_mig) ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS;
}

static unsigned int max_count(const struct nvmlDevice_st *gpu)
{
    return gpu->mig_supported && gpu->mig == 1 ? FAKE_MAX_MIG_PER_GPU : 0;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t handle, unsigned int *count)
{
    struct nvmlDevice_st *gpu;
    nvmlReturn_t rc = enter_gpu(__func__, handle, &gpu);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = max_count(gpu);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                             nvmlDevice_t *migDevice);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t handle, unsigned int index,
                                                             nvmlDevice_t *migDevice)
{
    struct nvmlDevice_st *gpu;
    unsigned int slot;
    nvmlReturn_t rc = enter_gpu(__func__, handle, &gpu);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!gpu->mig_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    if (migDevice == NULL || index >= max_count(gpu))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (slot = 0; slot < FAKE_MAX_MIG_PER_GPU; slot++) {
        struct nvmlDevice_st *m = &g_migs[gpu - g_gpus][slot];
        if (m->present && m->index == index) {
            *migDevice = m;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice);
FAKE_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t handle, unsigned int *isMigDevice)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || isMigDevice == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = (unsigned int)d->is_mig;
    return NVML_SUCCESS;
}

/* The MIG device behind a handle that must be one: NOT_SUPPORTED for a GPU handle. */
static nvmlReturn_t enter_mig(const char *function, nvmlDevice_t handle, const void *out,
                              struct nvmlDevice_st **mig)
{
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((*mig = device(handle)) == NULL || out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    return (*mig)->is_mig ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t handle, unsigned int *id)
{
    struct nvmlDevice_st *m;
    nvmlReturn_t rc = enter_mig(__func__, handle, id, &m);
    if (rc == NVML_SUCCESS)
        *id = m->gi;
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t handle, unsigned int *id)
{
    struct nvmlDevice_st *m;
    nvmlReturn_t rc = enter_mig(__func__, handle, id, &m);
    if (rc == NVML_SUCCESS)
        *id = m->ci;
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t handle, nvmlDeviceAttributes_t *attributes)
{
    struct nvmlDevice_st *m;
    nvmlReturn_t rc = enter_mig(__func__, handle, attributes, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    memset(attributes, 0, sizeof(*attributes));
    attributes->multiprocessorCount = m->sm_count;
    attributes->sharedCopyEngineCount = m->ce;
    attributes->sharedDecoderCount = m->dec;
    attributes->sharedEncoderCount = m->enc;
    attributes->sharedJpegCount = m->jpg;
    attributes->sharedOfaCount = m->ofa;
    attributes->gpuInstanceSliceCount = m->gi_slices;
    attributes->computeInstanceSliceCount = m->ci_slices;
    attributes->memorySizeMB = m->total >> 20;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t handle, nvmlDevice_t *out)
{
    struct nvmlDevice_st *m;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((m = device(handle)) == NULL || !m->is_mig || out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = m->parent;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t handle, unsigned int *minorNumber)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || minorNumber == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *minorNumber = d->minor;
    return NVML_SUCCESS;
}
