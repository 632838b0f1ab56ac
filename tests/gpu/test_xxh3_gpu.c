/* test_xxh3_gpu.c - the KV block checksum computed on the GPU (tdm_kv_device_checksums,
 * common/src/transfer/cuda/xxh3.cu) equals the CPU's (tdm_kv_block_checksum: libxxhash's
 * XXH3-64) for random bytes at several block sizes (XXH3's long-input edges and the real KV
 * block sizes of SmolLM2-135M and a Llama-3.1-8B shape, f16 and q8), for blocks named in any
 * order, and changes when one byte does. Skips (exit 77) with the reason when the build has no
 * CUDA or no GPU is present. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tdm_test.h"
#include "tandem/device.h"
#include "tandem/kv.h"
#include "tandem/transfer.h"

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime_api.h>

#define N_BLOCKS 24u

static void fill_random(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t z = seed | 1;
    for (size_t i = 0; i < n; i++) {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        p[i] = (uint8_t)(z >> 24);
    }
}

/* One block size: N_BLOCKS random blocks on the device, their device checksums (blocks in a
 * shuffled order) against the CPU's over the same bytes; then one flipped byte. */
static void check_size(uint64_t bb)
{
    size_t bytes = (size_t)(bb * N_BLOCKS);
    uint8_t *host = malloc(bytes);
    assert_non_null(host);
    fill_random(host, bytes, bb * UINT64_C(0x9e3779b97f4a7c15));
    void *dev = NULL;
    assert_int_equal(cudaMalloc(&dev, bytes), cudaSuccess);
    assert_int_equal(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    uint32_t blocks[N_BLOCKS];
    for (uint32_t i = 0; i < N_BLOCKS; i++)
        blocks[i] = (i * 7u + 3u) % N_BLOCKS; /* 7 is prime to 24: a permutation */
    uint64_t got[N_BLOCKS];
    tdm_error_t err = {0};
    if (tdm_kv_device_checksums(0, dev, blocks, N_BLOCKS, bb, got, &err) != TDM_OK)
        fail_msg("block_bytes %llu: %s", (unsigned long long)bb, err.msg);
    for (uint32_t i = 0; i < N_BLOCKS; i++) {
        uint64_t want = tdm_kv_block_checksum(host + (size_t)blocks[i] * bb, bb);
        if (got[i] != want)
            fail_msg("block_bytes %llu block %u: device %016llx, CPU %016llx",
                     (unsigned long long)bb, blocks[i], (unsigned long long)got[i],
                     (unsigned long long)want);
    }
    uint8_t *last = (uint8_t *)dev + bytes - 1; /* the last byte of block N_BLOCKS - 1 */
    uint8_t flipped = (uint8_t)(host[bytes - 1] ^ 0x01);
    assert_int_equal(cudaMemcpy(last, &flipped, 1, cudaMemcpyHostToDevice), cudaSuccess);
    uint32_t one = N_BLOCKS - 1;
    uint64_t after = 0;
    assert_int_equal(tdm_kv_device_checksums(0, dev, &one, 1, bb, &after, &err), TDM_OK);
    host[bytes - 1] = flipped;
    assert_int_equal(after, tdm_kv_block_checksum(host + (size_t)one * bb, bb));
    assert_true(after != tdm_kv_block_checksum(host, bb) || N_BLOCKS == 1);
    printf("block_bytes %llu: %u device checksums equal the CPU's\n", (unsigned long long)bb,
           N_BLOCKS);
    cudaFree(dev);
    free(host);
}

static void test_device_checksum_equals_cpu(void **state)
{
    (void)state;
    const tdm_kv_layout_t smollm2 = {30, 3, 64, 16, TDM_KV_F16};
    const tdm_kv_layout_t smollm2_q8 = {30, 3, 64, 16, TDM_KV_Q8};
    const tdm_kv_layout_t llama8b = {32, 8, 128, 16, TDM_KV_F16};
    const uint64_t sizes[] = {241,
                              256,
                              1024,
                              1025,
                              1088,
                              4096 + 8,
                              65536 + 4,
                              tdm_kv_block_bytes(&smollm2),
                              tdm_kv_block_bytes(&smollm2_q8),
                              tdm_kv_block_bytes(&llama8b)};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        check_size(sizes[i]);
}

static void test_device_checksum_refuses_short(void **state)
{
    (void)state;
    void *dev = NULL;
    assert_int_equal(cudaMalloc(&dev, 4096), cudaSuccess);
    uint32_t b = 0;
    uint64_t sum = 0;
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_device_checksums(0, dev, &b, 1, 240, &sum, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "at least 241 bytes"));
    cudaFree(dev);
}
#endif

int main(void)
{
#ifndef TANDEM_HAVE_CUDA
    printf("SKIP: this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)\n");
    return 77;
#else
    int n = 0;
    tdm_error_t err = {0};
    if (tdm_device_cuda_count(&n, &err) != TDM_OK || n == 0) {
        printf("SKIP: no usable CUDA device: %s\n", n == 0 && !err.msg[0] ? "0 devices" : err.msg);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device_checksum_equals_cpu),
        cmocka_unit_test(test_device_checksum_refuses_short),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
