/* device.c - host side of device discovery; the CUDA runtime calls live in cuda/device.cu
 * and are linked only when the build has CUDA (TANDEM_HAVE_CUDA). */
#include "tandem/device.h"

#ifdef TANDEM_HAVE_CUDA
int tdm_device_cuda_count_impl(int *n, tdm_error_t *err);
int tdm_device_cuda_info_impl(int index, tdm_device_info_t *info, tdm_error_t *err);
#endif

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
    return tdm_error_set(err, TDM_EUNAVAILABLE,
                         "this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)");
#endif
}

int tdm_device_cuda_info(int index, tdm_device_info_t *info, tdm_error_t *err)
{
#ifdef TANDEM_HAVE_CUDA
    return tdm_device_cuda_info_impl(index, info, err);
#else
    (void)index;
    (void)info;
    return tdm_error_set(err, TDM_EUNAVAILABLE,
                         "this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)");
#endif
}
