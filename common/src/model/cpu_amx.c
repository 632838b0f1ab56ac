/* cpu_amx.c - the CPU backend's AMX kernels (Intel Advanced Matrix Extensions: AMX-TILE and
 * AMX-INT8, Sapphire Rapids and later) for the quantized GEMM of batches: prefill and batched
 * decode (x86-64; chosen at run time, after the kernel grants this process the tile state).
 *
 * One tile multiply (TDPBSSD / TDPBSUD) computes the exact int32 dot products of 16 tokens'
 * activation blocks with one 8-row group's weight block: 16 x 8 x 32 multiply-adds, the
 * integer sums every kernel set forms (cpu_kernels.h). Two groups give a 16 x 16 result per
 * block, stored to L1 and taken to f32 one 16-row vector per token, where the block's scales
 * are applied exactly as the scalar reference applies them (fma(dw * da, isum, acc), then the
 * min term), so the results are the reference's bits and do not depend on the batch.
 *
 * Tile shapes (Intel SDM vol. 1 ch. 3.3, "Intel AMX"; the Intel Intrinsics Guide for
 * _tile_dpbssd): A = 16 tokens x 32 int8 activations (the q of a q8a_block_t, loaded with the
 * stride of a token's blocks), B = 8 rows of 4-value groups x (8 weight rows x 4 bytes), which
 * is exactly one packed chunk sequence (cpu_kernels.h: byte 4r + i of chunk k is value 4k + i
 * of row r): Q8_0, Q5_K and Q6_K load B straight from the packed matrix; Q4 nibbles are
 * unpacked once per call into an L1 buffer (Q4_0 as u - 8, signed).
 *
 * Batches under TDM_AMX_MIN_TOKENS (cpu_kernels.h) go to the AVX-512 kernels: the scale work per
 * result is the same there, and a tile of few tokens leaves the tile unit idle. */
#define _GNU_SOURCE /* syscall */
#include "model/cpu_kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <pthread.h>
#include <immintrin.h>
#include <stdalign.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TDM_AMX                                                                                    \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-"       \
                          "int8")))

#define TDM_AMX_KCHUNK 32 /* blocks per unpacked piece of a Q4 row pair (16 KiB) */

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: asm/prctl.h */
#define XFEATURE_XTILEDATA 18

/* tile registers */
#define T_A 0  /* activations: rows tokens, 32 (Q6_K: 16) bytes */
#define T_B 1  /* weights: 8 (Q6_K: 4) rows of 4-value groups x 16 weight rows x 4 bytes */
#define T_C 2  /* int32 sums: rows tokens x 16 weight rows */
#define T_CH 3 /* Q6_K: the second half block's sums */
/* tiles 4-7: the same roles for odd blocks, so two blocks' tile work is in flight */

/* The tile instructions, as inline assembly that names the memory each one reads or writes
 * (GCC 12's _tile_loadconfig declares only the first 8 bytes of the configuration as read and
 * its _tile_loadd and _tile_stored none of the tile's bytes, so stores before them could be
 * dropped or moved past them). `mem` is an lvalue covering the bytes. */
#define AMX_LOADD(t, base, stride, mem) AMX_LOADD_(t, base, stride, mem)
#define AMX_LOADD_(t, base, stride, mem)                                                           \
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm" #t ::"m"(mem), "r"((const void *)(base)),        \
                     "r"((long)(stride)))
#define AMX_STORED(t, base, stride, mem) AMX_STORED_(t, base, stride, mem)
#define AMX_STORED_(t, base, stride, mem)                                                          \
    __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)"                                           \
                     : "+m"(mem)                                                                   \
                     : "r"((void *)(base)), "r"((long)(stride)))
#define AMX_ZERO(t) AMX_ZERO_(t)
#define AMX_ZERO_(t) __asm__ volatile("tilezero %%tmm" #t ::)
/* d += a . b: a signed bytes, b signed (SSD) or unsigned (SUD) */
#define AMX_DPBSSD(d, a, b) AMX_DP_(tdpbssd, d, a, b)
#define AMX_DPBSUD(d, a, b) AMX_DP_(tdpbsud, d, a, b)
#define AMX_DP_(op, d, a, b) AMX_DP__(op, d, a, b)
#define AMX_DP__(op, d, a, b) __asm__ volatile(#op " %%tmm" #b ", %%tmm" #a ", %%tmm" #d ::)

