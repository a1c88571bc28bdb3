/* fake_nvml.h: what the files of the fake libnvidia-ml.so.1 share: fake_nvml.c (GPUs, processes,
 * the config file), fake_nvml_mig.c (MIG devices), fake_nvml_limits.c (memory limits by cgroup).
 * Nothing here is exported. Codes, types and struct layouts follow nvml.h (NVIDIA/go-nvml
 * gen/nvml/nvml.h, NVML API 13). */
#ifndef FAKE_NVML_H
#define FAKE_NVML_H

#include <pthread.h>
#include <stddef.h>

#define FAKE_EXPORT __attribute__((visibility("default")))
#define FAKE_MAX_GPUS 16
/* MIG devices (compute instances) per GPU: A100/H100/H200 have 7 compute slices, so at most 7
 * one-slice compute instances (MIG user guide, "Supported MIG Profiles"). */
#define FAKE_MAX_MIG_PER_GPU 7

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

/* One handle: a GPU (g_gpus) or a MIG device (g_migs). */
struct nvmlDevice_st {
    unsigned int index; /* GPU: its NVML index; MIG device: its index under the parent */
    char uuid[96];
    char name[96];
    unsigned long long total;
    unsigned long long used;
    int cc_major;
    int cc_minor;
    unsigned int mig;   /* GPU: current MIG mode, 0 or 1 */
    int mig_supported;  /* GPU: 0 after `nomig` */
    unsigned int minor; /* GPU: /dev/nvidia<minor> */
    /* MIG devices only */
    int is_mig;
    int present;        /* a compute instance exists at this slot */
    struct nvmlDevice_st *parent;
    unsigned int gi, ci, gi_slices, ci_slices, sm_count;
    /* the GPU instance's profile ID and placement start, the compute instance's profile ID, and the
     * GPU instance's engines (shared by its compute instances) */
    unsigned int gip, cip, start, ce, dec, enc, jpg, ofa;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

extern pthread_mutex_t g_lock;
extern unsigned int g_refcount;
extern struct nvmlDevice_st g_gpus[FAKE_MAX_GPUS];
extern unsigned int g_ngpus;

int parse_u64(const char *s, unsigned long long *out);
int parse_uint(const char *s, unsigned int *out);
void copy_str(char *dst, size_t size, const char *src);
/* Entry check of every query: initialised, then any injected failure. */
nvmlReturn_t enter(const char *function);
/* The GPU or present MIG device behind a handle; NULL for anything else. */
struct nvmlDevice_st *device(nvmlDevice_t handle);

/* initialised, then any injected failure for `function` (NVML_SUCCESS to go on) */
nvmlReturn_t fake_nvml_enter(const char *function);
/* 0 and the device's index and MIG mode for a handle of this library, -1 otherwise (a MIG device
 * handle counts as MIG mode on) */
int fake_nvml_device(nvmlDevice_t handle, unsigned int *index, unsigned int *mig);
/* the memlimits state file, NULL when memory partitioning is off */
const char *fake_nvml_memlimits(void);

/* the caller has the privileges NVML asks for aggregate data of a GPU in MIG mode and for GPU
 * instance handles (`privileged` in the config; unprivileged without it, as in a container) */
int fake_nvml_privileged(void);
/* a GPU handle whose MIG mode is on, asked by an unprivileged caller: NVML_ERROR_NO_PERMISSION */
nvmlReturn_t aggregate_refused(const struct nvmlDevice_st *d);

/* fake_nvml_mig.c */
const char *parse_mig_directive(char **w, int n);
void mig_clear(void);
struct nvmlDevice_st *mig_device(nvmlDevice_t handle);
struct nvmlDevice_st *mig_by_uuid(const char *uuid);
/* the MIG devices of GPU `gpu` (FAKE_MAX_MIG_PER_GPU slots, present or not), after a refresh */
struct nvmlDevice_st *mig_slots(unsigned int gpu);
/* fake_nvml_gi.c: `giprofile` lines */
const char *parse_giprofile_directive(char **w, int n);
void giprofile_clear(void);
/* Called by load_config when the file was read at init: remembers what it was. */
void mig_note_file(const char *path);

#endif
