/* checksum_device.c - KV block checksums computed on the GPU (tdm_kv_device_checksums): the
 * secret comes from libxxhash itself, so the device's XXH3 uses exactly the CPU's. */
#define XXH_STATIC_LINKING_ONLY
#include <stdlib.h>
#include <xxhash.h>

#include "tandem/transfer.h"
#ifdef TANDEM_HAVE_CUDA
#include "transfer/transfer_cuda.h"
#endif

int tdm_kv_device_checksums(int device, const void *device_base, const uint32_t *blocks, uint32_t n,
                            uint64_t block_bytes, uint64_t *out, tdm_error_t *err)
{
#ifdef TANDEM_HAVE_CUDA
    if (n == 0)
        return TDM_OK;
    _Static_assert(XXH3_SECRET_DEFAULT_SIZE == 192, "XXH3's default secret is 192 bytes");
    uint8_t secret[XXH3_SECRET_DEFAULT_SIZE];
    XXH3_generateSecret_fromSeed(secret, 0); /* seed 0: the default secret itself */
    uint64_t *offsets = malloc((size_t)n * sizeof *offsets);
    if (!offsets)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for %u block offsets", n);
    for (uint32_t i = 0; i < n; i++)
        offsets[i] = (uint64_t)blocks[i] * block_bytes;
    int rc =
        tdm_transfer_cuda_checksums(device, device_base, offsets, n, block_bytes, secret, out, err);
    free(offsets);
    return rc;
#else
    (void)device;
    (void)device_base;
    (void)blocks;
    (void)n;
    (void)block_bytes;
    (void)out;
    return tdm_error_set(err, TDM_EUNAVAILABLE,
                         "device checksums need a CUDA build (configure with -DTANDEM_CUDA=ON)");
#endif
}
