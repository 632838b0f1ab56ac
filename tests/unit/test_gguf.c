/* test_gguf.c - the GGUF writer and reader together: exact bytes of a small file, every
 * metadata type and several tensor types written and read back (from memory and from a file),
 * alignment, writer errors, the tiny Llama model's metadata and tensors, and robustness:
 * every truncation of a small model and thousands of seeded byte flips. */
#include "tdm_test.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/gguf.h"
#include "tiny_model.h"

/* ---- helpers ---- */

static uint64_t next_u64(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static bool str_eq(tdm_gguf_str_t s, const char *c)
{
    return s.len == strlen(c) && memcmp(s.data, c, s.len) == 0;
}

/* A temporary file name under the build tree (or /tmp), unique to this process. */
static void temp_path(char *buf, size_t cap, const char *tag)
{
    snprintf(buf, cap, "%s/test_gguf_%ld_%s.gguf", TDM_BINARY_DIR, (long)getpid(), tag);
    FILE *f = fopen(buf, "wb");
    if (f) {
        fclose(f);
        return;
    }
    snprintf(buf, cap, "/tmp/test_gguf_%ld_%s.gguf", (long)getpid(), tag);
}

static tdm_gguf_t *open_mem_ok(const void *data, size_t size)
{
    tdm_error_t err;
    tdm_gguf_t *g = tdm_gguf_open_memory(data, size, &err);
    if (!g)
        fail_msg("open_memory: %s", err.msg);
    return g;
}

/* ---- exact bytes ---- */

/* A file written out by hand from the GGUF spec, compared byte for byte. */
static void test_writer_exact_bytes(void **state)
{
    (void)state;
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_u32(w, "a", 7), TDM_OK);
    const float data[2] = {1.0f, 2.0f};
    const uint64_t ne[1] = {2};
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "t", TDM_GGML_TYPE_F32, 1, ne, data), TDM_OK);
    void *buf;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_OK);

    uint8_t want[128] = {
        'G', 'G', 'U', 'F', 3, 0, 0, 0,      /* magic, version 3 */
        1,   0,   0,   0,   0, 0, 0, 0,      /* tensor count */
        1,   0,   0,   0,   0, 0, 0, 0,      /* kv count */
        1,   0,   0,   0,   0, 0, 0, 0, 'a', /* key "a" */
        4,   0,   0,   0,   7, 0, 0, 0,      /* uint32 7 */
        1,   0,   0,   0,   0, 0, 0, 0, 't', /* tensor "t" */
        1,   0,   0,   0,                    /* n_dims 1 */
        2,   0,   0,   0,   0, 0, 0, 0,      /* ne[0] 2 */
        0,   0,   0,   0,                    /* F32 */
        0,   0,   0,   0,   0, 0, 0, 0,      /* offset 0 */
    };                                       /* then zeros to 96 */
    memcpy(want + 96, data, sizeof data);    /* data at 96, padded to 128 with zeros */
    assert_int_equal(size, sizeof want);
    assert_memory_equal(buf, want, sizeof want);

    /* the same through a file */
    char path[512];
    temp_path(path, sizeof path, "exact");
    tdm_error_t err;
    assert_int_equal(tdm_gguf_writer_write_file(w, path, &err), TDM_OK);
    char *fdata;
    size_t flen;
    assert_int_equal(tdm_read_file(path, 1 << 20, &fdata, &flen, &err), TDM_OK);
    assert_int_equal(flen, sizeof want);
    assert_memory_equal(fdata, want, sizeof want);
    free(fdata);
    remove(path);
    free(buf);
    tdm_gguf_writer_destroy(&w);
    assert_null(w);
    tdm_gguf_writer_destroy(&w); /* NULL is fine */
    tdm_gguf_writer_destroy(NULL);
}

/* ---- everything written is read back ---- */

typedef struct tensor_case {
    const char *name;
    tdm_ggml_type_t type;
    uint32_t n_dims;
    uint64_t ne[4];
} tensor_case_t;

static const tensor_case_t tensor_cases[] = {
    {"vec.f32", TDM_GGML_TYPE_F32, 1, {7, 1, 1, 1}},
    {"mat.f16", TDM_GGML_TYPE_F16, 2, {5, 3, 1, 1}},
    {"mat.q8_0", TDM_GGML_TYPE_Q8_0, 2, {64, 3, 1, 1}},
    {"mat.q4_k", TDM_GGML_TYPE_Q4_K, 2, {256, 2, 1, 1}},
    {"cube.bf16", TDM_GGML_TYPE_BF16, 3, {4, 3, 2, 1}},
    {"blk.0.hyper.q6_k", TDM_GGML_TYPE_Q6_K, 4, {256, 1, 2, 1}},
    {"mat.q5_1", TDM_GGML_TYPE_Q5_1, 2, {32, 5, 1, 1}},
};
#define N_TENSOR_CASES (sizeof tensor_cases / sizeof tensor_cases[0])

static size_t case_bytes(const tensor_case_t *c)
{
    return tdm_ggml_row_size(c->type, c->ne[0]) * (size_t)(c->ne[1] * c->ne[2] * c->ne[3]);
}

/* Deterministic bytes for tensor case i. */
static uint8_t *case_data(size_t i)
{
    const size_t n = case_bytes(&tensor_cases[i]);
    uint8_t *d = malloc(n);
    assert_non_null(d);
    uint64_t s = 1000 + i;
    for (size_t j = 0; j < n; j++)
        d[j] = (uint8_t)next_u64(&s);
    return d;
}

