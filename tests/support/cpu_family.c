/* cpu_family.c - which CPU kernel families this machine can run, for tests that run one. */
#include "tdm_test.h"

#include <string.h>

#include "../../common/src/model/cpu_kernels.h"

const char *tdm_test_cpu_family_missing(const char *family)
{
    if (strcmp(family, "scalar") == 0)
        return NULL;
    if (strcmp(family, "avx2") == 0)
        return tdm_cpu_isa_avx2() ? NULL : "this CPU has no AVX2 + FMA + F16C";
    if (strcmp(family, "vnni") == 0)
        return tdm_cpu_isa_vnni() ? NULL : "this CPU has no AVX-VNNI";
    if (strcmp(family, "avx512") == 0)
        return tdm_cpu_isa_avx512() ? NULL : "this CPU has no AVX-512 F/BW/VL + VNNI";
    if (strcmp(family, "amx") == 0)
        return tdm_cpu_isa_amx() ? NULL
                                 : "this CPU (or kernel) has no AMX-TILE + AMX-INT8 with AVX-512 "
                                   "VNNI";
    return "unknown kernel family (scalar, avx2, vnni, avx512, amx)";
}
