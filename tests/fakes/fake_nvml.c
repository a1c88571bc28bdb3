/* fake_nvml.c: a fake libnvidia-ml.so.1 for tests on machines without a GPU.
 *
 * Loaded by the real pynvml (it resolves functions by name with ctypes) and by C code
 * (the shim's NVML hooks). Handles are pointers into a static table; struct layouts
 * follow nvml.h (and pynvml's ctypes mirrors of it).
 *
 * Configuration: FAKE_NVML_CONFIG = path of a text file, read by the nvmlInit* call
 * that takes the reference count from 0 to 1 (so a test changes the file, calls
 * nvmlShutdown and nvmlInit again, and sees the new state). One directive per line,
 * '#' starts a comment:
 *
 *   gpu <index> <uuid> <total_bytes> <used_bytes> <cc_major> <cc_minor> <mig 0|1> <name...>
 *       indices must be 0, 1, 2, ... in order; at most FAKE_MAX_GPUS
 *   proc <gpu_index> <pid> <used_bytes>      an MPS client on that GPU
 *                                            (nvmlDeviceGetMPSComputeRunningProcesses_v2/_v3)
 *   compute <gpu_index> <pid> <used_bytes>   a process as the plain compute-process query
 *                                            reports it (under MPS: the MPS server)
 *   driver <version>                         nvmlSystemGetDriverVersion (default "0.0.fake")
 *   fail <function> <nvml_error_code>        that exported function returns that code
 *                                            (nvmlInit* too: init then fails)
 *   nomig <gpu_index>                        nvmlDeviceGetMigMode → NOT_SUPPORTED (pre-Ampere)
 *   minor <gpu_index> <minor>                nvmlDeviceGetMinorNumber (default: the index)
 *   mig <gpu_index> <mig_index> <MIG-uuid> <gi> <ci> <gi_slices> <ci_slices> <sm_count>
 *       <total_bytes> <used_bytes> <profile>
 *                                            a MIG device (compute instance) on a GPU whose MIG
 *                                            mode is 1; see fake_nvml_mig.c. `mig` lines are read
 *                                            again while NVML is initialised (a layout change),
 *                                            everything else only at init.
 *   privileged                               the caller has privileges: without it (a container
 *                                            without CAP_SYS_ADMIN and NVIDIA_MIG_MONITOR_DEVICES)
 *                                            nvmlDeviceGetMemoryInfo(_v2) and the running-process
 *                                            queries of a GPU in MIG mode answer
 *                                            NVML_ERROR_NO_PERMISSION (nvml.h: aggregate information
 *                                            "only if the caller has appropriate privileges"), and so
 *                                            do the "Requires privileged user" GPU instance calls
 *   giprofile <gpu> <id> <slices> <mem_mib> <sms> <ce> <dec> <enc> <jpg> <ofa>
 *                                            a GPU instance profile the GPU supports
 *                                            (nvmlDeviceGetGpuInstanceProfileInfo); see fake_nvml_gi.c
 *   memlimits <state_file>                   memory partitioning by cgroup is available (R615+,
 *                                            cgroup v2): nvmlDevice{Set,Get}MemoryLimits_v1 keep
 *                                            their limits in <state_file>, shared by every process
 *                                            (fake_nvml_limits.c); without it they answer
 *                                            NOT_SUPPORTED
 *
 * Errors: FAKE_NVML_CONFIG unset, or its file unreadable → nvmlInit* returns
 * NVML_ERROR_DRIVER_NOT_LOADED (9), as the real library does on a machine without the
 * driver. A malformed line → nvmlInit* returns NVML_ERROR_UNKNOWN (999) and prints one line
 * "fake_nvml: <file>:<line>: <problem>" on stderr. Every query before a successful init
 * returns NVML_ERROR_UNINITIALIZED; a handle not from this library →
 * NVML_ERROR_INVALID_ARGUMENT; a too-small string buffer → NVML_ERROR_INSUFFICIENT_SIZE.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_nvml.h"

#define FAKE_MAX_PROCS 256
#define FAKE_MAX_FAILS 32

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define FAKE_NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* nvmlProcessInfo_v2_t; nvmlProcessInfo_t (v3) has the same layout. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

enum proc_kind { PROC_MPS, PROC_COMPUTE };

struct fake_proc {
    enum proc_kind kind;
    unsigned int gpu;
    unsigned int pid;
    unsigned long long used;
};

struct fake_fail {
    char function[64];
    nvmlReturn_t code;
};

pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
unsigned int g_refcount;
struct nvmlDevice_st g_gpus[FAKE_MAX_GPUS];
unsigned int g_ngpus;
static struct fake_proc g_procs[FAKE_MAX_PROCS];
static unsigned int g_nprocs;
static struct fake_fail g_fails[FAKE_MAX_FAILS];
static unsigned int g_nfails;
static char g_driver[80];
static char g_memlimits[1024];
static int g_privileged;

int parse_u64(const char *s, unsigned long long *out)
{
    char *end;
    if (s == NULL || *s == '\0' || *s == '-')
        return -1;
    errno = 0;
    *out = strtoull(s, &end, 10);
    return (errno != 0 || *end != '\0') ? -1 : 0;
}

int parse_uint(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (parse_u64(s, &v) != 0 || v > 0xffffffffull)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

void copy_str(char *dst, size_t size, const char *src)
{
    snprintf(dst, size, "%s", src);
}

/* Parses one directive (already split into words); returns NULL or a problem. */
static const char *parse_directive(char **w, int n, const char *rest_after_8)
{
    if (strcmp(w[0], "gpu") == 0) {
        struct nvmlDevice_st *g;
        unsigned int idx, cmaj, cmin, mig;
        if (n < 9)
            return "gpu needs: index uuid total used cc_major cc_minor mig name";
        if (g_ngpus >= FAKE_MAX_GPUS)
            return "too many gpu lines";
        g = &g_gpus[g_ngpus];
        memset(g, 0, sizeof(*g));
        if (parse_uint(w[1], &idx) != 0 || idx != g_ngpus)
            return "gpu index must be the next integer (0, 1, ...)";
        if (strlen(w[2]) >= sizeof(g->uuid))
            return "uuid too long";
        if (parse_u64(w[3], &g->total) != 0 || parse_u64(w[4], &g->used) != 0 ||
            g->used > g->total)
            return "total/used must be byte counts with used <= total";
        if (parse_uint(w[5], &cmaj) != 0 || parse_uint(w[6], &cmin) != 0 || cmaj > 100 ||
            cmin > 100)
            return "compute capability must be two small integers";
        if (parse_uint(w[7], &mig) != 0 || mig > 1)
            return "mig must be 0 or 1";
        g->index = idx;
        copy_str(g->uuid, sizeof(g->uuid), w[2]);
        copy_str(g->name, sizeof(g->name), rest_after_8);
        g->cc_major = (int)cmaj;
        g->cc_minor = (int)cmin;
        g->mig = mig;
        g->mig_supported = 1;
        g->minor = idx;
        g_ngpus++;
        return NULL;
    }
    if (strcmp(w[0], "proc") == 0 || strcmp(w[0], "compute") == 0) {
        struct fake_proc *p;
        if (n != 4)
            return "proc/compute needs: gpu_index pid used_bytes";
        if (g_nprocs >= FAKE_MAX_PROCS)
            return "too many proc lines";
        p = &g_procs[g_nprocs];
        p->kind = w[0][0] == 'p' ? PROC_MPS : PROC_COMPUTE;
        if (parse_uint(w[1], &p->gpu) != 0 || p->gpu >= g_ngpus)
            return "gpu_index must name a gpu defined above";
        if (parse_uint(w[2], &p->pid) != 0 || parse_u64(w[3], &p->used) != 0)
            return "pid and used_bytes must be non-negative integers";
        g_nprocs++;
        return NULL;
    }
    if (strcmp(w[0], "driver") == 0) {
        if (n != 2 || strlen(w[1]) >= sizeof(g_driver))
            return "driver needs one short version string";
        copy_str(g_driver, sizeof(g_driver), w[1]);
        return NULL;
    }
    if (strcmp(w[0], "fail") == 0) {
        unsigned int code;
        if (n != 3 || strlen(w[1]) >= sizeof(g_fails[0].function))
            return "fail needs: function_name nvml_error_code";
        if (g_nfails >= FAKE_MAX_FAILS)
            return "too many fail lines";
        if (parse_uint(w[2], &code) != 0 || code == 0)
            return "nvml_error_code must be a positive integer";
        copy_str(g_fails[g_nfails].function, sizeof(g_fails[0].function), w[1]);
        g_fails[g_nfails].code = (nvmlReturn_t)code;
        g_nfails++;
        return NULL;
    }
    if (strcmp(w[0], "nomig") == 0) {
        unsigned int idx;
        if (n != 2 || parse_uint(w[1], &idx) != 0 || idx >= g_ngpus)
            return "nomig needs the index of a gpu defined above";
        g_gpus[idx].mig_supported = 0;
        return NULL;
    }
    if (strcmp(w[0], "memlimits") == 0) {
        if (n != 2 || strlen(w[1]) >= sizeof(g_memlimits))
            return "memlimits needs one state file path";
        copy_str(g_memlimits, sizeof(g_memlimits), w[1]);
        return NULL;
    }
    if (strcmp(w[0], "minor") == 0) {
        unsigned int idx;
        if (n != 3 || parse_uint(w[1], &idx) != 0 || idx >= g_ngpus || parse_uint(w[2], &g_gpus[idx].minor) != 0)
            return "minor needs the index of a gpu defined above and its device minor number";
        return NULL;
    }
    if (strcmp(w[0], "mig") == 0)
        return parse_mig_directive(w, n);
    if (strcmp(w[0], "giprofile") == 0)
        return parse_giprofile_directive(w, n);
    if (strcmp(w[0], "privileged") == 0) {
        if (n != 1)
            return "privileged takes no arguments";
        g_privileged = 1;
        return NULL;
    }
    return "unknown directive (gpu, proc, compute, driver, fail, nomig, minor, mig, giprofile, privileged, memlimits)";
}

