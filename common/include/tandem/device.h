/* device.h - compute devices: which GPUs the CUDA runtime sees, for `tandem version`, node
 * start-up checks (`device: cuda:N` in the config) and GPU tests that must skip without one.
 * Compiles as C11 and is also included by the CUDA side (extern "C").
 */
#ifndef TANDEM_DEVICE_H
#define TANDEM_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_device_info {
    int index;                /* CUDA device ordinal */
    char name[128];           /* "NVIDIA H200" */
    int cc_major, cc_minor;   /* compute capability */
    uint64_t total_mem_bytes; /* device memory, bytes */
    int n_sms;                /* streaming multiprocessors */
} tdm_device_info_t;

/* True when this build contains the CUDA backend (configured with TANDEM_CUDA=AUTO/ON and
 * nvcc found). Cannot fail. */
int tdm_device_cuda_built(void);

/* Number of CUDA devices usable by this process in *n. Returns TDM_OK (with *n possibly 0
 * only if the runtime reports none), or TDM_EUNAVAILABLE with the reason in *err: built
 * without CUDA, no driver, no device ("cudaGetDeviceCount: …" with the CUDA error text). */
int tdm_device_cuda_count(int *n, tdm_error_t *err);

/* Properties of device `index` (0 <= index < count). Errors: TDM_EUNAVAILABLE as above,
 * TDM_EINVALID for an index out of range. */
int tdm_device_cuda_info(int index, tdm_device_info_t *info, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_DEVICE_H */
