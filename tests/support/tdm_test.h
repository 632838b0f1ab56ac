/* tdm_test.h - helpers shared by the unit tests: cmocka includes, paths to test data and to
 * the default model, and a writer for tiny random-weight Llama GGUF models. */
#ifndef TANDEM_TEST_SUPPORT_H
#define TANDEM_TEST_SUPPORT_H

#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

/* Finds the default model (tdm_model_default_path: $TANDEM_MODEL or the cache) and checks the
 * file exists. Returns true with the path in path[cap]; false with the reason (what to run or
 * set) in problem[pcap]. Tests fail, never skip, on false: scripts/setup installs the model. */
bool tdm_test_default_model(char *path, size_t cap, char *problem, size_t pcap);

/* Gemma 3 270M Q4_K_M as `scripts/setup --model gemma3-270m` installs it in the model cache. */
#define TDM_TEST_GEMMA3_FILE "gemma-3-270m-q4_k_m.gguf"
#define TDM_TEST_GEMMA3_SETUP "gemma3-270m"

/* Finds a model other than the default one: $env when that variable is set and not empty,
 * else file in the model cache (tdm_model_cache_path). Returns true with the path in
 * path[cap] when the file exists; false with the reason in problem[pcap] (which
 * `scripts/setup --model setup_name` installs it, or which variable to set). Tests of such a
 * model skip (exit 77) on false, printing the reason: CI installs it (scripts/test). */
bool tdm_test_cached_model(const char *env, const char *file, const char *setup_name, char *path,
                           size_t cap, char *problem, size_t pcap);

/* Why this CPU cannot run kernel family `family` (TANDEM_CPU_KERNELS: scalar, avx2, vnni,
 * avx512, amx): a sentence naming the missing instructions, or NULL when it can. An unknown
 * name is reported as such. */
const char *tdm_test_cpu_family_missing(const char *family);

#endif