/* The LDTILECFG operand (palette 1). */
typedef struct amx_cfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

static tdm_cpu_gemm_fn zgemm[TDM_CPU_N_QTYPES]; /* the AVX-512 kernels, for small batches */

/* Tiles for `rows` tokens and kbytes (32, or 16 for Q6_K's half blocks) per dot product. */
TDM_AMX static void amx_config(int rows, int kbytes)
{
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int set = 0; set < 8; set += 4) {
        c.rows[set + T_A] = (uint8_t)rows;
        c.colsb[set + T_A] = (uint16_t)kbytes;
        c.rows[set + T_B] = (uint8_t)(kbytes / 4);
        c.colsb[set + T_B] = 64;
        for (int t = T_C; t <= T_CH; t++) {
            c.rows[set + t] = (uint8_t)rows;
            c.colsb[set + t] = 64;
        }
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

/* Bytes per packed block of a group and offset of its quants, per kind (0 Q4_0, 1 Q4_1,
 * 2 Q8_0, 3 Q4_K, 4 Q6_K, 5 Q5_K; cpu_kernels.h). */
static const size_t amx_pbsz[6] = {144, 160, 272, 192, 320, 320};
static const size_t amx_qoff[6] = {16, 32, 16, 64, 64, 64};

/* Row pairs of B: 64 bytes of x (group 0's two 32-byte rows) and of y (group 1's) as
 * [x row 0, y row 0] and [x row 1, y row 1]. */
TDM_AMX static inline void amx_interleave(__m512i x, __m512i y, uint8_t *dst)
{
    _mm512_store_si512(dst, _mm512_shuffle_i64x2(x, y, 0x44));
    _mm512_store_si512(dst + 64, _mm512_shuffle_i64x2(x, y, 0xEE));
}

/* One block of a row pair (q0, q1: the two groups' packed quants; q1 NULL: zeros) as B in
 * dst (512 bytes): row j, for the 4-value group j, holds group 0's 8 rows x 4 bytes then
 * group 1's. Q4 (kinds 0, 1, 3): rows 0-3 the low nibbles of chunks 0-3, rows 4-7 the high
 * nibbles (values 4k + i and 16 + 4k + i), as bytes, Q4_0 as u - 8 (signed); the others: the
 * 8 signed chunks as they are. */
TDM_AMX static inline void amx_unpack(const uint8_t *q0, const uint8_t *q1, const int kind,
                                      uint8_t *dst)
{
    const __m512i zero = _mm512_setzero_si512();
    if (kind == 0 || kind == 1 || kind == 3) {
        const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i x = _mm512_loadu_si512(q0 + 64 * h);
            __m512i y = q1 ? _mm512_loadu_si512(q1 + 64 * h) : zero;
            __m512i xl = _mm512_and_si512(x, low), yl = _mm512_and_si512(y, low);
            __m512i xh = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
            __m512i yh = _mm512_and_si512(_mm512_srli_epi16(y, 4), low);
            if (kind == 0) {
                xl = _mm512_sub_epi8(xl, eight);
                yl = _mm512_sub_epi8(yl, eight);
                xh = _mm512_sub_epi8(xh, eight);
                yh = _mm512_sub_epi8(yh, eight);
            }
            amx_interleave(xl, yl, dst + 128 * h);
            amx_interleave(xh, yh, dst + 256 + 128 * h);
        }
        return;
    }
#pragma GCC unroll 4
    for (int h = 0; h < 4; h++)
        amx_interleave(_mm512_loadu_si512(q0 + 64 * h), q1 ? _mm512_loadu_si512(q1 + 64 * h) : zero,
                       dst + 128 * h);
}

/* 8 floats at p0 in lanes 0-7, 8 at p1 in lanes 8-15 */
TDM_AMX static inline __m512 amx_join_ps(const uint8_t *p0, const uint8_t *p1)
{
    __m256d lo = _mm256_loadu_pd((const double *)(const void *)p0);
    __m256d hi = _mm256_loadu_pd((const double *)(const void *)p1);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
}

