/* The slice of the CUDA driver and NVML ABIs the shim touches, declared here so the shim
 * builds without cuda.h or nvml.h. Values and layouts are those of CUDA 13.0's cuda.h
 * (see shared/reference/research-shim.md §5) and NVML's nvml.h. */
#ifndef MPSSHIM_CUDA_TYPES_H
#define MPSSHIM_CUDA_TYPES_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;    /* CUdeviceptr_v2 (LP64) */
typedef unsigned int CUdeviceptr_v1;       /* the 2000-era 32-bit ABI */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUmemAllocationProp_st CUmemAllocationProp; /* read by offset, see below */

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_FOUND = 500,
};

/* cuGetProcAddress flags and CUdriverProcAddressQueryResult. */
enum { CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2 };
typedef int CUdriverProcAddressQueryResult;

/* CUmemAllocationProp (32 bytes): location.type at offset 8, location.id at offset 12. */
enum { MS_PROP_LOCATION_TYPE_OFFSET = 8, MS_PROP_LOCATION_ID_OFFSET = 12 };
enum { CU_MEM_LOCATION_TYPE_DEVICE = 1 };

typedef struct { unsigned char bytes[16]; } CUuuid;

/* NVML */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
enum { NVML_SUCCESS = 0 };
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#endif