static const char *const strs[] = {"", "hello", "Ġworld", "日本語", "<|im_end|>", "a b"};
static const float f32s[] = {0.0f, -1.5f, 3.25e-20f, 1e30f, -0.0f};
static const int32_t i32s[] = {0, -1, 2147483647, -2147483647 - 1, 42};

static tdm_gguf_writer_t *build_all_types(void)
{
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_str(w, "general.architecture", "test"), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_u32(w, "k.u32", 0xdeadbeefu), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_i32(w, "k.i32", -123456), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_u64(w, "k.u64", 0x123456789abcdef0ull), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_f32(w, "k.f32", 0.1f), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_bool(w, "k.true", true), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_bool(w, "k.false", false), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_str(w, "k.str", "first value"), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_str(w, "k.empty", ""), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "k.arr_str", strs, 6), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "k.arr_empty", NULL, 0), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_f32(w, "k.arr_f32", f32s, 5), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_i32(w, "k.arr_i32", i32s, 5), TDM_OK);
    /* set twice: keeps the last value, in the first position */
    assert_int_equal(tdm_gguf_writer_set_str(w, "k.str", "second value"), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_u32(w, "k.retyped", 1), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_f32(w, "k.retyped", 2.5f), TDM_OK);
    for (size_t i = 0; i < N_TENSOR_CASES; i++) {
        const tensor_case_t *c = &tensor_cases[i];
        uint8_t *d = case_data(i);
        assert_int_equal(tdm_gguf_writer_add_tensor(w, c->name, c->type, c->n_dims, c->ne, d),
                         TDM_OK);
        free(d);
    }
    return w;
}

