/* xxh3_lanes.h - XXH3-64 (seed 0, the default 192-byte secret) for inputs longer than 240
 * bytes, written as the lane arithmetic a GPU computes in parallel: one KV block's hash by one
 * CUDA thread block, its 8 accumulator lanes x 16 stripes of each 1 KiB block of input at once
 * (cuda/xxh3.cu), and the same steps run one after the other on the host
 * (tdm_xxh3_long_lanes), which the unit tests compare with libxxhash's XXH3_64bits.
 *
 * Follows the XXH3 specification (xxHash's doc/xxhash_spec.md, "Large inputs"): 8 64-bit
 * accumulators start at fixed primes; each 64-byte stripe s of a block adds, to accumulator i,
 * the input word i^1 and lo32(k) * hi32(k) with k = input word i ^ secret word at byte 8s + 8i;
 * after each block of 16 stripes every accumulator is scrambled with the last 64 secret bytes;
 * the last partial block's whole stripes, then the input's last 64 bytes (secret at byte
 * 192 - 64 - 7) are accumulated; the result merges the accumulators with the secret from byte
 * 11 and len * PRIME64_1 and is avalanched. Additions are mod 2^64 and commute, so a block's
 * 16 stripe contributions to a lane may be summed in any order: that is what makes the block
 * parallel. Little-endian words (as both the CPU and the GPU are).
 *
 * Compiles as C11 and as CUDA C++ (TDM_XXH3_HD marks the functions for both sides).
 */
#ifndef TANDEM_TRANSFER_XXH3_LANES_H
#define TANDEM_TRANSFER_XXH3_LANES_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TDM_XXH3_HD static inline __host__ __device__
#else
#define TDM_XXH3_HD static inline
#endif

#define TDM_XXH3_SECRET_BYTES 192u /* XXH3_SECRET_DEFAULT_SIZE */
#define TDM_XXH3_STRIPE 64u
#define TDM_XXH3_STRIPES_PER_BLOCK 16u /* (secret bytes - stripe) / 8 */
#define TDM_XXH3_BLOCK (TDM_XXH3_STRIPE * TDM_XXH3_STRIPES_PER_BLOCK)
#define TDM_XXH3_MIN_LONG 241u /* shorter inputs take XXH3's other paths */

#define TDM_XXH3_PRIME32_1 UINT64_C(0x9E3779B1)
#define TDM_XXH3_PRIME32_2 UINT64_C(0x85EBCA77)
#define TDM_XXH3_PRIME32_3 UINT64_C(0xC2B2AE3D)
#define TDM_XXH3_PRIME64_1 UINT64_C(0x9E3779B185EBCA87)
#define TDM_XXH3_PRIME64_2 UINT64_C(0xC2B2AE3D27D4EB4F)
#define TDM_XXH3_PRIME64_3 UINT64_C(0x165667B19E3779F9)
#define TDM_XXH3_PRIME64_4 UINT64_C(0x85EBCA77C2B2AE63)
#define TDM_XXH3_PRIME64_5 UINT64_C(0x27D4EB2F165667C5)
#define TDM_XXH3_PRIME_MX1 UINT64_C(0x165667919E3779F9)

/* A little-endian 64-bit word at any alignment. */
TDM_XXH3_HD uint64_t tdm_xxh3_read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Accumulator lane's starting value. */
TDM_XXH3_HD uint64_t tdm_xxh3_acc_init(unsigned lane)
{
    switch (lane) {
    case 0: return TDM_XXH3_PRIME32_3;
    case 1: return TDM_XXH3_PRIME64_1;
    case 2: return TDM_XXH3_PRIME64_2;
    case 3: return TDM_XXH3_PRIME64_3;
    case 4: return TDM_XXH3_PRIME64_4;
    case 5: return TDM_XXH3_PRIME32_2;
    case 6: return TDM_XXH3_PRIME64_5;
    default: return TDM_XXH3_PRIME32_1;
    }
}

/* What one 64-byte stripe adds to accumulator `lane`, with the secret at `sec` (8 words). */
TDM_XXH3_HD uint64_t tdm_xxh3_stripe_lane(const uint8_t *stripe, const uint8_t *sec, unsigned lane)
{
    uint64_t key = tdm_xxh3_read64(stripe + 8 * lane) ^ tdm_xxh3_read64(sec + 8 * lane);
    return tdm_xxh3_read64(stripe + 8 * (lane ^ 1u)) + (key & 0xFFFFFFFFu) * (key >> 32);
}

