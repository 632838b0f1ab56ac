/* device.c - host side of device discovery; the CUDA runtime calls live in cuda/device.cu
 * and are linked only when the build has CUDA (TANDEM_HAVE_CUDA). */
#include "tandem/device.h"

#include <string.h>

#ifdef TANDEM_HAVE_CUDA
int tdm_device_cuda_count_impl(int *n, tdm_error_t *err);
int tdm_device_cuda_info_impl(int index, tdm_device_info_t *info, tdm_error_t *err);
int tdm_device_cuda_memory_impl(int index, uint64_t *total_bytes, uint64_t *free_bytes,
                                tdm_error_t *err);
int tdm_device_cuda_uuid_impl(int index, uint8_t bytes[16], tdm_error_t *err);
#endif

#define NO_CUDA_MSG "this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)"

int tdm_device_cuda_built(void)
{
#ifdef TANDEM_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int tdm_device_cuda_count(int *n, tdm_error_t *err)
{
    *n = 0;
#ifdef TANDEM_HAVE_CUDA
    return tdm_device_cuda_count_impl(n, err);
#else
    return tdm_error_set(err, TDM_EUNAVAILABLE, NO_CUDA_MSG);
#endif
}

int tdm_device_cuda_info(int index, tdm_device_info_t *info, tdm_error_t *err)
{
#ifdef TANDEM_HAVE_CUDA
    return tdm_device_cuda_info_impl(index, info, err);
#else
    (void)index;
    (void)info;
    return tdm_error_set(err, TDM_EUNAVAILABLE, NO_CUDA_MSG);
#endif
}

int tdm_device_cuda_memory(int index, uint64_t *total_bytes, uint64_t *free_bytes, tdm_error_t *err)
{
    *total_bytes = 0;
    *free_bytes = 0;
#ifdef TANDEM_HAVE_CUDA
    return tdm_device_cuda_memory_impl(index, total_bytes, free_bytes, err);
#else
    (void)index;
    return tdm_error_set(err, TDM_EUNAVAILABLE, NO_CUDA_MSG);
#endif
}

void tdm_device_uuid_format(const uint8_t bytes[16], char out[TDM_DEVICE_UUID_MAX])
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    memcpy(out, "GPU-", 4);
    o = 4;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            out[o++] = '-';
        out[o++] = hex[bytes[i] >> 4];
        out[o++] = hex[bytes[i] & 15];
    }
    out[o] = '\0';
}

int tdm_device_cuda_uuid(int index, char uuid[TDM_DEVICE_UUID_MAX], tdm_error_t *err)
{
    uuid[0] = '\0';
#ifdef TANDEM_HAVE_CUDA
    uint8_t bytes[16];
    int rc = tdm_device_cuda_uuid_impl(index, bytes, err);
    if (rc == TDM_OK)
        tdm_device_uuid_format(bytes, uuid);
    return rc;
#else
    (void)index;
    return tdm_error_set(err, TDM_EUNAVAILABLE, NO_CUDA_MSG);
#endif
}
