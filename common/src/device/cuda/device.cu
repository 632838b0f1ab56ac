// device.cu - CUDA runtime queries behind tandem/device.h; every call checked.
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "tandem/device.h"

extern "C" int tdm_device_cuda_count_impl(int *n, tdm_error_t *err);
extern "C" int tdm_device_cuda_info_impl(int index, tdm_device_info_t *info, tdm_error_t *err);
extern "C" int tdm_device_cuda_memory_impl(int index, uint64_t *total_bytes, uint64_t *free_bytes,
                                           tdm_error_t *err);
extern "C" int tdm_device_cuda_uuid_impl(int index, uint8_t bytes[16], tdm_error_t *err);

// Turns a failed CUDA call into TDM_EUNAVAILABLE naming the statement, file and line.
#define TDM_CUDA_CHECK(stmt)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return tdm_error_set(err, TDM_EUNAVAILABLE, "%s: %s (%s:%d)", #stmt,                   \
                                 cudaGetErrorString(e_), __FILE__, __LINE__);                      \
    } while (0)

extern "C" int tdm_device_cuda_count_impl(int *n, tdm_error_t *err)
{
    int count = 0;
    *n = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "no usable CUDA device: %s",
                             cudaGetErrorString(e));
    TDM_CUDA_CHECK(e);
    *n = count;
    return TDM_OK;
}

extern "C" int tdm_device_cuda_info_impl(int index, tdm_device_info_t *info, tdm_error_t *err)
{
    int count = 0;
    TDM_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (index < 0 || index >= count)
        return tdm_error_set(err, TDM_EINVALID, "cuda:%d does not exist (%d device(s))", index,
                             count);
    cudaDeviceProp prop;
    TDM_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    memset(info, 0, sizeof *info);
    info->index = index;
    snprintf(info->name, sizeof info->name, "%s", prop.name);
    info->cc_major = prop.major;
    info->cc_minor = prop.minor;
    info->total_mem_bytes = (uint64_t)prop.totalGlobalMem;
    info->n_sms = prop.multiProcessorCount;
    return TDM_OK;
}

// TDM_EINVALID for an ordinal this process does not see.
static int check_index(int index, tdm_error_t *err)
{
    int count = 0;
    TDM_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (index < 0 || index >= count)
        return tdm_error_set(err, TDM_EINVALID, "cuda:%d does not exist (%d device(s))", index,
                             count);
    return TDM_OK;
}

extern "C" int tdm_device_cuda_memory_impl(int index, uint64_t *total_bytes, uint64_t *free_bytes,
                                           tdm_error_t *err)
{
    int rc = check_index(index, err);
    if (rc != TDM_OK)
        return rc;
    size_t free_b = 0, total_b = 0;
    TDM_CUDA_CHECK(cudaSetDevice(index));
    TDM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    *total_bytes = (uint64_t)total_b;
    *free_bytes = (uint64_t)free_b;
    return TDM_OK;
}

extern "C" int tdm_device_cuda_uuid_impl(int index, uint8_t bytes[16], tdm_error_t *err)
{
    int rc = check_index(index, err);
    if (rc != TDM_OK)
        return rc;
    cudaDeviceProp prop;
    TDM_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    memcpy(bytes, prop.uuid.bytes, 16);
    return TDM_OK;
}
