/* default_model.c - where the tests find the default model and the other cached models (see
 * tdm_test.h). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
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

bool tdm_test_cached_model(const char *env, const char *file, const char *setup_name, char *path,
                           size_t cap, char *problem, size_t pcap)
{
    const char *given = getenv(env);
    int rc = TDM_OK;
    if (given && *given) {
        if (snprintf(path, cap, "%s", given) >= (int)cap)
            rc = TDM_ERESOURCE;
    } else {
        rc = tdm_model_cache_path(file, path, cap);
    }
    if (rc != TDM_OK) {
        snprintf(problem, pcap, "cannot form the path of %s (%s): set %s or HOME", file,
                 tdm_strerror(rc), env);
        return false;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(problem, pcap,
                 "model file %s is missing: `scripts/setup --model %s` installs it (or set %s "
                 "to a copy of %s)",
                 path, setup_name, env, file);
        return false;
    }
    return true;
}
