/* cpu_vnni.c - the CPU backend's AVX-VNNI dot kernels (vpdpbusd on 256-bit registers); every
 * other kernel of this set is the AVX2 one. Chosen at run time. */
#include "model/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include "model/cpu_x86.inc"

#define TDM_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

/* The exact integer block dots of cpu_gemm.inc with vpdpbusd (int32 accumulation, the same
 * integers as AVX2's vpmaddubsw + vpmaddwd). */
TDM_AVXVNNI static inline __m256i q4_isum_vnni(const __m256i *u, const int8_t *q)
{
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        int32_t v;
        memcpy(&v, q + 4 * k, 4);
        s = _mm256_dpbusd_avx_epi32(s, u[k], _mm256_set1_epi32(v));
    }
    return s;
}

TDM_AVXVNNI static inline __attribute__((always_inline)) __m256i
q8_isum_vnni(const __m256i *w, const __m256i *wabs, const int8_t *q, const int nk)
{
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < nk; k++) {
        int32_t v;
        memcpy(&v, q + 4 * k, 4);
        s = _mm256_dpbusd_avx_epi32(s, wabs[k], _mm256_sign_epi8(_mm256_set1_epi32(v), w[k]));
    }
    return s;
}

#define TDM_KTARGET TDM_AVXVNNI
#define TDM_KNAME(x) x##_vnni
#include "model/cpu_gemm.inc"
#undef TDM_KTARGET
#undef TDM_KNAME

const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void)
{
    static tdm_cpu_isa_t isa;
    const tdm_cpu_isa_t *avx2 = tdm_cpu_isa_avx2();
    __builtin_cpu_init();
    if (!avx2 || !__builtin_cpu_supports("avxvnni"))
        return NULL;
    isa = *avx2;
    isa.name = "avx2+vnni";
    isa.gemm[TDM_CPU_Q4_0] = gemm_q4_0_vnni;
    isa.gemm[TDM_CPU_Q4_1] = gemm_q4_1_vnni;
    isa.gemm[TDM_CPU_Q8_0] = gemm_q8_0_vnni;
    isa.gemm[TDM_CPU_Q4_K] = gemm_q4_k_vnni;
    isa.gemm[TDM_CPU_Q5_K] = gemm_q5_k_vnni;
    isa.gemm[TDM_CPU_Q6_K] = gemm_q6_k_vnni;
    return &isa;
}
#else
const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void)
{
    return NULL;
}
#endif