/* The block's scales for the row pair (lanes 0-7 group 0, 8-15 group 1): dw, and mw (the min
 * of Q4_1 / Q4_K / Q5_K, the second half's scale of Q6_K). */
TDM_AMX static inline void amx_scales(const uint8_t *p0, const uint8_t *p1, const int kind,
                                      __m512 *dw, __m512 *mw)
{
    if (kind >= 3) {
        *dw = amx_join_ps(p0, p1);
        *mw = amx_join_ps(p0 + 32, p1 + 32);
        return;
    }
    __m256i h =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                _mm_loadu_si128((const __m128i *)p1), 1);
    *dw = _mm512_cvtph_ps(h);
    *mw = _mm512_setzero_ps();
    if (kind == 1) {
        __m256i m = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + 16))),
            _mm_loadu_si128((const __m128i *)(p1 + 16)), 1);
        *mw = _mm512_cvtph_ps(m);
    }
}

typedef struct amx_bytes {
    uint8_t b[512];
} amx_bytes_t; /* an lvalue for the bytes a tile load reads from an unpacked block */
typedef struct amx_sums {
    int32_t v[16][16];
} amx_sums_t; /* 16 token rows x 16 weight rows of int32 sums */

/* Block b's integer sums into s and, for Q6_K, the second half block's into sh: the tile
 * loads, one multiply (two for Q6_K) and the stores, on tiles a .. ch. bw: the block as B
 * (amx_unpack). */
#define AMX_BLOCK(ta, tb, tc, tch)                                                                 \
    do {                                                                                           \
        if (kind == 4) {                                                                           \
            /* Q6_K: two half blocks, values 0-15 (B rows 0-3) then 16-31 (rows 4-7) */            \
            AMX_LOADD(ta, aq, astride, *aq);                                                       \
            AMX_LOADD(tb, bw, 64, *bm);                                                            \
            AMX_ZERO(tc);                                                                          \
            AMX_DPBSSD(tc, ta, tb);                                                                \
            AMX_LOADD(ta, aq + 16, astride, *aq);                                                  \
            AMX_LOADD(tb, bw + 256, 64, *bm);                                                      \
            AMX_ZERO(tch);                                                                         \
            AMX_DPBSSD(tch, ta, tb);                                                               \
            AMX_STORED(tch, &sh->v[0][0], 64, *sh);                                                \
        } else {                                                                                   \
            AMX_LOADD(ta, aq, astride, *aq);                                                       \
            AMX_LOADD(tb, bw, 64, *bm);                                                            \
            AMX_ZERO(tc);                                                                          \
            if (kind == 1 || kind == 3)                                                            \
                AMX_DPBSUD(tc, ta, tb);                                                            \
            else                                                                                   \
                AMX_DPBSSD(tc, ta, tb);                                                            \
        }                                                                                          \
        AMX_STORED(tc, &s->v[0][0], 64, *s);                                                       \
    } while (0)

TDM_AMX static inline __attribute__((always_inline)) void amx_block(const int kind, int set,
                                                                    const int8_t *aq, long astride,
                                                                    const uint8_t *bw,
                                                                    amx_sums_t *s, amx_sums_t *sh)
{
    const amx_bytes_t *bm = (const amx_bytes_t *)bw;
    if (set == 0)
        AMX_BLOCK(0, 1, 2, 3);
    else
        AMX_BLOCK(4, 5, 6, 7);
}
#undef AMX_BLOCK

/* Blocks [b0, b1) of a row pair (p0, p1: the groups' packed data; p1 == NULL: one group)
 * against one tile of 16 token rows, accumulated into acc. full: 16 tokens from act, stride
 * nb; otherwise a[r] the blocks of token row r (rows past the tile's tokens repeat its last
 * one). bq holds the pair's blocks from b0 as B (amx_unpack). Even and odd blocks use their own
 * tiles and buffers, so the tile unit works on blocks b + 1 and b + 2 while the vector units
 * apply block b's scales. */
