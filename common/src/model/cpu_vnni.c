/* cpu_vnni.c - the CPU backend's AVX-VNNI dot kernels (vpdpbusd on 256-bit registers); every
 * other kernel of this set is the AVX2 one. Chosen at run time. */
#include "model/cpu_kernels.h"

#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#include "model/cpu_x86.inc"

#define TDM_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

/* The exact integer block dots of cpu_gemm.inc with vpdpbusd (int32 accumulation, the same
 * integers as AVX2's vpmaddubsw + vpmaddwd), one 4-value chunk at a time. */
TDM_AVXVNNI static inline __m256i q4_step_vnni(__m256i s, __m256i u, __m256i q)
{
    return _mm256_dpbusd_avx_epi32(s, u, q);
}

TDM_AVXVNNI static inline __m256i q4_fin_vnni(__m256i s)
{
    return s;
}

TDM_AVXVNNI static inline __m256i q8_step_vnni(__m256i s, __m256i w, __m256i wabs, __m256i q)
{
    return _mm256_dpbusd_avx_epi32(s, wabs, _mm256_sign_epi8(q, w));
}

#define TDM_KTARGET TDM_AVXVNNI
#define TDM_KNAME(x) x##_vnni
#include "model/cpu_gemm.inc"
#undef TDM_KTARGET
#undef TDM_KNAME

static tdm_cpu_isa_t isa_vnni;
static const tdm_cpu_isa_t *isa_vnni_ptr; /* NULL: not on this CPU */

/* Built once (pthread_once): engines created later read the table while others run. */
static void isa_vnni_build(void)
{
    const tdm_cpu_isa_t *avx2 = tdm_cpu_isa_avx2();
    __builtin_cpu_init();
    if (!avx2 || !__builtin_cpu_supports("avxvnni"))
        return;
    static const tdm_cpu_gemm_fn gemm[TDM_CPU_N_QTYPES] = {
        gemm_q4_0_vnni, gemm_q4_1_vnni, gemm_q8_0_vnni, gemm_q4_k_vnni,
        gemm_q5_k_vnni, gemm_q6_k_vnni, gemm_q2_k_vnni, gemm_q6_k_vnni};
    tdm_cpu_isa_derive(&isa_vnni, avx2, "avx2+vnni", gemm);
    isa_vnni_ptr = &isa_vnni;
}

const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, isa_vnni_build);
    return isa_vnni_ptr;
}
#else
const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void)
{
    return NULL;
}
#endif