static void check_all_types(const tdm_gguf_t *g, uint32_t alignment)
{
    tdm_error_t err;
    assert_int_equal(tdm_gguf_version(g), 3);
    assert_int_equal(tdm_gguf_alignment(g), alignment);
    assert_int_equal(tdm_gguf_data_offset(g) % alignment, 0);
    static const char *const keys[] = {
        "general.architecture",
        "k.u32",
        "k.i32",
        "k.u64",
        "k.f32",
        "k.true",
        "k.false",
        "k.str",
        "k.empty",
        "k.arr_str",
        "k.arr_empty",
        "k.arr_f32",
        "k.arr_i32",
        "k.retyped",
    };
    const size_t n_keys = sizeof keys / sizeof keys[0];
    const bool aligned_key = alignment != 32;
    assert_int_equal(tdm_gguf_n_kv(g), n_keys + aligned_key);
    for (size_t i = 0; i < n_keys; i++) {
        const tdm_gguf_kv_t *kv = tdm_gguf_kv_at(g, i);
        assert_non_null(kv);
        assert_string_equal(kv->key, keys[i]);
        assert_ptr_equal(tdm_gguf_find_kv(g, keys[i]), kv);
        char buf[256];
        assert_non_null(tdm_gguf_kv_format(kv, buf, sizeof buf));
    }
    assert_null(tdm_gguf_kv_at(g, n_keys + aligned_key));
    assert_null(tdm_gguf_find_kv(g, "k.missing"));

    const tdm_gguf_kv_t *kv = tdm_gguf_find_kv(g, "k.u32");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_UINT32);
    assert_int_equal(kv->value.u64, 0xdeadbeefu);
    kv = tdm_gguf_find_kv(g, "k.i32");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_INT32);
    assert_int_equal(kv->value.i64, -123456);
    kv = tdm_gguf_find_kv(g, "k.u64");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_UINT64);
    assert_true(kv->value.u64 == 0x123456789abcdef0ull);
    kv = tdm_gguf_find_kv(g, "k.f32");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_FLOAT32);
    assert_true((float)kv->value.f64 == 0.1f);
    assert_int_equal(tdm_gguf_find_kv(g, "k.true")->type, TDM_GGUF_VTYPE_BOOL);
    assert_int_equal(tdm_gguf_find_kv(g, "k.true")->value.u64, 1);
    assert_int_equal(tdm_gguf_find_kv(g, "k.false")->value.u64, 0);
    kv = tdm_gguf_find_kv(g, "k.str");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_STRING);
    assert_true(str_eq(kv->value.str, "second value"));
    assert_true(str_eq(tdm_gguf_find_kv(g, "k.empty")->value.str, ""));
    kv = tdm_gguf_find_kv(g, "k.retyped");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_FLOAT32);
    assert_true(kv->value.f64 == 2.5);

    kv = tdm_gguf_find_kv(g, "k.arr_str");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_ARRAY);
    assert_int_equal(kv->arr_type, TDM_GGUF_VTYPE_STRING);
    assert_int_equal(kv->arr_n, 6);
    for (size_t i = 0; i < 6; i++)
        assert_true(str_eq(kv->arr_strs[i], strs[i]));
    kv = tdm_gguf_find_kv(g, "k.arr_empty");
    assert_int_equal(kv->type, TDM_GGUF_VTYPE_ARRAY);
    assert_int_equal(kv->arr_type, TDM_GGUF_VTYPE_STRING);
    assert_int_equal(kv->arr_n, 0);
    kv = tdm_gguf_find_kv(g, "k.arr_f32");
    assert_int_equal(kv->arr_type, TDM_GGUF_VTYPE_FLOAT32);
    assert_int_equal(kv->arr_n, 5);
    for (size_t i = 0; i < 5; i++)
        assert_true((float)tdm_gguf_arr_float(kv, i) == f32s[i]);
    assert_true(signbit(tdm_gguf_arr_float(kv, 4)));
    kv = tdm_gguf_find_kv(g, "k.arr_i32");
    assert_int_equal(kv->arr_type, TDM_GGUF_VTYPE_INT32);
    assert_int_equal(kv->arr_n, 5);
    for (size_t i = 0; i < 5; i++)
        assert_true(tdm_gguf_arr_int(kv, i) == i32s[i]);

    /* typed getters */
    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    float f;
    bool b;
    tdm_gguf_str_t s;
    const tdm_gguf_kv_t *arr;
    assert_int_equal(tdm_gguf_get_u32(g, "k.u32", &u32, &err), TDM_OK);
    assert_int_equal(u32, 0xdeadbeefu);
    assert_int_equal(tdm_gguf_get_u64(g, "k.u64", &u64, &err), TDM_OK);
    assert_true(u64 == 0x123456789abcdef0ull);
    assert_int_equal(tdm_gguf_get_u32(g, "k.u64", &u32, &err), TDM_EINVALID); /* too big */
    assert_int_equal(tdm_gguf_get_i64(g, "k.i32", &i64, &err), TDM_OK);
    assert_int_equal(i64, -123456);
    assert_int_equal(tdm_gguf_get_u64(g, "k.i32", &u64, &err), TDM_EINVALID); /* negative */
    assert_int_equal(tdm_gguf_get_f32(g, "k.f32", &f, &err), TDM_OK);
    assert_true(f == 0.1f);
    assert_int_equal(tdm_gguf_get_f32(g, "k.u32", &f, &err), TDM_OK); /* integers convert */
    assert_int_equal(tdm_gguf_get_bool(g, "k.true", &b, &err), TDM_OK);
    assert_true(b);
    assert_int_equal(tdm_gguf_get_str(g, "k.str", &s, &err), TDM_OK);
    assert_true(str_eq(s, "second value"));
    assert_int_equal(tdm_gguf_get_str(g, "k.u32", &s, &err), TDM_EINVALID);
    assert_int_equal(tdm_gguf_get_str(g, "k.nope", &s, &err), TDM_ENOTFOUND);
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_str", TDM_GGUF_VTYPE_STRING, &arr, &err), TDM_OK);
    assert_int_equal(arr->arr_n, 6);
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_str", TDM_GGUF_VTYPE_INT32, &arr, &err),
                     TDM_EINVALID);
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_i32", TDM_GGUF_VTYPE_COUNT, &arr, &err), TDM_OK);

    /* tensors: order, shapes, offsets, bytes */
    assert_int_equal(tdm_gguf_n_tensors(g), N_TENSOR_CASES);
    uint64_t total = 0;
    for (size_t i = 0; i < N_TENSOR_CASES; i++) {
        const tensor_case_t *c = &tensor_cases[i];
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        assert_non_null(t);
        assert_string_equal(t->name, c->name);
        assert_ptr_equal(tdm_gguf_find_tensor(g, c->name), t);
        assert_int_equal(t->type, c->type);
        assert_int_equal(t->n_dims, c->n_dims);
        for (int d = 0; d < 4; d++)
            assert_int_equal(t->ne[d], c->ne[d]);
        assert_int_equal(t->n_elements, c->ne[0] * c->ne[1] * c->ne[2] * c->ne[3]);
        assert_int_equal(t->n_bytes, case_bytes(c));
        assert_int_equal(t->offset % alignment, 0);
        assert_non_null(t->data);
        assert_int_equal(
            ((const uint8_t *)t->data - (const uint8_t *)tdm_gguf_tensor_at(g, 0)->data) %
                alignment,
            0);
        uint8_t *want = case_data(i);
        assert_memory_equal(t->data, want, t->n_bytes);
        free(want);
        total += t->n_bytes;
    }
    assert_null(tdm_gguf_tensor_at(g, N_TENSOR_CASES));
    assert_null(tdm_gguf_find_tensor(g, "nope"));
    assert_int_equal(tdm_gguf_tensor_bytes(g), total);
}

static void test_write_read_all_types(void **state)
{
    (void)state;
    tdm_gguf_writer_t *w = build_all_types();
    void *buf;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_OK);
    tdm_gguf_t *g = open_mem_ok(buf, size);
    assert_int_equal(tdm_gguf_file_size(g), size);
    check_all_types(g, 32);
    tdm_gguf_destroy(&g);
    assert_null(g);

    /* the file path gives the same bytes and the same view */
    char path[512];
    temp_path(path, sizeof path, "all");
    tdm_error_t err;
    assert_int_equal(tdm_gguf_writer_write_file(w, path, &err), TDM_OK);
    g = tdm_gguf_open(path, &err);
    if (!g)
        fail_msg("open %s: %s", path, err.msg);
    check_all_types(g, 32);
    tdm_gguf_destroy(&g);
    char *fdata;
    size_t flen;
    assert_int_equal(tdm_read_file(path, 1 << 24, &fdata, &flen, &err), TDM_OK);
    assert_int_equal(flen, size);
    assert_memory_equal(fdata, buf, size);
    free(fdata);
    remove(path);

    /* determinism: a second serialisation is identical */
    void *buf2;
    size_t size2;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf2, &size2), TDM_OK);
    assert_int_equal(size2, size);
    assert_memory_equal(buf2, buf, size);
    free(buf2);
    free(buf);
    tdm_gguf_writer_destroy(&w);
}

