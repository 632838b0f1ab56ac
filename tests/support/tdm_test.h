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

/* Why this CPU cannot run kernel family `family` (TANDEM_CPU_KERNELS: scalar, avx2, vnni,
 * avx512, amx): a sentence naming the missing instructions, or NULL when it can. An unknown
 * name is reported as such. */
const char *tdm_test_cpu_family_missing(const char *family);

#endif