/* Reads the file into the tables; called with g_lock held. */
static nvmlReturn_t load_config(void)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    char line[1024];
    int lineno = 0;
    FILE *f;

    g_ngpus = g_nprocs = g_nfails = 0;
    g_privileged = 0;
    mig_clear();
    giprofile_clear();
    g_memlimits[0] = '\0';
    copy_str(g_driver, sizeof(g_driver), "0.0.fake");
    if (path == NULL || (f = fopen(path, "r")) == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    while (fgets(line, sizeof(line), f) != NULL) {
        char copy[sizeof(line)], *w[24], *save = NULL, *tok, *hash;
        const char *problem, *name_start = "";
        int n = 0;
        size_t len;
        lineno++;
        if ((hash = strchr(line, '#')) != NULL)
            *hash = '\0';
        line[strcspn(line, "\r\n")] = '\0';
        for (len = strlen(line); len > 0 && (line[len - 1] == ' ' || line[len - 1] == '\t');)
            line[--len] = '\0';
        copy_str(copy, sizeof(copy), line);
        for (tok = strtok_r(copy, " \t", &save); tok != NULL && n < 24;
             tok = strtok_r(NULL, " \t", &save)) {
            w[n++] = tok;
            if (n == 8) {
                /* the gpu name is everything after the 8th word, spaces kept */
                name_start = line + (save - copy);
                name_start += strspn(name_start, " \t");
            }
        }
        if (n == 0)
            continue;
        problem = parse_directive(w, n, name_start);
        if (problem != NULL) {
            fprintf(stderr, "fake_nvml: %s:%d: %s\n", path, lineno, problem);
            fclose(f);
            g_ngpus = g_nprocs = g_nfails = 0;
            mig_clear();
            return NVML_ERROR_UNKNOWN;
        }
    }
    fclose(f);
    mig_note_file(path);
    return NVML_SUCCESS;
}