static void test_alignment(void **state)
{
    (void)state;
    tdm_gguf_writer_t *w = build_all_types();
    assert_int_equal(tdm_gguf_writer_set_u32(w, "general.alignment", 256), TDM_OK);
    void *buf;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_OK);
    tdm_gguf_t *g = open_mem_ok(buf, size);
    check_all_types(g, 256);
    tdm_gguf_destroy(&g);
    free(buf);

    /* not a power of two: refused */
    assert_int_equal(tdm_gguf_writer_set_u32(w, "general.alignment", 48), TDM_OK);
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_EINVALID);
    assert_int_equal(tdm_gguf_writer_set_u32(w, "general.alignment", 0), TDM_OK);
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_EINVALID);
    char path[512];
    temp_path(path, sizeof path, "align");
    tdm_error_t err;
    assert_int_equal(tdm_gguf_writer_write_file(w, path, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "alignment"));
    remove(path);
    /* a general.alignment that is not a uint32 is just metadata to the writer */
    assert_int_equal(tdm_gguf_writer_set_u64(w, "general.alignment", 64), TDM_OK);
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_OK);
    free(buf);
    tdm_gguf_writer_destroy(&w);
}

static void test_writer_errors(void **state)
{
    (void)state;
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    float data[512] = {0};
    uint64_t ne[5] = {32, 2, 1, 1, 1};
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "x", TDM_GGML_TYPE_F32, 2, ne, data), TDM_OK);
    /* duplicate name */
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "x", TDM_GGML_TYPE_F32, 2, ne, data),
                     TDM_EINVALID);
    /* bad dims */
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "y", TDM_GGML_TYPE_F32, 0, ne, data),
                     TDM_EINVALID);
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "y", TDM_GGML_TYPE_F32, 5, ne, data),
                     TDM_EINVALID);
    uint64_t zero[2] = {32, 0};
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "y", TDM_GGML_TYPE_F32, 2, zero, data),
                     TDM_EINVALID);
    /* row not a multiple of the block size; unknown type */
    uint64_t odd[1] = {48};
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "y", TDM_GGML_TYPE_Q4_0, 1, odd, data),
                     TDM_EINVALID);
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "y", (tdm_ggml_type_t)5, 1, ne, data),
                     TDM_EINVALID);
    /* names: empty, too long for ggml (64 bytes with the NUL) */
    char long_name[80];
    memset(long_name, 'n', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    assert_int_equal(tdm_gguf_writer_add_tensor(w, "", TDM_GGML_TYPE_F32, 1, ne, data),
                     TDM_EINVALID);
    assert_int_equal(tdm_gguf_writer_add_tensor(w, long_name, TDM_GGML_TYPE_F32, 1, ne, data),
                     TDM_EINVALID);
    long_name[63] = '\0';
    assert_int_equal(tdm_gguf_writer_add_tensor(w, long_name, TDM_GGML_TYPE_F32, 1, ne, data),
                     TDM_OK);
    /* NULL arguments */
    assert_int_equal(tdm_gguf_writer_set_str(w, "s", NULL), TDM_EINVALID);
    assert_int_equal(tdm_gguf_writer_set_u32(w, NULL, 1), TDM_EINVALID);
    /* an unwritable path */
    tdm_error_t err;
    assert_int_equal(tdm_gguf_writer_write_file(w, "/nonexistent-dir/x.gguf", &err),
                     TDM_EUNAVAILABLE);
    assert_non_null(strstr(err.msg, "/nonexistent-dir/x.gguf"));
    /* the failed calls changed nothing */
    void *buf;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &buf, &size), TDM_OK);
    tdm_gguf_t *g = open_mem_ok(buf, size);
    assert_int_equal(tdm_gguf_n_tensors(g), 2);
    assert_int_equal(tdm_gguf_n_kv(g), 0);
    tdm_gguf_destroy(&g);
    free(buf);
    tdm_gguf_writer_destroy(&w);
}

/* ---- the tiny model ---- */

