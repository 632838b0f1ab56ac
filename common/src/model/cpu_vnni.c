/* cpu_vnni.c - the CPU backend's AVX-VNNI dot kernels (vpdpbusd on 256-bit registers); every
 * other kernel of this set is the AVX2 one. Chosen at run time. */
#include "model/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include "model/cpu_x86.inc"

#define TDM_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

/* sum over 32 lanes of u[i] * s[i] as 8 int32 lanes as floats: one vpdpbusd instead of
 * vpmaddubsw + vpmaddwd (the same exact integers) */
TDM_AVXVNNI static inline __m256 mul_sum_us8_vnni(__m256i u, __m256i s)
{
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s));
}

#define TDM_KTARGET TDM_AVXVNNI
#define TDM_KNAME(x) x##_vnni
#define TDM_KMULSUM mul_sum_us8_vnni
#include "model/cpu_dots.inc"
#undef TDM_KTARGET
#undef TDM_KNAME
#undef TDM_KMULSUM

#define TDM_DOTS(name)                                                                             \
    {                                                                                              \
        {                                                                                          \
            name##_1_vnni, name##_2_vnni, name##_3_vnni, name##_4_vnni                             \
        }                                                                                          \
    }

const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void)
{
    static tdm_cpu_isa_t isa;
    const tdm_cpu_isa_t *avx2 = tdm_cpu_isa_avx2();
    __builtin_cpu_init();
    if (!avx2 || !__builtin_cpu_supports("avxvnni"))
        return NULL;
    isa = *avx2;
    isa.name = "avx2+vnni";
    tdm_cpu_dot_set_t q4_0 = TDM_DOTS(dot_q4_0), q4_1 = TDM_DOTS(dot_q4_1),
                      q8_0 = TDM_DOTS(dot_q8_0);
    isa.dot[TDM_CPU_Q4_0] = q4_0;
    isa.dot[TDM_CPU_Q4_1] = q4_1;
    isa.dot[TDM_CPU_Q8_0] = q8_0;
    return &isa;
}
#else
const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void)
{
    return NULL;
}
#endif