/* Accumulator `lane` after a block: scrambled with the secret's last 64 bytes. */
TDM_XXH3_HD uint64_t tdm_xxh3_scramble_lane(uint64_t acc, const uint8_t *secret, unsigned lane)
{
    acc ^= acc >> 47;
    acc ^= tdm_xxh3_read64(secret + TDM_XXH3_SECRET_BYTES - TDM_XXH3_STRIPE + 8 * lane);
    return acc * TDM_XXH3_PRIME32_1;
}

/* The 128-bit product of a and b, its two halves xored. */
TDM_XXH3_HD uint64_t tdm_xxh3_mul128_fold64(uint64_t a, uint64_t b)
{
    uint64_t lo_lo = (a & 0xFFFFFFFFu) * (b & 0xFFFFFFFFu);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFu);
    uint64_t lo_hi = (a & 0xFFFFFFFFu) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFu) + lo_hi;
    uint64_t hi = hi_hi + (hi_lo >> 32) + (cross >> 32);
    uint64_t lo = (cross << 32) | (lo_lo & 0xFFFFFFFFu);
    return lo ^ hi;
}

/* The hash from the final accumulators of an input of len bytes. */
TDM_XXH3_HD uint64_t tdm_xxh3_merge(const uint64_t acc[8], const uint8_t *secret, uint64_t len)
{
    uint64_t h = len * TDM_XXH3_PRIME64_1;
    const uint8_t *s = secret + 11; /* XXH_SECRET_MERGEACCS_START */
    for (unsigned i = 0; i < 4; i++)
        h += tdm_xxh3_mul128_fold64(acc[2 * i] ^ tdm_xxh3_read64(s + 16 * i),
                                    acc[2 * i + 1] ^ tdm_xxh3_read64(s + 16 * i + 8));
    h ^= h >> 37;
    h *= TDM_XXH3_PRIME_MX1;
    return h ^ (h >> 32);
}

/* Whole 1 KiB blocks before the last partial one, and whole stripes in that one. */
TDM_XXH3_HD uint64_t tdm_xxh3_n_blocks(uint64_t len)
{
    return (len - 1) / TDM_XXH3_BLOCK;
}
TDM_XXH3_HD unsigned tdm_xxh3_last_stripes(uint64_t len)
{
    return (unsigned)(((len - 1) - TDM_XXH3_BLOCK * tdm_xxh3_n_blocks(len)) / TDM_XXH3_STRIPE);
}

/* Secret of the input's last stripe. */
#define TDM_XXH3_LAST_SECRET (TDM_XXH3_SECRET_BYTES - TDM_XXH3_STRIPE - 7u)

/* XXH3-64 of in[len] (len >= TDM_XXH3_MIN_LONG) with the default secret, lane by lane as the
 * kernel computes it, on the host. For the tests; cannot fail. */
static inline uint64_t tdm_xxh3_long_lanes(const uint8_t *in, uint64_t len, const uint8_t *secret)
{
    uint64_t acc[8];
    for (unsigned i = 0; i < 8; i++)
        acc[i] = tdm_xxh3_acc_init(i);
    uint64_t nb = tdm_xxh3_n_blocks(len);
    for (uint64_t n = 0; n < nb; n++)
        for (unsigned i = 0; i < 8; i++) {
            uint64_t sum = acc[i];
            for (unsigned s = 0; s < TDM_XXH3_STRIPES_PER_BLOCK; s++)
                sum += tdm_xxh3_stripe_lane(in + n * TDM_XXH3_BLOCK + s * TDM_XXH3_STRIPE,
                                            secret + 8 * s, i);
            acc[i] = tdm_xxh3_scramble_lane(sum, secret, i);
        }
    unsigned last = tdm_xxh3_last_stripes(len);
    for (unsigned i = 0; i < 8; i++) {
        for (unsigned s = 0; s < last; s++)
            acc[i] += tdm_xxh3_stripe_lane(in + nb * TDM_XXH3_BLOCK + s * TDM_XXH3_STRIPE,
                                           secret + 8 * s, i);
        acc[i] +=
            tdm_xxh3_stripe_lane(in + len - TDM_XXH3_STRIPE, secret + TDM_XXH3_LAST_SECRET, i);
    }
    return tdm_xxh3_merge(acc, secret, len);
}

#endif /* TANDEM_TRANSFER_XXH3_LANES_H */