static void check_tiny_model(const tdm_gguf_t *g, const tdm_tiny_llama_spec_t *spec)
{
    tdm_error_t err;
    tdm_gguf_str_t s;
    uint32_t u;
    float f;
    const uint32_t V = spec->n_vocab;
    assert_int_equal(tdm_gguf_get_str(g, "general.architecture", &s, &err), TDM_OK);
    assert_true(str_eq(s, "llama"));
    assert_int_equal(tdm_gguf_get_str(g, "general.name", &s, &err), TDM_OK);
    assert_int_equal(tdm_gguf_get_str(g, "tokenizer.ggml.model", &s, &err), TDM_OK);
    assert_true(str_eq(s, "gpt2"));
    assert_int_equal(tdm_gguf_get_str(g, "tokenizer.ggml.pre", &s, &err), TDM_OK);
    assert_true(str_eq(s, "smollm"));
    assert_int_equal(tdm_gguf_get_str(g, "tokenizer.chat_template", &s, &err), TDM_OK);
    assert_non_null(memchr(s.data, '{', s.len));
    static const struct {
        const char *key;
        size_t field;
    } u32_keys[] = {
        {"llama.context_length", offsetof(tdm_tiny_llama_spec_t, n_ctx)},
        {"llama.embedding_length", offsetof(tdm_tiny_llama_spec_t, n_embd)},
        {"llama.block_count", offsetof(tdm_tiny_llama_spec_t, n_layers)},
        {"llama.feed_forward_length", offsetof(tdm_tiny_llama_spec_t, n_ff)},
        {"llama.attention.head_count", offsetof(tdm_tiny_llama_spec_t, n_heads)},
        {"llama.attention.head_count_kv", offsetof(tdm_tiny_llama_spec_t, n_kv_heads)},
    };
    for (size_t i = 0; i < sizeof u32_keys / sizeof u32_keys[0]; i++) {
        uint32_t want;
        memcpy(&want, (const char *)spec + u32_keys[i].field, sizeof want);
        assert_int_equal(tdm_gguf_find_kv(g, u32_keys[i].key)->type, TDM_GGUF_VTYPE_UINT32);
        assert_int_equal(tdm_gguf_get_u32(g, u32_keys[i].key, &u, &err), TDM_OK);
        assert_int_equal(u, want);
    }
    assert_int_equal(tdm_gguf_get_u32(g, "llama.rope.dimension_count", &u, &err), TDM_OK);
    assert_int_equal(u, spec->n_embd / spec->n_heads);
    assert_int_equal(tdm_gguf_find_kv(g, "llama.rope.freq_base")->type, TDM_GGUF_VTYPE_FLOAT32);
    assert_int_equal(tdm_gguf_get_f32(g, "llama.rope.freq_base", &f, &err), TDM_OK);
    assert_true(f == 10000.0f);
    assert_int_equal(tdm_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f, &err),
                     TDM_OK);
    assert_true(f == 1e-5f);
    assert_int_equal(tdm_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &u, &err), TDM_OK);
    assert_int_equal(u, V - 2);
    assert_int_equal(tdm_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &u, &err), TDM_OK);
    assert_int_equal(u, V - 1);

    /* vocabulary: bytes in GPT-2 order, merges consistent with the merged tokens, specials */
    const tdm_gguf_kv_t *tokens, *types, *merges;
    assert_int_equal(
        tdm_gguf_get_arr(g, "tokenizer.ggml.tokens", TDM_GGUF_VTYPE_STRING, &tokens, &err), TDM_OK);
    assert_int_equal(
        tdm_gguf_get_arr(g, "tokenizer.ggml.token_type", TDM_GGUF_VTYPE_INT32, &types, &err),
        TDM_OK);
    assert_int_equal(
        tdm_gguf_get_arr(g, "tokenizer.ggml.merges", TDM_GGUF_VTYPE_STRING, &merges, &err), TDM_OK);
    assert_int_equal(tokens->arr_n, V);
    assert_int_equal(types->arr_n, V);
    assert_int_equal(merges->arr_n, V - TDM_TINY_MIN_VOCAB);
    assert_true(str_eq(tokens->arr_strs[0], "!"));
    assert_true(str_eq(tokens->arr_strs[220], "Ġ"));
    assert_true(str_eq(tokens->arr_strs[198], "Ċ"));
    assert_true(str_eq(tokens->arr_strs[188], "Ā"));
    assert_true(str_eq(tokens->arr_strs[255], "Ń")); /* byte 0xad */
    assert_int_equal(tdm_test_tiny_byte_token(' '), 220);
    assert_int_equal(tdm_test_tiny_byte_token('a'), 'a' - 33);
    for (unsigned b = 0; b < 256; b++) {
        char c[3];
        tdm_test_gpt2_byte_char((uint8_t)b, c);
        assert_true(str_eq(tokens->arr_strs[tdm_test_tiny_byte_token((uint8_t)b)], c));
        for (unsigned b2 = 0; b2 < b; b2++) /* a bijection */
            assert_int_not_equal(tdm_test_tiny_byte_token((uint8_t)b),
                                 tdm_test_tiny_byte_token((uint8_t)b2));
    }
    assert_true(str_eq(tokens->arr_strs[V - 3], "<|endoftext|>"));
    assert_true(str_eq(tokens->arr_strs[V - 2], "<|im_start|>"));
    assert_true(str_eq(tokens->arr_strs[V - 1], "<|im_end|>"));
    for (uint32_t i = 0; i < V; i++)
        assert_int_equal(tdm_gguf_arr_int(types, i), i >= V - 3 ? 3 : 1);
    if (merges->arr_n > 0)
        assert_true(str_eq(merges->arr_strs[0], "Ġ t"));
    for (uint64_t m = 0; m < merges->arr_n; m++) {
        const tdm_gguf_str_t ms = merges->arr_strs[m];
        const char *sp = memchr(ms.data, ' ', ms.len);
        assert_non_null(sp);
        const size_t la = (size_t)(sp - ms.data), lb = ms.len - la - 1;
        /* merge m makes token 256 + m, the concatenation of its two parts */
        const tdm_gguf_str_t made = tokens->arr_strs[256 + m];
        assert_int_equal(made.len, la + lb);
        assert_memory_equal(made.data, ms.data, la);
        assert_memory_equal(made.data + la, sp + 1, lb);
        /* both parts are earlier tokens */
        bool found_a = false, found_b = false;
        for (uint64_t t = 0; t < 256 + m; t++) {
            const tdm_gguf_str_t ts = tokens->arr_strs[t];
            found_a |= ts.len == la && memcmp(ts.data, ms.data, la) == 0;
            found_b |= ts.len == lb && memcmp(ts.data, sp + 1, lb) == 0;
        }
        if (!found_a || !found_b)
            fail_msg("merge %" PRIu64 " '%.*s' uses a later or missing token", m, (int)ms.len,
                     ms.data);
        for (uint64_t t = 0; t < 256 + m; t++) /* merged tokens are new */
            assert_false(tokens->arr_strs[t].len == made.len &&
                         memcmp(tokens->arr_strs[t].data, made.data, made.len) == 0);
    }

    /* tensors and hyperparameters */
    tdm_llama_hparams_t hp;
    if (tdm_gguf_llama_hparams(g, &hp, &err) != TDM_OK)
        fail_msg("hparams: %s", err.msg);
    assert_string_equal(hp.arch, "llama");
    assert_int_equal(hp.n_vocab, V);
    assert_int_equal(hp.n_embd, spec->n_embd);
    assert_int_equal(hp.n_layers, spec->n_layers);
    assert_int_equal(hp.n_heads, spec->n_heads);
    assert_int_equal(hp.n_kv_heads, spec->n_kv_heads);
    assert_int_equal(hp.head_dim, spec->n_embd / spec->n_heads);
    assert_int_equal(hp.n_ff, spec->n_ff);
    assert_int_equal(hp.n_ctx_train, spec->n_ctx);
    assert_int_equal(hp.tied_embeddings, spec->tied_embeddings);
    assert_false(hp.has_qkv_bias);
    const tdm_gguf_tensor_t *emb = tdm_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(emb);
    assert_int_equal(emb->type, spec->embd_type);
    assert_int_equal(emb->ne[0], spec->n_embd);
    assert_int_equal(emb->ne[1], V);
    const tdm_gguf_tensor_t *q = tdm_gguf_find_tensor(g, "blk.0.attn_q.weight");
    assert_int_equal(q->type, spec->weight_type);
    const tdm_gguf_tensor_t *k = tdm_gguf_find_tensor(g, "blk.0.attn_k.weight");
    assert_int_equal(k->ne[1], spec->n_kv_heads * (spec->n_embd / spec->n_heads));
    const tdm_gguf_tensor_t *down = tdm_gguf_find_tensor(g, "blk.0.ffn_down.weight");
    assert_int_equal(down->ne[0], spec->n_ff);
    assert_int_equal(down->ne[1], spec->n_embd);
    assert_int_equal(tdm_gguf_find_tensor(g, "blk.0.attn_norm.weight")->type, TDM_GGML_TYPE_F32);
    assert_int_equal(tdm_gguf_n_tensors(g), 2 + 9 * spec->n_layers + !spec->tied_embeddings);
    /* weights are small and centred; norms near 1 */
    float *row = malloc(spec->n_ff * sizeof *row);
    assert_non_null(row);
    double sum = 0, sum2 = 0;
    const size_t row_bytes = tdm_ggml_row_size(q->type, q->ne[0]);
    for (uint64_t r = 0; r < q->ne[1]; r++) {
        assert_int_equal(tdm_ggml_dequantize_row(q->type, (const uint8_t *)q->data + r * row_bytes,
                                                 row, (int64_t)q->ne[0]),
                         TDM_OK);
        for (uint64_t j = 0; j < q->ne[0]; j++) {
            assert_true(isfinite(row[j]));
            sum += row[j];
            sum2 += (double)row[j] * row[j];
        }
    }
    const double n = (double)q->n_elements, mean = sum / n, sd = sqrt(sum2 / n - mean * mean);
    assert_true(fabs(mean) < 0.005);
    assert_true(sd > 0.015 && sd < 0.025);
    const tdm_gguf_tensor_t *norm = tdm_gguf_find_tensor(g, "output_norm.weight");
    const float *nw = norm->data;
    for (uint64_t j = 0; j < norm->ne[0]; j++)
        assert_true(fabsf(nw[j] - 1.0f) < 0.2f);
    free(row);
}

