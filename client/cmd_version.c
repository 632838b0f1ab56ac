/* cmd_version.c - `tandem version`: version, build features and visible GPUs. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "tandem/device.h"

int tdm_cmd_version(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--help") != 0 && strcmp(argv[1], "-h") != 0) {
        fprintf(stderr, "tandem version: unexpected argument '%s' (usage: tandem version)\n",
                argv[1]);
        return 2;
    }
    if (argc > 1) {
        printf("usage: tandem version\n\nPrints Tandem's version, whether this build has the "
               "CUDA backend, and the GPUs the CUDA runtime sees.\n");
        return 0;
    }
    printf("tandem %s\n", TANDEM_VERSION);
    printf("cuda backend: %s\n", tdm_device_cuda_built() ? "built" : "not built");
    if (!tdm_device_cuda_built())
        return 0;
    tdm_error_t err = {0};
    int n = 0;
    if (tdm_device_cuda_count(&n, &err) != TDM_OK) {
        printf("gpus: none (%s)\n", err.msg);
        return 0;
    }
    printf("gpus: %d\n", n);
    for (int i = 0; i < n; i++) {
        tdm_device_info_t info;
        if (tdm_device_cuda_info(i, &info, &err) != TDM_OK) {
            printf("  cuda:%d: %s\n", i, err.msg);
            continue;
        }
        printf("  cuda:%d: %s, compute capability %d.%d, %.1f GiB, %d SMs\n", i, info.name,
               info.cc_major, info.cc_minor, (double)info.total_mem_bytes / (1024.0 * 1024 * 1024),
               info.n_sms);
    }
    return 0;
}
