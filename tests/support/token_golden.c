/* token_golden.c - helpers the tokenizer golden tests share (token_golden.h). */
#include "tdm_test.h"
#include "token_golden.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Writes s[0..n) to stderr with C escapes, cut at max bytes. */
void tdm_test_print_escaped(const char *label, const char *s, size_t n, size_t max)
{
    fprintf(stderr, "%s\"", label);
    for (size_t i = 0; i < n && i < max; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fputs("\\n", stderr);
        else if (c == '\t')
            fputs("\\t", stderr);
        else if (c == '\r')
            fputs("\\r", stderr);
        else if (c == '"' || c == '\\')
            fprintf(stderr, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            fprintf(stderr, "\\x%02x", c);
        else
            fputc(c, stderr);
    }
    fprintf(stderr, "\"%s\n", n > max ? "..." : "");
}

void tdm_test_print_ids(const char *label, const tdm_token_t *ids, size_t n)
{
    fprintf(stderr, "%s[", label);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, "%s%d", i ? " " : "", (int)ids[i]);
    fprintf(stderr, "]\n");
}

/* Reads a JSON array of integers into a heap array (caller frees). */
tdm_token_t *tdm_test_json_ids(const json_t *arr, size_t *n)
{
    *n = json_array_size(arr);
    tdm_token_t *ids = malloc((*n ? *n : 1) * sizeof *ids);
    assert_non_null(ids);
    for (size_t i = 0; i < *n; i++) {
        const json_t *v = json_array_get(arr, i);
        assert_true(json_is_integer(v));
        ids[i] = (tdm_token_t)json_integer_value(v);
    }
    return ids;
}

bool tdm_test_ids_equal(const tdm_token_t *a, size_t na, const tdm_token_t *b, size_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}
