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

/* Memory of device `index` now (cudaMemGetInfo after selecting it, which also creates this
 * process's context on it): *total_bytes and *free_bytes, bytes. Errors as for
 * tdm_device_cuda_info; in a build without CUDA TDM_EUNAVAILABLE naming the build. */
int tdm_device_cuda_memory(int index, uint64_t *total_bytes, uint64_t *free_bytes,
                           tdm_error_t *err);

/* Bytes of a GPU UUID as text, "GPU-" and 32 hex digits in nvidia-smi's grouping
 * ("GPU-8-4-4-4-12"), with the NUL. */
#define TDM_DEVICE_UUID_MAX 41

/* The UUID of device `index` (cudaDeviceProp.uuid) as nvidia-smi prints it, into
 * uuid[TDM_DEVICE_UUID_MAX]: the same GPU has the same UUID in every process, whatever its
 * ordinal there (CUDA_VISIBLE_DEVICES renumbers ordinals). Errors as for
 * tdm_device_cuda_info. */
int tdm_device_cuda_uuid(int index, char uuid[TDM_DEVICE_UUID_MAX], tdm_error_t *err);

/* Formats 16 UUID bytes as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" into
 * out[TDM_DEVICE_UUID_MAX]. Cannot fail. */
void tdm_device_uuid_format(const uint8_t bytes[16], char out[TDM_DEVICE_UUID_MAX]);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_DEVICE_H */