static void test_tiny_model(void **state)
{
    (void)state;
    static const tdm_tiny_llama_spec_t specs[] = {
        {.n_vocab = 300,
         .n_embd = 64,
         .n_layers = 2,
         .n_heads = 4,
         .n_kv_heads = 2,
         .n_ff = 96,
         .n_ctx = 128,
         .seed = 1},
        {.n_vocab = 259,
         .n_embd = 32,
         .n_layers = 1,
         .n_heads = 2,
         .n_kv_heads = 1,
         .n_ff = 64,
         .n_ctx = 64,
         .weight_type = TDM_GGML_TYPE_Q8_0,
         .embd_type = TDM_GGML_TYPE_Q4_0,
         .tied_embeddings = true,
         .seed = 2},
        {.n_vocab = 1000,
         .n_embd = 256,
         .n_layers = 1,
         .n_heads = 4,
         .n_kv_heads = 4,
         .n_ff = 512,
         .n_ctx = 256,
         .weight_type = TDM_GGML_TYPE_Q4_K,
         .embd_type = TDM_GGML_TYPE_Q6_K,
         .seed = 3},
        {.n_vocab = 400,
         .n_embd = 256,
         .n_layers = 1,
         .n_heads = 8,
         .n_kv_heads = 2,
         .n_ff = 256,
         .n_ctx = 32,
         .weight_type = TDM_GGML_TYPE_Q5_K,
         .embd_type = TDM_GGML_TYPE_F16,
         .seed = 4},
        {.n_vocab = 320,
         .n_embd = 64,
         .n_layers = 1,
         .n_heads = 2,
         .n_kv_heads = 2,
         .n_ff = 64,
         .n_ctx = 32,
         .weight_type = TDM_GGML_TYPE_Q5_0,
         .embd_type = TDM_GGML_TYPE_BF16,
         .seed = 5},
        {.n_vocab = 320,
         .n_embd = 64,
         .n_layers = 1,
         .n_heads = 2,
         .n_kv_heads = 2,
         .n_ff = 64,
         .n_ctx = 32,
         .weight_type = TDM_GGML_TYPE_Q4_1,
         .embd_type = TDM_GGML_TYPE_Q5_1,
         .seed = 6},
    };
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        void *buf;
        size_t size;
        assert_int_equal(tdm_test_tiny_llama_to_memory(&specs[i], &buf, &size), TDM_OK);
        tdm_gguf_t *g = open_mem_ok(buf, size);
        check_tiny_model(g, &specs[i]);
        tdm_gguf_destroy(&g);
        free(buf);
    }

    /* from a file; the same spec gives the same bytes; another seed other weights */
    char path[512];
    temp_path(path, sizeof path, "tiny");
    tdm_error_t err;
    assert_int_equal(tdm_test_write_tiny_llama(path, &specs[0], &err), TDM_OK);
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    if (!g)
        fail_msg("open %s: %s", path, err.msg);
    check_tiny_model(g, &specs[0]);
    tdm_gguf_destroy(&g);
    char *fdata;
    size_t flen;
    assert_int_equal(tdm_read_file(path, 1 << 26, &fdata, &flen, &err), TDM_OK);
    remove(path);
    void *buf;
    size_t size;
    assert_int_equal(tdm_test_tiny_llama_to_memory(&specs[0], &buf, &size), TDM_OK);
    assert_int_equal(size, flen);
    assert_memory_equal(buf, fdata, size);
    tdm_tiny_llama_spec_t other = specs[0];
    other.seed = 99;
    void *buf2;
    size_t size2;
    assert_int_equal(tdm_test_tiny_llama_to_memory(&other, &buf2, &size2), TDM_OK);
    assert_int_equal(size2, size);
    assert_memory_not_equal(buf2, buf, size);
    free(buf2);
    free(buf);
    free(fdata);

    /* defaults: a NULL spec works */
    assert_int_equal(tdm_test_tiny_llama_to_memory(NULL, &buf, &size), TDM_OK);
    g = open_mem_ok(buf, size);
    tdm_llama_hparams_t hp;
    assert_int_equal(tdm_gguf_llama_hparams(g, &hp, &err), TDM_OK);
    assert_int_equal(hp.n_vocab, 512);
    assert_int_equal(hp.n_embd, 64);
    tdm_gguf_destroy(&g);
    free(buf);

    /* bad specs */
    tdm_tiny_llama_spec_t bad = {.n_vocab = 100};
    assert_int_equal(tdm_test_tiny_llama_to_memory(&bad, &buf, &size), TDM_EINVALID);
    bad = (tdm_tiny_llama_spec_t){.n_embd = 64, .n_heads = 3};
    assert_int_equal(tdm_test_tiny_llama_build(&bad, &(tdm_gguf_writer_t *){NULL}, &err),
                     TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_heads"));
    bad = (tdm_tiny_llama_spec_t){.n_embd = 64, .weight_type = TDM_GGML_TYPE_Q4_K};
    assert_int_equal(tdm_test_tiny_llama_to_memory(&bad, &buf, &size), TDM_EINVALID);
    bad = (tdm_tiny_llama_spec_t){.weight_type = TDM_GGML_TYPE_Q8_K};
    assert_int_equal(tdm_test_tiny_llama_to_memory(&bad, &buf, &size), TDM_EINVALID);
    bad = (tdm_tiny_llama_spec_t){.n_vocab = 1000000};
    assert_int_equal(tdm_test_tiny_llama_to_memory(&bad, &buf, &size), TDM_EINVALID);
}