static nvmlReturn_t injected(const char *function)
{
    unsigned int i;
    for (i = 0; i < g_nfails; i++)
        if (strcmp(g_fails[i].function, function) == 0)
            return g_fails[i].code;
    return NVML_SUCCESS;
}

nvmlReturn_t enter(const char *function)
{
    nvmlReturn_t rc;
    pthread_mutex_lock(&g_lock);
    rc = g_refcount == 0 ? NVML_ERROR_UNINITIALIZED : injected(function);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

struct nvmlDevice_st *device(nvmlDevice_t handle)
{
    if (handle >= &g_gpus[0] && handle < &g_gpus[g_ngpus])
        return handle;
    return mig_device(handle);
}

/* For the other files of the fake (fake_nvml.h). */
nvmlReturn_t fake_nvml_enter(const char *function)
{
    return enter(function);
}

int fake_nvml_device(nvmlDevice_t handle, unsigned int *index, unsigned int *mig)
{
    struct nvmlDevice_st *d = device(handle);
    if (d == NULL)
        return -1;
    *index = d->index;
    *mig = d->is_mig ? 1 : d->mig;
    return 0;
}

int fake_nvml_privileged(void)
{
    return g_privileged;
}

nvmlReturn_t aggregate_refused(const struct nvmlDevice_st *d)
{
    return (!d->is_mig && d->mig_supported && d->mig == 1 && !g_privileged) ? NVML_ERROR_NO_PERMISSION
                                                                           : NVML_SUCCESS;
}

const char *fake_nvml_memlimits(void)
{
    return g_memlimits[0] ? g_memlimits : NULL;
}

static nvmlReturn_t do_init(const char *function)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        rc = load_config();
    if (rc == NVML_SUCCESS)
        rc = injected(function);
    if (rc == NVML_SUCCESS)
        g_refcount++;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlInit(void);
FAKE_EXPORT nvmlReturn_t nvmlInit(void)
{
    return do_init(__func__);
}

FAKE_EXPORT nvmlReturn_t nvmlInit_v2(void);
FAKE_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return do_init(__func__);
}