TDM_AMX static inline __attribute__((always_inline)) void
amx_tile(const uint8_t *p0, const uint8_t *p1, const int kind, const bool full,
         const q8a_block_t *act, const q8a_block_t *const *a, size_t nb, size_t b0, size_t b1,
         const uint8_t *bq, __m512 *acc)
{
    alignas(64) amx_sums_t s[2], sh[2];
    const size_t pbsz = amx_pbsz[kind];
    const long astride = (long)(nb * sizeof(q8a_block_t));
    const bool two = p1 != NULL;
    for (size_t b = b0; b < b1 && b < b0 + 2; b++)
        amx_block(kind, (int)(b - b0), act[b].q, astride, bq + (b - b0) * 512, &s[b - b0],
                  &sh[b - b0]);
    for (size_t b = b0; b < b1; b++) {
        const int cur = (int)((b - b0) & 1);
        const uint8_t *w0 = p0 + b * pbsz, *w1 = two ? p1 + b * pbsz : w0;
        __m512 dw, mw;
        amx_scales(w0, w1, kind, &dw, &mw);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            const q8a_block_t *ab = full ? act + (size_t)r * nb + b : a[r] + b;
            __m512 da = _mm512_set1_ps(ab->d);
            __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(s[cur].v[r]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), isum, acc[r]);
            if (kind == 4)
                acc[r] =
                    _mm512_fmadd_ps(_mm512_mul_ps(mw, da),
                                    _mm512_cvtepi32_ps(_mm512_load_si512(sh[cur].v[r])), acc[r]);
            else if (kind != 0 && kind != 2)
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ab->s), acc[r]);
        }
        /* block b + 2 on the tiles and buffers block b used */
        if (b + 2 < b1)
            amx_block(kind, cur, act[b + 2].q, astride, bq + (b + 2 - b0) * 512, &s[cur], &sh[cur]);
    }
}

/* Groups [g, g + np) (np 1 or 2) against nt tokens: per piece of TDM_AMX_KCHUNK blocks the
 * blocks are laid out as B once (amx_unpack), then every tile of 16 tokens runs over the piece,
 * its accumulators carried in out between pieces (an f32 store and load: exact). *rows_cfg:
 * the token rows the tiles are configured for, reconfigured when a tile has fewer. */
TDM_AMX static inline __attribute__((always_inline)) void
amx_pair(const tdm_cpu_qmat_t *w, size_t g, int np, const int kind, const q8a_block_t *act,
         uint32_t nt, float *out, size_t ldo, int *rows_cfg)
{
    alignas(64) uint8_t bq[TDM_AMX_KCHUNK * 512];
    const size_t nb = w->nb;
    const uint8_t *p0 = w->data + g * w->group_bytes;
    const uint8_t *p1 = np > 1 ? p0 + w->group_bytes : NULL;
    uint64_t r0 = 8 * (uint64_t)g;
    uint64_t nr = w->n_out - r0 < 8 * (uint64_t)np ? w->n_out - r0 : 8 * (uint64_t)np;
    const __mmask16 mask = (__mmask16)((1u << nr) - 1);
    for (size_t b0 = 0; b0 < nb; b0 += TDM_AMX_KCHUNK) {
        size_t b1 = b0 + TDM_AMX_KCHUNK < nb ? b0 + TDM_AMX_KCHUNK : nb;
        const size_t pbsz = amx_pbsz[kind], qoff = amx_qoff[kind];
        for (size_t b = b0; b < b1; b++)
            amx_unpack(p0 + b * pbsz + qoff, p1 ? p1 + b * pbsz + qoff : NULL, kind,
                       bq + (b - b0) * 512);
        for (uint32_t t = 0; t < nt; t += 16) {
            int rows = nt - t < 16 ? (int)(nt - t) : 16;
            if (rows != *rows_cfg) {
                amx_config(rows, kind == 4 ? 16 : 32);
                *rows_cfg = rows;
            }
            const q8a_block_t *a[16];
            for (int r = 0; r < 16; r++)
                a[r] = act + (size_t)(t + (uint32_t)(r < rows ? r : rows - 1)) * nb;
            __m512 acc[16];
            float *o = out + (size_t)t * ldo + r0;
#pragma GCC unroll 16
            for (int r = 0; r < 16; r++)
                acc[r] = b0 == 0 || r >= rows ? _mm512_setzero_ps()
                                              : _mm512_maskz_loadu_ps(mask, o + (size_t)r * ldo);
            if (rows == 16)
                amx_tile(p0, p1, kind, true, a[0], a, nb, b0, b1, bq, acc);
            else
                amx_tile(p0, p1, kind, false, a[0], a, nb, b0, b1, bq, acc);
            for (int r = 0; r < rows; r++)
                _mm512_mask_storeu_ps(o + (size_t)r * ldo, mask, acc[r]);
        }
    }
}