/* ---- robustness ---- */

/* The small model the corruption tests damage: a few KB, every section present. */
static void small_model(void **data, size_t *size)
{
    const tdm_tiny_llama_spec_t spec = {
        .n_vocab = 280,
        .n_embd = 32,
        .n_layers = 1,
        .n_heads = 2,
        .n_kv_heads = 1,
        .n_ff = 64,
        .n_ctx = 64,
        .weight_type = TDM_GGML_TYPE_Q8_0,
        .embd_type = TDM_GGML_TYPE_Q4_0,
        .tied_embeddings = true,
        .seed = 11,
    };
    assert_int_equal(tdm_test_tiny_llama_to_memory(&spec, data, size), TDM_OK);
}

/* Uses everything an opened file offers, so that ASan sees any pointer that leaves the buffer:
 * formats every value, reads every array element and string, reads every tensor byte and
 * dequantizes every row of supported types, validates hyperparameters. */
static void walk(const tdm_gguf_t *g, float *scratch, size_t scratch_n)
{
    char buf[512];
    volatile uint64_t sink = 0;
    for (uint64_t i = 0; i < tdm_gguf_n_kv(g); i++) {
        const tdm_gguf_kv_t *kv = tdm_gguf_kv_at(g, i);
        assert_non_null(kv);
        assert_non_null(kv->key);
        assert_ptr_equal(tdm_gguf_find_kv(g, kv->key), kv);
        tdm_gguf_kv_format(kv, buf, sizeof buf);
        assert_non_null(memchr(buf, '\0', sizeof buf));
        if (kv->type == TDM_GGUF_VTYPE_STRING)
            for (uint64_t j = 0; j < kv->value.str.len; j++)
                sink += (uint8_t)kv->value.str.data[j];
        if (kv->type != TDM_GGUF_VTYPE_ARRAY)
            continue;
        for (uint64_t j = 0; j < kv->arr_n; j++) {
            if (kv->arr_type == TDM_GGUF_VTYPE_STRING) {
                const tdm_gguf_str_t s = kv->arr_strs[j];
                for (uint64_t c = 0; c < s.len; c++)
                    sink += (uint8_t)s.data[c];
            } else {
                sink += (uint64_t)tdm_gguf_arr_int(kv, j);
                sink += (uint64_t)(tdm_gguf_arr_float(kv, j) != 0.0);
            }
        }
    }
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        assert_non_null(t);
        assert_ptr_equal(tdm_gguf_find_tensor(g, t->name), t);
        const uint8_t *d = t->data;
        for (size_t j = 0; d && j < t->n_bytes; j++)
            sink += d[j];
        const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(t->type);
        assert_non_null(ti);
        if (!d || !ti->supported || t->ne[0] > scratch_n)
            continue;
        const size_t row_bytes = tdm_ggml_row_size(t->type, t->ne[0]);
        const uint64_t rows = t->n_elements / t->ne[0];
        assert_int_equal(row_bytes * rows, t->n_bytes);
        for (uint64_t r = 0; r < rows; r++)
            assert_int_equal(
                tdm_ggml_dequantize_row(t->type, d + r * row_bytes, scratch, (int64_t)t->ne[0]),
                TDM_OK);
    }
    tdm_llama_hparams_t hp;
    tdm_error_t err;
    (void)tdm_gguf_llama_hparams(g, &hp, &err);
    (void)sink;
}

