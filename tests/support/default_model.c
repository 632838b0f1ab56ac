/* default_model.c - where the tests find the default model (see tdm_test.h). */
#include <stdbool.h>
#include <stdio.h>
#include <sys/stat.h>

#include "tdm_test.h"
#include "tandem/config.h"

bool tdm_test_default_model(char *path, size_t cap, char *problem, size_t pcap)
{
    int rc = tdm_model_default_path(path, cap);
    if (rc != TDM_OK) {
        snprintf(problem, pcap, "cannot form the default model path (%s): set TANDEM_MODEL or HOME",
                 tdm_strerror(rc));
        return false;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(problem, pcap,
                 "model file %s is missing: run scripts/setup to download it (or set "
                 "TANDEM_MODEL to a copy of %s)",
                 path, TDM_DEFAULT_MODEL_FILE);
        return false;
    }
    return true;
}