#define TDM_GEN_AGEMM(name, kind, qt)                                                              \
    TDM_AMX static void name(const tdm_cpu_qmat_t *w, size_t g0, size_t g1,                        \
                             const q8a_block_t *act, uint32_t nt, float *out, size_t ldo)          \
    {                                                                                              \
        if (nt < TDM_AMX_MIN_TOKENS) {                                                             \
            zgemm[qt](w, g0, g1, act, nt, out, ldo);                                               \
            return;                                                                                \
        }                                                                                          \
        int rows_cfg = 0; /* token rows the tiles are configured for (0: not yet) */               \
        for (size_t g = g0; g < g1; g += 2)                                                        \
            amx_pair(w, g, g + 1 < g1 ? 2 : 1, kind, act, nt, out, ldo, &rows_cfg);                \
        __asm__ volatile("tilerelease" ::);                                                        \
    }
TDM_GEN_AGEMM(agemm_q4_0, 0, TDM_CPU_Q4_0)
TDM_GEN_AGEMM(agemm_q4_1, 1, TDM_CPU_Q4_1)
TDM_GEN_AGEMM(agemm_q8_0, 2, TDM_CPU_Q8_0)
TDM_GEN_AGEMM(agemm_q4_k, 3, TDM_CPU_Q4_K)
TDM_GEN_AGEMM(agemm_q6_k, 4, TDM_CPU_Q6_K)
TDM_GEN_AGEMM(agemm_q5_k, 5, TDM_CPU_Q5_K)

/* Q2_K has no tile kernel: its per-16 mins need the activations' half sums, which the tile
 * multiply does not give; every batch takes the AVX-512 GEMM (the same bits). Q3_K is packed as
 * Q6_K and runs agemm_q6_k. */
TDM_AMX static void agemm_q2_k(const tdm_cpu_qmat_t *w, size_t g0, size_t g1,
                               const q8a_block_t *act, uint32_t nt, float *out, size_t ldo)
{
    zgemm[TDM_CPU_Q2_K](w, g0, g1, act, nt, out, ldo);
}

/* CPUID.(EAX=7,ECX=0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and Linux's permission to use
 * the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+; without it the first tile
 * instruction faults). */
static bool amx_ok;

static void amx_probe(void)
{
    unsigned a, b, c, d;
    amx_ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
             tdm_cpu_has_avx512vnni() &&
             syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

bool tdm_cpu_has_amx(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, amx_probe);
    return amx_ok;
}

static tdm_cpu_isa_t isa_amx;
static const tdm_cpu_isa_t *isa_amx_ptr; /* NULL: not on this CPU */

/* Built once (pthread_once): engines created later read the table while others run. */
static void isa_amx_build(void)
{
    const tdm_cpu_isa_t *z = tdm_cpu_isa_avx512();
    if (!z || !tdm_cpu_has_amx())
        return;
    memcpy(zgemm, z->gemm, sizeof zgemm);
    static const tdm_cpu_gemm_fn gemm[TDM_CPU_N_QTYPES] = {agemm_q4_0, agemm_q4_1, agemm_q8_0,
                                                           agemm_q4_k, agemm_q5_k, agemm_q6_k,
                                                           agemm_q2_k, agemm_q6_k /* Q3_K */};
    tdm_cpu_isa_derive(&isa_amx, z, "amx-int8", gemm);
    isa_amx_ptr = &isa_amx;
}

const tdm_cpu_isa_t *tdm_cpu_isa_amx(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, isa_amx_build);
    return isa_amx_ptr;
}
#else
bool tdm_cpu_has_amx(void)
{
    return false;
}

const tdm_cpu_isa_t *tdm_cpu_isa_amx(void)
{
    return NULL;
}
#endif
