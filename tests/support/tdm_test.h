/* tdm_test.h - helpers shared by the unit tests: cmocka includes, paths to test data and to
 * the default model, and a writer for tiny random-weight Llama GGUF models. */
#ifndef TANDEM_TEST_SUPPORT_H
#define TANDEM_TEST_SUPPORT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#endif