FAKE_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags);
FAKE_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return do_init(__func__);
}

FAKE_EXPORT nvmlReturn_t nvmlShutdown(void);
FAKE_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        g_refcount--;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

FAKE_EXPORT const char *nvmlErrorString(nvmlReturn_t result);
FAKE_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
FAKE_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(g_driver) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    copy_str(version, length, g_driver);
    return NVML_SUCCESS;
}

static nvmlReturn_t get_count(const char *function, unsigned int *count)
{
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_ngpus;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return get_count(__func__, count);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    return get_count(__func__, count);
}

static nvmlReturn_t get_handle(const char *function, unsigned int index, nvmlDevice_t *out)
{
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if (out == NULL || index >= g_ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &g_gpus[index];
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *out)
{
    return get_handle(__func__, index, out);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *out);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *out)
{
    return get_handle(__func__, index, out);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out)
{
    unsigned int i;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if (uuid == NULL || out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (i = 0; i < g_ngpus; i++) {
        if (strcmp(g_gpus[i].uuid, uuid) == 0) {
            *out = &g_gpus[i];
            return NVML_SUCCESS;
        }
    }
    /* nvml.h: "The UUID of the target GPU or MIG instance" -> "the device handle or MIG device handle" */
    if ((*out = mig_by_uuid(uuid)) != NULL)
        return NVML_SUCCESS;
    return NVML_ERROR_NOT_FOUND;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t handle, unsigned int *index);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t handle, unsigned int *index)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || index == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = d->index;
    return NVML_SUCCESS;
}

