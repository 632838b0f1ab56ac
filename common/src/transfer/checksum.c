/* checksum.c - the KV transfer's checksums (docs/protocol.md "KV transfer integrity"): XXH3-64
 * of each block on the CPU (tcp) and on the GPU (nccl, cuda_ipc: cuda/xxh3.cu, fed the secret
 * libxxhash itself makes, so both give the same value), the header checksum over a canonical
 * encoding of the header, and the comparison the receiver makes of what it computed.
 */
#define XXH_STATIC_LINKING_ONLY
#include "transfer/transfer_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
/* libxxhash's run-time dispatch (AVX-512 / AVX2 / SSE2): the same XXH3 values, about 30%
 * faster than the SSE2 baseline on the AVX2/AVX-512 hosts Tandem runs on. */
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <xxh_x86dispatch.h>
#define TDM_XXH3_64 XXH3_64bits_dispatch
#endif
#endif
#ifndef TDM_XXH3_64
#define TDM_XXH3_64 XXH3_64bits
#endif
#ifdef TANDEM_HAVE_CUDA
#include "transfer/transfer_cuda.h"
#endif

uint64_t tdm_kv_block_checksum(const void *block, uint64_t block_bytes)
{
    return TDM_XXH3_64(block, (size_t)block_bytes);
}

int tdm_kv_checksums_compare(const uint64_t *got, const Tandem__V1__KvTransfer *h, tdm_error_t *err)
{
    for (uint32_t i = 0; i < h->n_blocks; i++)
        if (got[i] != h->checksums[i])
            return tdm_error_set(err, TDM_EINVALID,
                                 "block %u checksum mismatch: got 0x%016" PRIx64
                                 " expected 0x%016" PRIx64,
                                 i, got[i], h->checksums[i]);
    return 0;
}

/* The device's XXH3 is fed the secret libxxhash makes, so it computes exactly the CPU's. */
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

/* Canonical encoding for tdm_kv_header_checksum: fixed-width little-endian integers and
 * length-prefixed strings, so the value does not depend on how protobuf encoded the header. */
typedef struct canon {
    uint8_t buf[1024];
    size_t n;
    uint64_t h; /* chained value of what did not fit in buf */
    bool chained;
} canon_t;

static void canon_flush(canon_t *c)
{
    c->h = c->chained ? XXH3_64bits_withSeed(c->buf, c->n, c->h) : XXH3_64bits(c->buf, c->n);
    c->chained = true;
    c->n = 0;
}

static void canon_bytes(canon_t *c, const void *p, size_t len)
{
    const uint8_t *b = p;
    while (len > 0) {
        if (c->n == sizeof c->buf)
            canon_flush(c);
        size_t k = sizeof c->buf - c->n < len ? sizeof c->buf - c->n : len;
        memcpy(c->buf + c->n, b, k);
        c->n += k;
        b += k;
        len -= k;
    }
}

static void canon_u64(canon_t *c, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    canon_bytes(c, b, sizeof b);
}

static void canon_str(canon_t *c, const char *s)
{
    size_t len = s ? strlen(s) : 0;
    canon_u64(c, len);
    canon_bytes(c, s, len);
}

uint64_t tdm_kv_header_checksum(const Tandem__V1__KvTransfer *h)
{
    canon_t c;
    c.n = 0;
    c.h = 0;
    c.chained = false;
    canon_bytes(&c, "tandem.kv.v1", 12);
    canon_str(&c, h->request_id);
    canon_u64(&c, h->attempt_id);
    canon_u64(&c, h->transfer_id);
    canon_u64(&c, h->n_tokens);
    canon_u64(&c, (uint64_t)(uint32_t)h->first_token);
    const Tandem__V1__KvLayout *l = h->layout;
    canon_u64(&c, l ? 1 : 0);
    if (l) {
        canon_u64(&c, l->n_layers);
        canon_u64(&c, l->n_kv_heads);
        canon_u64(&c, l->head_dim);
        canon_u64(&c, l->block_size);
        canon_u64(&c, (uint64_t)(uint32_t)l->dtype);
    }
    canon_u64(&c, h->model_fingerprint);
    canon_u64(&c, h->n_blocks);
    canon_u64(&c, h->block_bytes);
    canon_u64(&c, (uint64_t)(uint32_t)h->checksum_kind);
    canon_str(&c, h->backend);
    canon_str(&c, h->sender_node_id);
    uint64_t prefill_bits;
    memcpy(&prefill_bits, &h->prefill_s, sizeof prefill_bits);
    canon_u64(&c, prefill_bits);
    canon_u64(&c, h->n_ipc_handles);
    for (size_t i = 0; i < h->n_ipc_handles; i++) {
        canon_u64(&c, h->ipc_handles[i].len);
        canon_bytes(&c, h->ipc_handles[i].data, h->ipc_handles[i].len);
    }
    if ((l && (l->layers_per_group || l->n_group_windows)) || h->n_group_first_block) {
        /* (2.9) the group layout and where each group's blocks start; absent without groups,
         * so that such a header's value is the one it had before 2.9 */
        canon_bytes(&c, "groups", 6);
        canon_u64(&c, l ? l->layers_per_group : 0);
        canon_u64(&c, l ? l->n_group_windows : 0);
        for (size_t i = 0; l && i < l->n_group_windows; i++)
            canon_u64(&c, l->group_windows[i]);
        canon_u64(&c, h->n_group_first_block);
        for (size_t i = 0; i < h->n_group_first_block; i++)
            canon_u64(&c, h->group_first_block[i]);
    }
    canon_u64(&c, h->n_checksums);
    canon_u64(&c, h->n_block_offsets);
    canon_flush(&c);
    /* the chain: each block checksum (which covers that block's bytes), then each offset */
    for (size_t i = 0; i < h->n_checksums; i++)
        canon_u64(&c, h->checksums[i]);
    for (size_t i = 0; i < h->n_block_offsets; i++)
        canon_u64(&c, h->block_offsets[i]);
    if (c.n)
        canon_flush(&c);
    return c.h;
}
