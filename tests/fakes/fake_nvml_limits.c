/* fake_nvml_limits.c: nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 of the fake
 * libnvidia-ml.so.1, with the semantics NVIDIA documents (NVML API reference, structs
 * nvmlSetMemoryLimits_v1_t / nvmlGetMemoryLimits_v1_t; "MPS v3 Memory Partitioning"):
 *
 *   - nameSpace is the full path of a cgroup v2 directory; a path that is not a directory
 *     (the cgroup removed: "removing the cgroup will also clear any limits") → NOT_FOUND;
 *   - softLimit is guaranteed, hardLimit is the most that can be allocated: soft > hard →
 *     INVALID_ARGUMENT; soft 0 with hard NVML_DEVICE_MEMORY_LIMIT_MAX clears the limits, and
 *     Get reports exactly that where none is set;
 *   - Set "requires root/admin permissions": another effective UID → NO_PERMISSION;
 *   - "MIG handles are not supported" (and memory partitioning needs a non-MIG device): a GPU
 *     in MIG mode → NOT_SUPPORTED;
 *   - without the `memlimits` directive (a driver before R615, no cgroup v2) → NOT_SUPPORTED.
 *
 * The limits live in the state file the directive names, one line per (GPU, cgroup):
 * "<gpu_index> <soft> <hard> <current_used> <cgroup path>", read and rewritten under flock,
 * so that mpsd (through pynvml) and a test (writing the file, or calling the library) see one
 * driver. current_used is what a test writes there (0 when mpsd sets a limit). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake_nvml.h"

#define FAKE_EXPORT __attribute__((visibility("default")))
#define LIMIT_MAX 0xFFFFFFFFFFFFFFFFull
#define MAX_ENTRIES 256
#define PATH_LEN 1024

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
    unsigned long long currentUsed;
} nvmlGetMemoryLimits_v1_t;

struct entry {
    unsigned int gpu;
    unsigned long long soft, hard, used;
    char path[PATH_LEN];
};

static struct entry g_entries[MAX_ENTRIES];
static int g_n;

/* Reads the state file (locked by the caller through fd) into g_entries. */
static void load(FILE *f)
{
    char line[PATH_LEN + 128];
    g_n = 0;
    rewind(f);
    while (g_n < MAX_ENTRIES && fgets(line, sizeof(line), f) != NULL) {
        struct entry *e = &g_entries[g_n];
        int used = 0;
        line[strcspn(line, "\n")] = '\0';
        if (sscanf(line, "%u %llu %llu %llu %n", &e->gpu, &e->soft, &e->hard, &e->used, &used) == 4 && used > 0 &&
            strlen(line + used) < PATH_LEN) {
            strcpy(e->path, line + used);
            g_n++;
        }
    }
}

static void store(FILE *f)
{
    int i;
    if (ftruncate(fileno(f), 0) != 0)
        return;
    rewind(f);
    for (i = 0; i < g_n; i++)
        fprintf(f, "%u %llu %llu %llu %s\n", g_entries[i].gpu, g_entries[i].soft, g_entries[i].hard,
                g_entries[i].used, g_entries[i].path);
    fflush(f);
}

static struct entry *find(unsigned int gpu, const char *path)
{
    int i;
    for (i = 0; i < g_n; i++)
        if (g_entries[i].gpu == gpu && strcmp(g_entries[i].path, path) == 0)
            return &g_entries[i];
    return NULL;
}

/* The common checks; the locked state file in *out. */
static nvmlReturn_t begin(const char *function, nvmlDevice_t device, const char *ns, unsigned int *gpu, FILE **out)
{
    unsigned int mig;
    struct stat st;
    const char *path;
    FILE *f;
    int fd;
    nvmlReturn_t rc = fake_nvml_enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if (fake_nvml_device(device, gpu, &mig) != 0 || ns == NULL || strlen(ns) >= PATH_LEN || strchr(ns, '\n'))
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((path = fake_nvml_memlimits()) == NULL || mig)
        return NVML_ERROR_NOT_SUPPORTED;
    if (stat(ns, &st) != 0 || !S_ISDIR(st.st_mode))
        return NVML_ERROR_NOT_FOUND;
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || flock(fd, LOCK_EX) != 0 || (f = fdopen(fd, "r+")) == NULL) {
        if (fd >= 0)
            close(fd);
        return NVML_ERROR_UNKNOWN;
    }
    load(f);
    *out = f;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits);
FAKE_EXPORT nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits)
{
    unsigned int gpu;
    struct entry *e;
    FILE *f;
    nvmlReturn_t rc;
    if (limits == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (limits->softLimit > limits->hardLimit)
        return fake_nvml_enter(__func__) ?: NVML_ERROR_INVALID_ARGUMENT;
    rc = begin(__func__, device, limits->nameSpace, &gpu, &f);
    if (rc != NVML_SUCCESS)
        return rc;
    if (geteuid() != 0) {
        fclose(f);
        return NVML_ERROR_NO_PERMISSION;
    }
    e = find(gpu, limits->nameSpace);
    if (limits->softLimit == 0 && limits->hardLimit == LIMIT_MAX) {
        if (e != NULL)
            *e = g_entries[--g_n];
    } else {
        if (e == NULL) {
            if (g_n >= MAX_ENTRIES) {
                fclose(f);
                return NVML_ERROR_UNKNOWN;
            }
            e = &g_entries[g_n++];
            e->gpu = gpu;
            e->used = 0;
            snprintf(e->path, sizeof(e->path), "%s", limits->nameSpace);
        }
        e->soft = limits->softLimit;
        e->hard = limits->hardLimit;
    }
    store(f);
    fclose(f);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits);
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits)
{
    unsigned int gpu;
    struct entry *e;
    FILE *f;
    nvmlReturn_t rc;
    if (limits == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    rc = begin(__func__, device, limits->nameSpace, &gpu, &f);
    if (rc != NVML_SUCCESS)
        return rc;
    e = find(gpu, limits->nameSpace);
    limits->softLimit = e ? e->soft : 0;
    limits->hardLimit = e ? e->hard : LIMIT_MAX;
    limits->currentUsed = e ? e->used : 0;
    fclose(f);
    return NVML_SUCCESS;
}