/* Every proper prefix of a valid file is rejected with a message, never read past its end
 * (each prefix is copied to a heap block of exactly its size, so ASan catches overreads). */
static void test_truncation(void **state)
{
    (void)state;
    void *data;
    size_t size;
    small_model(&data, &size);
    float scratch[4096];
    {
        /* the whole file opens, and it ends exactly where its last tensor does, so every
         * shorter length must be an error */
        tdm_gguf_t *g = open_mem_ok(data, size);
        walk(g, scratch, 4096);
        uint64_t end = 0;
        for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
            const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
            if (t->offset + t->n_bytes > end)
                end = t->offset + t->n_bytes;
        }
        assert_int_equal(tdm_gguf_data_offset(g) + end, size);
        tdm_gguf_destroy(&g);
    }
    print_message("truncating a %zu-byte model at every length\n", size);
    for (size_t len = 0; len < size; len++) {
        uint8_t *copy = malloc(len ? len : 1);
        assert_non_null(copy);
        memcpy(copy, data, len);
        tdm_error_t err = {0};
        tdm_gguf_t *g = tdm_gguf_open_memory(copy, len, &err);
        if (g)
            fail_msg("a %zu-byte prefix of a %zu-byte file opened", len, size);
        assert_int_equal(err.code, TDM_EINVALID);
        if (err.msg[0] == '\0')
            fail_msg("no message for a %zu-byte prefix", len);
        free(copy);
    }
    free(data);
}

/* Seeded random damage: single and multi-byte flips, mostly in the header and metadata (where
 * the parser's decisions are) and some in the tensor data. Each damaged file either opens, and
 * then everything in it can be used safely, or is rejected with TDM_EINVALID. */
static void test_byte_flips(void **state)
{
    (void)state;
    void *data;
    size_t size;
    small_model(&data, &size);
    tdm_gguf_t *g0 = open_mem_ok(data, size);
    const size_t meta_end = (size_t)tdm_gguf_data_offset(g0);
    tdm_gguf_destroy(&g0);

    float *scratch = malloc(4096 * sizeof *scratch);
    assert_non_null(scratch);
    uint64_t s = 20240601;
    int opened = 0, rejected = 0;
    enum { N_TRIALS = 4000 };
    for (int trial = 0; trial < N_TRIALS; trial++) {
        uint8_t *copy = malloc(size);
        assert_non_null(copy);
        memcpy(copy, data, size);
        const int n_flips = 1 + (int)(next_u64(&s) % 4);
        for (int k = 0; k < n_flips; k++) {
            const uint64_t r = next_u64(&s);
            size_t pos;
            if (r % 10 < 3) /* the first 64 bytes: header, first keys */
                pos = (size_t)(r >> 8) % 64;
            else if (r % 10 < 9) /* anywhere in the metadata and tensor table */
                pos = (size_t)(r >> 8) % meta_end;
            else
                pos = (size_t)(r >> 8) % size;
            const uint64_t kind = (r >> 4) % 4;
            if (kind == 0)
                copy[pos] ^= (uint8_t)(1u << ((r >> 40) % 8)); /* one bit */
            else if (kind == 1)
                copy[pos] = (uint8_t)(r >> 48); /* any byte */
            else if (kind == 2)
                copy[pos] = 0xff; /* huge lengths and counts */
            else
                copy[pos] = (uint8_t)(copy[pos] + 1);
        }
        tdm_error_t err = {0};
        tdm_gguf_t *g = tdm_gguf_open_memory(copy, size, &err);
        if (g) {
            walk(g, scratch, 4096);
            tdm_gguf_destroy(&g);
            opened++;
        } else {
            if (err.code != TDM_EINVALID)
                fail_msg("trial %d: rejected with %s (%s), expected INVALID_ARGUMENT", trial,
                         tdm_status_name(err.code), err.msg);
            rejected++;
        }
        free(copy);
    }
    print_message("%d damaged files: %d opened and walked, %d rejected\n", N_TRIALS, opened,
                  rejected);
    assert_true(rejected > N_TRIALS / 10); /* the damage mattered */
    free(scratch);
    free(data);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_writer_exact_bytes), cmocka_unit_test(test_write_read_all_types),
        cmocka_unit_test(test_alignment),          cmocka_unit_test(test_writer_errors),
        cmocka_unit_test(test_tiny_model),         cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_byte_flips),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