static nvmlReturn_t get_string(const char *function, nvmlDevice_t handle, int want_uuid,
                               char *buf, unsigned int length)
{
    struct nvmlDevice_st *d;
    const char *value;
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || buf == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    value = want_uuid ? d->uuid : d->name;
    if (strlen(value) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    copy_str(buf, length, value);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t handle, char *uuid, unsigned int length);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t handle, char *uuid, unsigned int length)
{
    return get_string(__func__, handle, 1, uuid, length);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t handle, char *name, unsigned int length);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t handle, char *name, unsigned int length)
{
    return get_string(__func__, handle, 0, name, length);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t handle, nvmlMemory_t *memory);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t handle, nvmlMemory_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = aggregate_refused(d)) != NVML_SUCCESS)
        return rc;
    memory->total = d->total;
    memory->used = d->used;
    memory->free = d->total - d->used;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t handle, nvmlMemory_v2_t *memory);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t handle, nvmlMemory_v2_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != FAKE_NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if ((rc = aggregate_refused(d)) != NVML_SUCCESS)
        return rc;
    memory->total = d->total;
    memory->reserved = 0;
    memory->used = d->used;
    memory->free = d->total - d->used;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t handle, int *major,
                                                            int *minor);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t handle, int *major,
                                                            int *minor)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = d->cc_major;
    *minor = d->cc_minor;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t handle, unsigned int *current,
                                              unsigned int *pending);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t handle, unsigned int *current,
                                              unsigned int *pending)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || current == NULL || pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* the mode is the GPU's; asked of a MIG device handle the fake answers NOT_SUPPORTED
     * (inferred: nvml.h lists it for "device doesn't support MIG mode") */
    if (d->is_mig || !d->mig_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = d->mig;
    *pending = d->mig;
    return NVML_SUCCESS;
}

/* The sizing protocol of the *RunningProcesses calls: *count in = capacity of infos;
 * out = number of processes. Too small (or infos NULL with processes present) →
 * INSUFFICIENT_SIZE with *count set; no processes → SUCCESS with *count = 0. */
static nvmlReturn_t list_procs(const char *function, enum proc_kind kind, nvmlDevice_t handle,
                               unsigned int *count, nvmlProcessInfo_t *infos)
{
    struct nvmlDevice_st *d;
    unsigned int i, n = 0;
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((d = device(handle)) == NULL || count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = aggregate_refused(d)) != NVML_SUCCESS)
        return rc;
    for (i = 0; i < g_nprocs; i++)
        if (!d->is_mig && g_procs[i].kind == kind && g_procs[i].gpu == d->index)
            n++; /* proc/compute lines are GPU-wide: a MIG device handle lists none */
    if (n > *count || (n > 0 && infos == NULL)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = n;
    n = 0;
    for (i = 0; i < g_nprocs; i++) {
        if (d->is_mig || g_procs[i].kind != kind || g_procs[i].gpu != d->index)
            continue;
        infos[n].pid = g_procs[i].pid;
        infos[n].usedGpuMemory = g_procs[i].used;
        infos[n].gpuInstanceId = 0xFFFFFFFFu;
        infos[n].computeInstanceId = 0xFFFFFFFFu;
        n++;
    }
    return NVML_SUCCESS;
}

#define FAKE_PROC_FN(fname, kind)                                                          \
    FAKE_EXPORT nvmlReturn_t fname(nvmlDevice_t handle, unsigned int *count,              \
                                   nvmlProcessInfo_t *infos);                             \
    FAKE_EXPORT nvmlReturn_t fname(nvmlDevice_t handle, unsigned int *count,              \
                                   nvmlProcessInfo_t *infos)                              \
    {                                                                                      \
        return list_procs(#fname, kind, handle, count, infos);                             \
    }

FAKE_PROC_FN(nvmlDeviceGetComputeRunningProcesses_v2, PROC_COMPUTE)
FAKE_PROC_FN(nvmlDeviceGetComputeRunningProcesses_v3, PROC_COMPUTE)
FAKE_PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses_v2, PROC_MPS)
FAKE_PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses_v3, PROC_MPS)
