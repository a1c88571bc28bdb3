/* fake_nvml.h: what the files of the fake libnvidia-ml.so.1 share (fake_nvml.c: the tables and
 * the config; fake_nvml_limits.c: memory limits by cgroup). Codes and types follow nvml.h. */
#ifndef FAKE_NVML_H
#define FAKE_NVML_H

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

typedef struct nvmlDevice_st *nvmlDevice_t;

/* initialised, then any injected failure for `function` (NVML_SUCCESS to go on) */
nvmlReturn_t fake_nvml_enter(const char *function);
/* 0 and the device's index and MIG mode for a handle of this library, -1 otherwise */
int fake_nvml_device(nvmlDevice_t handle, unsigned int *index, unsigned int *mig);
/* the memlimits state file, NULL when memory partitioning is off */
const char *fake_nvml_memlimits(void);

#endif
