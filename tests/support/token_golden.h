/* token_golden.h - helpers the tokenizer golden tests share: reading expected token ids from
 * JSON, comparing them, and printing a mismatch readably. */
#ifndef TANDEM_TEST_TOKEN_GOLDEN_H
#define TANDEM_TEST_TOKEN_GOLDEN_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "tandem/tokenizer.h"

/* Writes label then s[0..n) to stderr quoted with C escapes, cut at max bytes. */
void tdm_test_print_escaped(const char *label, const char *s, size_t n, size_t max);

/* Writes label then the n ids to stderr, space-separated in brackets. */
void tdm_test_print_ids(const char *label, const tdm_token_t *ids, size_t n);

/* Reads a JSON array of integers into a heap array of *n ids (caller frees); fails the running
 * cmocka test on a non-integer element or out of memory. */
tdm_token_t *tdm_test_json_ids(const json_t *arr, size_t *n);

/* a[0..na) and b[0..nb) hold the same ids. */
bool tdm_test_ids_equal(const tdm_token_t *a, size_t na, const tdm_token_t *b, size_t nb);

#endif
