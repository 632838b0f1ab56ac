/* reader.c - GGUF v2/v3 reader over mmap with bounds and overflow checks on every field.
 *
 * Layout (GGUF spec, ggml/docs/gguf.md): magic "GGUF", u32 version, u64 tensor_count,
 * u64 metadata_kv_count, the key/value pairs, the tensor infos (name, u32 n_dims,
 * u64 ne[n_dims], u32 type, u64 offset), padding to general.alignment, the tensor data.
 * Strings are u64 length + bytes (no NUL). Version 1 (u32 lengths) is not supported.
 * The parser never trusts a count: every allocation is bounded by the bytes left in the file.
 */
#define _DEFAULT_SOURCE /* madvise (MADV_DONTNEED): posix_madvise ignores POSIX_MADV_DONTNEED on   \
                           glibc */
#include "tandem/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NAME 256 /* ggml allows 64; be lenient but bounded */

struct tdm_gguf {
    const uint8_t *base; /* whole file */
    size_t size;         /* bytes */
    bool mapped;         /* base came from mmap and must be unmapped */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    uint64_t n_kv;
    tdm_gguf_kv_t *kvs; /* [n_kv] */
    uint64_t n_tensors;
    tdm_gguf_tensor_t *tensors; /* [n_tensors] */
    uint64_t tensor_bytes;
};

/* A read cursor over the file; every read checks the bytes left. */
typedef struct cursor {
    const uint8_t *p;
    size_t size;
    size_t pos;
    tdm_error_t *err;
} cursor_t;

static size_t cur_left(const cursor_t *c)
{
    return c->size - c->pos;
}

static int cur_bytes(cursor_t *c, size_t n, const char *what, const uint8_t **out)
{
    if (n > cur_left(c))
        return tdm_error_set(c->err, TDM_EINVALID,
                             "truncated file: %s needs %zu bytes at offset %zu, %zu left", what, n,
                             c->pos, cur_left(c));
    *out = c->p + c->pos;
    c->pos += n;
    return TDM_OK;
}

static int cur_u32(cursor_t *c, const char *what, uint32_t *v)
{
    const uint8_t *b = NULL;
    int rc = cur_bytes(c, 4, what, &b);
    if (rc == TDM_OK)
        memcpy(v, b, 4);
    return rc;
}

static int cur_u64(cursor_t *c, const char *what, uint64_t *v)
{
    const uint8_t *b = NULL;
    int rc = cur_bytes(c, 8, what, &b);
    if (rc == TDM_OK)
        memcpy(v, b, 8);
    return rc;
}

static int cur_str(cursor_t *c, const char *what, tdm_gguf_str_t *s)
{
    uint64_t len = 0;
    int rc = cur_u64(c, what, &len);
    if (rc != TDM_OK)
        return rc;
    if (len > cur_left(c))
        return tdm_error_set(c->err, TDM_EINVALID,
                             "%s at offset %zu: string length %" PRIu64
                             " exceeds the %zu bytes left in the file",
                             what, c->pos - 8, len, cur_left(c));
    const uint8_t *b = NULL;
    cur_bytes(c, (size_t)len, what, &b);
    s->data = (const char *)b;
    s->len = len;
    return TDM_OK;
}

/* NUL-terminated heap copy of a file string; rejects embedded NULs and over-long names. */
static int str_copy(cursor_t *c, const tdm_gguf_str_t *s, size_t max_len, const char *what,
                    char **out)
{
    if (s->len == 0 || s->len > max_len)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "%s at offset %zu: length %" PRIu64 " is outside 1..%zu", what, c->pos,
                             s->len, max_len);
    if (memchr(s->data, '\0', (size_t)s->len))
        return tdm_error_set(c->err, TDM_EINVALID, "%s at offset %zu contains a NUL byte", what,
                             c->pos);
    char *d = malloc((size_t)s->len + 1);
    if (!d)
        return tdm_error_set(c->err, TDM_ERESOURCE, "out of memory copying %s", what);
    memcpy(d, s->data, (size_t)s->len);
    d[s->len] = '\0';
    *out = d;
    return TDM_OK;
}

/* Size in bytes of a scalar value type; 0 for STRING/ARRAY/unknown. */
static size_t vtype_size(tdm_gguf_vtype_t t)
{
    switch (t) {
    case TDM_GGUF_VTYPE_UINT8:
    case TDM_GGUF_VTYPE_INT8:
    case TDM_GGUF_VTYPE_BOOL: return 1;
    case TDM_GGUF_VTYPE_UINT16:
    case TDM_GGUF_VTYPE_INT16: return 2;
    case TDM_GGUF_VTYPE_UINT32:
    case TDM_GGUF_VTYPE_INT32:
    case TDM_GGUF_VTYPE_FLOAT32: return 4;
    case TDM_GGUF_VTYPE_UINT64:
    case TDM_GGUF_VTYPE_INT64:
    case TDM_GGUF_VTYPE_FLOAT64: return 8;
    default: return 0;
    }
}

const char *tdm_gguf_vtype_name(tdm_gguf_vtype_t t)
{
    static const char *const names[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                        "int32",  "float32", "bool",   "string", "array",
                                        "uint64", "int64",   "float64"};
    return (unsigned)t < TDM_GGUF_VTYPE_COUNT ? names[t] : "?";
}

/* Decodes a little-endian scalar of type t at b into kv->value. */
static void scalar_decode(tdm_gguf_vtype_t t, const uint8_t *b, tdm_gguf_kv_t *kv)
{
    switch (t) {
    case TDM_GGUF_VTYPE_UINT8: kv->value.u64 = b[0]; break;
    case TDM_GGUF_VTYPE_BOOL: kv->value.u64 = b[0] != 0; break;
    case TDM_GGUF_VTYPE_INT8: kv->value.i64 = (int8_t)b[0]; break;
    case TDM_GGUF_VTYPE_UINT16: {
        uint16_t v;
        memcpy(&v, b, 2);
        kv->value.u64 = v;
        break;
    }
    case TDM_GGUF_VTYPE_INT16: {
        int16_t v;
        memcpy(&v, b, 2);
        kv->value.i64 = v;
        break;
    }
    case TDM_GGUF_VTYPE_UINT32: {
        uint32_t v;
        memcpy(&v, b, 4);
        kv->value.u64 = v;
        break;
    }
    case TDM_GGUF_VTYPE_INT32: {
        int32_t v;
        memcpy(&v, b, 4);
        kv->value.i64 = v;
        break;
    }
    case TDM_GGUF_VTYPE_FLOAT32: {
        float v;
        memcpy(&v, b, 4);
        kv->value.f64 = v;
        break;
    }
    case TDM_GGUF_VTYPE_UINT64: memcpy(&kv->value.u64, b, 8); break;
    case TDM_GGUF_VTYPE_INT64: memcpy(&kv->value.i64, b, 8); break;
    case TDM_GGUF_VTYPE_FLOAT64: memcpy(&kv->value.f64, b, 8); break;
    default: break;
    }
}

/* A scalar value of kv->type (not a string or an array). */
static int parse_kv_scalar(cursor_t *c, tdm_gguf_kv_t *kv)
{
    const uint8_t *b = NULL;
    int rc = cur_bytes(c, vtype_size(kv->type), kv->key, &b);
    if (rc != TDM_OK)
        return rc;
    if (kv->type == TDM_GGUF_VTYPE_BOOL && b[0] > 1)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "metadata '%s' at offset %zu: bool value %u is not 0 or 1", kv->key,
                             c->pos - 1, b[0]);
    scalar_decode(kv->type, b, kv);
    return TDM_OK;
}

/* The kv->arr_n numeric elements of an array: kept in place (kv->arr_data), not copied. */
static int parse_kv_num_array(cursor_t *c, tdm_gguf_kv_t *kv)
{
    size_t esz = vtype_size(kv->arr_type), bytes;
    if (kv->arr_n > SIZE_MAX || !tdm_mul_size((size_t)kv->arr_n, esz, &bytes) ||
        bytes > cur_left(c))
        return tdm_error_set(c->err, TDM_EINVALID,
                             "metadata '%s': array of %" PRIu64
                             " %s values does not fit in the %zu bytes left",
                             kv->key, kv->arr_n, tdm_gguf_vtype_name(kv->arr_type), cur_left(c));
    const uint8_t *b = NULL;
    cur_bytes(c, bytes, kv->key, &b);
    kv->arr_data = b;
    if (kv->arr_type == TDM_GGUF_VTYPE_BOOL)
        for (size_t i = 0; i < bytes; i++)
            if (b[i] > 1)
                return tdm_error_set(c->err, TDM_EINVALID,
                                     "metadata '%s': bool element %zu is %u, not 0 or 1", kv->key,
                                     i, b[i]);
    return TDM_OK;
}

/* The kv->arr_n strings of an array, indexed in kv->arr_strs (which points into the file). */
static int parse_kv_str_array(cursor_t *c, tdm_gguf_kv_t *kv)
{
    /* each string needs at least its 8-byte length, which bounds the allocation */
    if (kv->arr_n > cur_left(c) / 8)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "metadata '%s': array of %" PRIu64
                             " strings does not fit in the %zu bytes left",
                             kv->key, kv->arr_n, cur_left(c));
    kv->arr_data = c->p + c->pos;
    kv->arr_strs = calloc(kv->arr_n ? (size_t)kv->arr_n : 1, sizeof *kv->arr_strs);
    if (!kv->arr_strs)
        return tdm_error_set(c->err, TDM_ERESOURCE, "out of memory indexing '%s'", kv->key);
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        int rc = cur_str(c, kv->key, &kv->arr_strs[i]);
        if (rc != TDM_OK)
            return tdm_error_prefix(c->err, rc, "element %" PRIu64 " of %" PRIu64, i, kv->arr_n);
    }
    return TDM_OK;
}

/* An array value: u32 element type, u64 count, elements. */
static int parse_kv_array(cursor_t *c, tdm_gguf_kv_t *kv)
{
    uint32_t etype = 0;
    int rc;
    if ((rc = cur_u32(c, kv->key, &etype)) != TDM_OK ||
        (rc = cur_u64(c, kv->key, &kv->arr_n)) != TDM_OK)
        return rc;
    if (etype >= TDM_GGUF_VTYPE_COUNT || etype == TDM_GGUF_VTYPE_ARRAY)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "metadata '%s': array element type %" PRIu32
                             " is unknown or a nested array",
                             kv->key, etype);
    kv->arr_type = (tdm_gguf_vtype_t)etype;
    if (kv->arr_type == TDM_GGUF_VTYPE_STRING)
        return parse_kv_str_array(c, kv);
    return parse_kv_num_array(c, kv);
}

static int parse_kv(cursor_t *c, uint64_t index, tdm_gguf_kv_t *kv)
{
    char what[64];
    snprintf(what, sizeof what, "metadata key #%" PRIu64, index);
    tdm_gguf_str_t key = {0};
    int rc = cur_str(c, what, &key);
    if (rc == TDM_OK)
        rc = str_copy(c, &key, 65535, what, &kv->key);
    if (rc != TDM_OK)
        return rc;
    uint32_t type = 0;
    if ((rc = cur_u32(c, kv->key, &type)) != TDM_OK)
        return rc;
    if (type >= TDM_GGUF_VTYPE_COUNT)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "metadata '%s' at offset %zu: unknown value type %" PRIu32, kv->key,
                             c->pos - 4, type);
    kv->type = (tdm_gguf_vtype_t)type;
    if (kv->type == TDM_GGUF_VTYPE_STRING)
        return cur_str(c, kv->key, &kv->value.str);
    if (kv->type == TDM_GGUF_VTYPE_ARRAY)
        return parse_kv_array(c, kv);
    return parse_kv_scalar(c, kv);
}

static int parse_tensor_info(cursor_t *c, uint64_t index, tdm_gguf_tensor_t *t)
{
    char what[64];
    snprintf(what, sizeof what, "tensor #%" PRIu64 " name", index);
    tdm_gguf_str_t name = {0};
    int rc = cur_str(c, what, &name);
    if (rc == TDM_OK)
        rc = str_copy(c, &name, GGUF_MAX_NAME, what, &t->name);
    if (rc != TDM_OK)
        return rc;
    if ((rc = cur_u32(c, t->name, &t->n_dims)) != TDM_OK)
        return rc;
    if (t->n_dims < 1 || t->n_dims > TDM_GGUF_MAX_DIMS)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "tensor '%s': n_dims %" PRIu32 " is outside 1..%d", t->name, t->n_dims,
                             TDM_GGUF_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t d = 0; d < TDM_GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d < t->n_dims && (rc = cur_u64(c, t->name, &t->ne[d])) != TDM_OK)
            return rc;
        if (t->ne[d] == 0 || t->ne[d] > INT64_MAX || !tdm_mul_u64(n, t->ne[d], &n) || n > INT64_MAX)
            return tdm_error_set(c->err, TDM_EINVALID,
                                 "tensor '%s': dimension %" PRIu32 " = %" PRIu64
                                 " is zero or makes the element count overflow",
                                 t->name, d, t->ne[d]);
    }
    t->n_elements = n;
    uint32_t type = 0;
    if ((rc = cur_u32(c, t->name, &type)) != TDM_OK)
        return rc;
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(type);
    if (!ti)
        return tdm_error_set(c->err, TDM_EINVALID, "tensor '%s': unknown tensor type %" PRIu32,
                             t->name, type);
    t->type = (tdm_ggml_type_t)type;
    if (t->ne[0] % ti->block_size != 0)
        return tdm_error_set(c->err, TDM_EINVALID,
                             "tensor '%s': row length ne[0] = %" PRIu64
                             " is not a multiple of %s's block size %" PRIu32,
                             t->name, t->ne[0], ti->name, ti->block_size);
    uint64_t bytes;
    if (!tdm_mul_u64(n / ti->block_size, ti->type_size, &bytes) || bytes > SIZE_MAX)
        return tdm_error_set(c->err, TDM_EINVALID, "tensor '%s': byte size overflows", t->name);
    t->n_bytes = (size_t)bytes;
    return cur_u64(c, t->name, &t->offset);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Returns a name that occurs twice among the n records (each `stride` bytes, with a char *
 * at `name_off`), or NULL. O(n log n), so a file with many entries cannot stall the parser.
 * *rc gets TDM_ERESOURCE on out of memory. */
static const char *find_duplicate(const void *records, size_t n, size_t stride, size_t name_off,
                                  int *rc)
{
    *rc = TDM_OK;
    if (n < 2)
        return NULL;
    char **names = malloc(n * sizeof *names);
    if (!names) {
        *rc = TDM_ERESOURCE;
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        memcpy(&names[i], (const char *)records + i * stride + name_off, sizeof(char *));
    qsort(names, n, sizeof *names, cmp_names);
    const char *dup = NULL;
    for (size_t i = 1; i < n && !dup; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            dup = names[i];
    free(names);
    return dup;
}

static void gguf_free_contents(tdm_gguf_t *g)
{
    if (g->kvs) {
        for (uint64_t i = 0; i < g->n_kv; i++) {
            free(g->kvs[i].key);
            free(g->kvs[i].arr_strs);
        }
        free(g->kvs);
    }
    if (g->tensors) {
        for (uint64_t i = 0; i < g->n_tensors; i++)
            free(g->tensors[i].name);
        free(g->tensors);
    }
    g->kvs = NULL;
    g->tensors = NULL;
}

/* The fixed header: magic, version (2 or 3), tensor and key counts. */
static int parse_header(cursor_t *c, tdm_gguf_t *g, uint64_t *n_tensors, uint64_t *n_kv)
{
    tdm_error_t *err = c->err;
    const uint8_t *magic = NULL;
    int rc = cur_bytes(c, 4, "magic", &magic);
    if (rc != TDM_OK)
        return rc;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "not a GGUF file: magic is %02x %02x %02x %02x, expected \"GGUF\"",
                             magic[0], magic[1], magic[2], magic[3]);
    if ((rc = cur_u32(c, "version", &g->version)) != TDM_OK)
        return rc;
    if (g->version != 2 && g->version != 3)
        return tdm_error_set(err, TDM_EINVALID,
                             "unsupported GGUF version %" PRIu32 " (supported: 2, 3)", g->version);
    if ((rc = cur_u64(c, "tensor_count", n_tensors)) != TDM_OK ||
        (rc = cur_u64(c, "metadata_kv_count", n_kv)) != TDM_OK)
        return rc;
    return TDM_OK;
}

/* The n_kv metadata key/values (unique keys) and general.alignment. */
static int parse_kvs(cursor_t *c, tdm_gguf_t *g, uint64_t n_kv)
{
    tdm_error_t *err = c->err;
    /* a key/value needs >= 12 bytes (key length + type), a tensor info >= 32 */
    if (n_kv > cur_left(c) / 12)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata_kv_count %" PRIu64 " cannot fit in the %zu bytes left", n_kv,
                             cur_left(c));
    g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kvs);
    if (!g->kvs)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for %" PRIu64 " keys", n_kv);
    g->n_kv = n_kv;
    int rc;
    for (uint64_t i = 0; i < n_kv; i++) {
        if ((rc = parse_kv(c, i, &g->kvs[i])) != TDM_OK)
            return rc;
    }
    const char *dup =
        find_duplicate(g->kvs, (size_t)n_kv, sizeof *g->kvs, offsetof(tdm_gguf_kv_t, key), &rc);
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "out of memory checking metadata keys");
    if (dup)
        return tdm_error_set(err, TDM_EINVALID, "metadata key '%s' appears twice", dup);
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const tdm_gguf_kv_t *al = tdm_gguf_find_kv(g, "general.alignment");
    if (al) {
        if (al->type != TDM_GGUF_VTYPE_UINT32 || al->value.u64 == 0 ||
            (al->value.u64 & (al->value.u64 - 1)) != 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "general.alignment must be a uint32 power of two, got %s %" PRIu64,
                                 tdm_gguf_vtype_name(al->type), al->value.u64);
        g->alignment = (uint32_t)al->value.u64;
    }
    return TDM_OK;
}

/* The n_tensors tensor infos. */
static int parse_tensor_infos(cursor_t *c, tdm_gguf_t *g, uint64_t n_tensors)
{
    tdm_error_t *err = c->err;
    int rc;
    if (n_tensors > cur_left(c) / 32)
        return tdm_error_set(err, TDM_EINVALID,
                             "tensor_count %" PRIu64 " cannot fit in the %zu bytes left", n_tensors,
                             cur_left(c));
    g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    if (!g->tensors)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for %" PRIu64 " tensors",
                             n_tensors);
    g->n_tensors = n_tensors;
    for (uint64_t i = 0; i < n_tensors; i++)
        if ((rc = parse_tensor_info(c, i, &g->tensors[i])) != TDM_OK)
            return rc;
    return TDM_OK;
}

/* Places the tensors in the data section (after the infos, padded to the alignment): each
 * aligned, inside the file, with a unique name. */
static int place_tensors(cursor_t *c, tdm_gguf_t *g)
{
    tdm_error_t *err = c->err;
    uint64_t n_tensors = g->n_tensors;
    /* data section: after the tensor infos, padded to the alignment */
    uint64_t off = c->pos;
    uint64_t pad = (g->alignment - off % g->alignment) % g->alignment;
    g->data_offset = off + pad;
    uint64_t data_size = g->data_offset <= g->size ? g->size - g->data_offset : 0;
    if (n_tensors > 0 && g->data_offset > g->size)
        return tdm_error_set(err, TDM_EINVALID,
                             "truncated file: the tensor data section starts at offset %" PRIu64
                             " but the file has %zu bytes",
                             g->data_offset, g->size);

    /* tensors must lie inside the data section, aligned, with unique names */
    g->tensor_bytes = 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        tdm_gguf_tensor_t *t = &g->tensors[i];
        uint64_t end;
        if (t->offset % g->alignment != 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tensor '%s': data offset %" PRIu64
                                 " is not a multiple of the alignment %" PRIu32,
                                 t->name, t->offset, g->alignment);
        if (!tdm_add_u64(t->offset, t->n_bytes, &end) || end > data_size)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tensor '%s': data [%" PRIu64 ", +%zu) lies outside the %" PRIu64
                                 "-byte data section (file truncated?)",
                                 t->name, t->offset, t->n_bytes, data_size);
        t->data = g->base + g->data_offset + t->offset;
        g->tensor_bytes += t->n_bytes;
    }
    int rc;
    const char *dup = find_duplicate(g->tensors, (size_t)n_tensors, sizeof *g->tensors,
                                     offsetof(tdm_gguf_tensor_t, name), &rc);
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "out of memory checking tensor names");
    if (dup)
        return tdm_error_set(err, TDM_EINVALID, "tensor name '%s' appears twice", dup);
    return TDM_OK;
}

/* Parses g->base[0..size); on failure leaves partial contents for gguf_free_contents. */
static int gguf_parse(tdm_gguf_t *g, tdm_error_t *err)
{
    cursor_t c = {.p = g->base, .size = g->size, .pos = 0, .err = err};
    uint64_t n_tensors = 0, n_kv = 0;
    int rc;
    if ((rc = parse_header(&c, g, &n_tensors, &n_kv)) != TDM_OK ||
        (rc = parse_kvs(&c, g, n_kv)) != TDM_OK ||
        (rc = parse_tensor_infos(&c, g, n_tensors)) != TDM_OK)
        return rc;
    return place_tensors(&c, g);
}

tdm_gguf_t *tdm_gguf_open_memory(const void *data, size_t size, tdm_error_t *err)
{
    tdm_gguf_t *g = calloc(1, sizeof *g);
    if (!g) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    g->base = data;
    g->size = size;
    if (gguf_parse(g, err) != TDM_OK) {
        gguf_free_contents(g);
        free(g);
        return NULL;
    }
    return g;
}

tdm_gguf_t *tdm_gguf_open(const char *path, tdm_error_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        tdm_error_set(err, errno == ENOENT ? TDM_ENOTFOUND : TDM_EUNAVAILABLE, "%s: %s", path,
                      strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        tdm_error_set(err, TDM_EUNAVAILABLE, "%s: %s", path, strerror(errno));
        goto out_close;
    }
    if (!S_ISREG(st.st_mode)) {
        tdm_error_set(err, TDM_EINVALID, "%s: not a regular file", path);
        goto out_close;
    }
    if (st.st_size < 24) {
        tdm_error_set(err, TDM_EINVALID, "%s: %lld bytes is too small for a GGUF header", path,
                      (long long)st.st_size);
        goto out_close;
    }
    size_t size = (size_t)st.st_size;
    void *base = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) {
        tdm_error_set(err, TDM_EUNAVAILABLE, "%s: mmap: %s", path, strerror(errno));
        goto out_close;
    }
    close(fd);
    tdm_gguf_t *g = tdm_gguf_open_memory(base, size, err);
    if (!g) {
        tdm_error_prefix(err, TDM_EINVALID, "%s", path);
        munmap(base, size);
        return NULL;
    }
    g->mapped = true;
    return g;

out_close:
    close(fd);
    return NULL;
}

uint64_t tdm_gguf_release(const tdm_gguf_t *g, const void *p, size_t len)
{
    if (!g || !g->mapped || !p)
        return 0;
    uintptr_t lo = (uintptr_t)p, hi = lo + len, base = (uintptr_t)g->base;
    if (lo < base || hi < lo || hi > base + g->size)
        return 0;
    long ps = sysconf(_SC_PAGESIZE);
    uintptr_t page = ps > 0 ? (uintptr_t)ps : 4096;
    uintptr_t a = (lo + page - 1) / page * page, b = hi / page * page; /* whole pages inside */
    if (b <= a || madvise((void *)a, b - a, MADV_DONTNEED) != 0)
        return 0;
    return (uint64_t)(b - a);
}

void tdm_gguf_destroy(tdm_gguf_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_gguf_t *g = *self_p;
    gguf_free_contents(g);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    free(g);
    *self_p = NULL;
}

uint32_t tdm_gguf_version(const tdm_gguf_t *g)
{
    return g->version;
}

size_t tdm_gguf_file_size(const tdm_gguf_t *g)
{
    return g->size;
}

uint32_t tdm_gguf_alignment(const tdm_gguf_t *g)
{
    return g->alignment;
}

uint64_t tdm_gguf_data_offset(const tdm_gguf_t *g)
{
    return g->data_offset;
}

uint64_t tdm_gguf_n_kv(const tdm_gguf_t *g)
{
    return g->n_kv;
}

const tdm_gguf_kv_t *tdm_gguf_kv_at(const tdm_gguf_t *g, uint64_t i)
{
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const tdm_gguf_kv_t *tdm_gguf_find_kv(const tdm_gguf_t *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (strcmp(g->kvs[i].key, key) == 0)
            return &g->kvs[i];
    return NULL;
}

uint64_t tdm_gguf_n_tensors(const tdm_gguf_t *g)
{
    return g->n_tensors;
}

const tdm_gguf_tensor_t *tdm_gguf_tensor_at(const tdm_gguf_t *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const tdm_gguf_tensor_t *tdm_gguf_find_tensor(const tdm_gguf_t *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i].name, name) == 0)
            return &g->tensors[i];
    return NULL;
}

uint64_t tdm_gguf_tensor_bytes(const tdm_gguf_t *g)
{
    return g->tensor_bytes;
}

int64_t tdm_gguf_arr_int(const tdm_gguf_kv_t *kv, uint64_t i)
{
    tdm_gguf_kv_t tmp = {0};
    size_t esz = vtype_size(kv->arr_type);
    if (kv->type != TDM_GGUF_VTYPE_ARRAY || i >= kv->arr_n || esz == 0)
        return 0;
    scalar_decode(kv->arr_type, (const uint8_t *)kv->arr_data + i * esz, &tmp);
    switch (kv->arr_type) {
    case TDM_GGUF_VTYPE_INT8:
    case TDM_GGUF_VTYPE_INT16:
    case TDM_GGUF_VTYPE_INT32:
    case TDM_GGUF_VTYPE_INT64: return tmp.value.i64;
    case TDM_GGUF_VTYPE_FLOAT32:
    case TDM_GGUF_VTYPE_FLOAT64: return (int64_t)tmp.value.f64;
    default: return tmp.value.u64 > INT64_MAX ? INT64_MAX : (int64_t)tmp.value.u64;
    }
}

double tdm_gguf_arr_float(const tdm_gguf_kv_t *kv, uint64_t i)
{
    tdm_gguf_kv_t tmp = {0};
    size_t esz = vtype_size(kv->arr_type);
    if (kv->type != TDM_GGUF_VTYPE_ARRAY || i >= kv->arr_n || esz == 0)
        return 0.0;
    scalar_decode(kv->arr_type, (const uint8_t *)kv->arr_data + i * esz, &tmp);
    switch (kv->arr_type) {
    case TDM_GGUF_VTYPE_FLOAT32:
    case TDM_GGUF_VTYPE_FLOAT64: return tmp.value.f64;
    case TDM_GGUF_VTYPE_INT8:
    case TDM_GGUF_VTYPE_INT16:
    case TDM_GGUF_VTYPE_INT32:
    case TDM_GGUF_VTYPE_INT64: return (double)tmp.value.i64;
    default: return (double)tmp.value.u64;
    }
}

/* ---- typed getters ---- */

static bool vtype_is_unsigned(tdm_gguf_vtype_t t)
{
    return t == TDM_GGUF_VTYPE_UINT8 || t == TDM_GGUF_VTYPE_UINT16 || t == TDM_GGUF_VTYPE_UINT32 ||
           t == TDM_GGUF_VTYPE_UINT64;
}

static bool vtype_is_signed(tdm_gguf_vtype_t t)
{
    return t == TDM_GGUF_VTYPE_INT8 || t == TDM_GGUF_VTYPE_INT16 || t == TDM_GGUF_VTYPE_INT32 ||
           t == TDM_GGUF_VTYPE_INT64;
}

static const tdm_gguf_kv_t *find_or_err(const tdm_gguf_t *g, const char *key, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = tdm_gguf_find_kv(g, key);
    if (!kv)
        tdm_error_set(err, TDM_ENOTFOUND, "metadata key '%s' is missing", key);
    return kv;
}

static int type_err(const tdm_gguf_kv_t *kv, const char *want, tdm_error_t *err)
{
    return tdm_error_set(err, TDM_EINVALID, "metadata '%s' has type %s, expected %s", kv->key,
                         tdm_gguf_vtype_name(kv->type), want);
}

int tdm_gguf_get_u64(const tdm_gguf_t *g, const char *key, uint64_t *out, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = find_or_err(g, key, err);
    if (!kv)
        return TDM_ENOTFOUND;
    if (vtype_is_unsigned(kv->type)) {
        *out = kv->value.u64;
        return TDM_OK;
    }
    if (vtype_is_signed(kv->type)) {
        if (kv->value.i64 < 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "metadata '%s' is %" PRId64 ", expected a non-negative value", key,
                                 kv->value.i64);
        *out = (uint64_t)kv->value.i64;
        return TDM_OK;
    }
    return type_err(kv, "an integer", err);
}

int tdm_gguf_get_u32(const tdm_gguf_t *g, const char *key, uint32_t *out, tdm_error_t *err)
{
    uint64_t v;
    int rc = tdm_gguf_get_u64(g, key, &v, err);
    if (rc != TDM_OK)
        return rc;
    if (v > UINT32_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s' = %" PRIu64 " does not fit in 32 bits", key, v);
    *out = (uint32_t)v;
    return TDM_OK;
}

int tdm_gguf_get_i64(const tdm_gguf_t *g, const char *key, int64_t *out, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = find_or_err(g, key, err);
    if (!kv)
        return TDM_ENOTFOUND;
    if (vtype_is_signed(kv->type)) {
        *out = kv->value.i64;
        return TDM_OK;
    }
    if (vtype_is_unsigned(kv->type)) {
        if (kv->value.u64 > INT64_MAX)
            return tdm_error_set(err, TDM_EINVALID, "metadata '%s' does not fit in int64", key);
        *out = (int64_t)kv->value.u64;
        return TDM_OK;
    }
    return type_err(kv, "an integer", err);
}

int tdm_gguf_get_f32(const tdm_gguf_t *g, const char *key, float *out, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = find_or_err(g, key, err);
    if (!kv)
        return TDM_ENOTFOUND;
    if (kv->type == TDM_GGUF_VTYPE_FLOAT32 || kv->type == TDM_GGUF_VTYPE_FLOAT64)
        *out = (float)kv->value.f64;
    else if (vtype_is_signed(kv->type))
        *out = (float)kv->value.i64;
    else if (vtype_is_unsigned(kv->type))
        *out = (float)kv->value.u64;
    else
        return type_err(kv, "a number", err);
    return TDM_OK;
}

int tdm_gguf_get_bool(const tdm_gguf_t *g, const char *key, bool *out, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = find_or_err(g, key, err);
    if (!kv)
        return TDM_ENOTFOUND;
    if (kv->type != TDM_GGUF_VTYPE_BOOL)
        return type_err(kv, "bool", err);
    *out = kv->value.u64 != 0;
    return TDM_OK;
}

int tdm_gguf_get_str(const tdm_gguf_t *g, const char *key, tdm_gguf_str_t *out, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = find_or_err(g, key, err);
    if (!kv)
        return TDM_ENOTFOUND;
    if (kv->type != TDM_GGUF_VTYPE_STRING)
        return type_err(kv, "string", err);
    *out = kv->value.str;
    return TDM_OK;
}

int tdm_gguf_get_arr(const tdm_gguf_t *g, const char *key, tdm_gguf_vtype_t elem_type,
                     const tdm_gguf_kv_t **out, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = find_or_err(g, key, err);
    if (!kv)
        return TDM_ENOTFOUND;
    if (kv->type != TDM_GGUF_VTYPE_ARRAY)
        return type_err(kv, "array", err);
    if (elem_type != TDM_GGUF_VTYPE_COUNT && kv->arr_type != elem_type)
        return tdm_error_set(err, TDM_EINVALID, "metadata '%s' is an array of %s, expected %s", key,
                             tdm_gguf_vtype_name(kv->arr_type), tdm_gguf_vtype_name(elem_type));
    *out = kv;
    return TDM_OK;
}

/* Appends s (len bytes) to buf quoted, cut after max bytes; control bytes, quotes, backslashes
 * and bytes that are not valid UTF-8 are written as \xNN escapes, so a file's strings cannot
 * send terminal escape sequences or broken text to the screen. */
static size_t fmt_str(char *buf, size_t cap, size_t pos, const char *s, uint64_t len, size_t max)
{
    const unsigned char *u = (const unsigned char *)s;
    pos += (size_t)snprintf(buf + pos, pos < cap ? cap - pos : 0, "\"");
    for (uint64_t i = 0; i < len && i < max && pos < cap;) {
        unsigned char ch = u[i];
        uint32_t cp;
        size_t cl = tdm_utf8_decode(u + i, (size_t)(len - i), &cp);
        if (ch < 0x20 || ch == 0x7f || ch == '"' || ch == '\\' || cl == 0) {
            pos += (size_t)snprintf(buf + pos, cap - pos, "\\x%02x", ch);
            i++;
        } else {
            pos += (size_t)snprintf(buf + pos, cap - pos, "%.*s", (int)cl, s + i);
            i += cl;
        }
    }
    if (pos < cap)
        pos += (size_t)snprintf(buf + pos, cap - pos, len > max ? "\"…" : "\"");
    return pos;
}

static size_t fmt_scalar(char *buf, size_t cap, size_t pos, const tdm_gguf_kv_t *v)
{
    if (pos >= cap)
        return pos;
    if (vtype_is_unsigned(v->type))
        return pos + (size_t)snprintf(buf + pos, cap - pos, "%" PRIu64, v->value.u64);
    if (vtype_is_signed(v->type))
        return pos + (size_t)snprintf(buf + pos, cap - pos, "%" PRId64, v->value.i64);
    if (v->type == TDM_GGUF_VTYPE_BOOL)
        return pos + (size_t)snprintf(buf + pos, cap - pos, v->value.u64 ? "true" : "false");
    if (v->type == TDM_GGUF_VTYPE_FLOAT32 || v->type == TDM_GGUF_VTYPE_FLOAT64)
        return pos + (size_t)snprintf(buf + pos, cap - pos, "%g", v->value.f64);
    return pos;
}

char *tdm_gguf_kv_format(const tdm_gguf_kv_t *kv, char *buf, size_t cap)
{
    if (cap == 0)
        return buf;
    buf[0] = '\0';
    size_t pos = 0;
    if (kv->type == TDM_GGUF_VTYPE_STRING) {
        fmt_str(buf, cap, 0, kv->value.str.data, kv->value.str.len, 60);
    } else if (kv->type != TDM_GGUF_VTYPE_ARRAY) {
        fmt_scalar(buf, cap, 0, kv);
    } else {
        pos = (size_t)snprintf(buf, cap, "[%s x %" PRIu64 "]", tdm_gguf_vtype_name(kv->arr_type),
                               kv->arr_n);
        for (uint64_t i = 0; i < kv->arr_n && i < 4 && pos < cap; i++) {
            pos += (size_t)snprintf(buf + pos, cap - pos, i ? ", " : " ");
            if (kv->arr_type == TDM_GGUF_VTYPE_STRING) {
                pos = fmt_str(buf, cap, pos, kv->arr_strs[i].data, kv->arr_strs[i].len, 24);
            } else {
                tdm_gguf_kv_t tmp = {.type = kv->arr_type};
                scalar_decode(kv->arr_type,
                              (const uint8_t *)kv->arr_data + i * vtype_size(kv->arr_type), &tmp);
                pos = fmt_scalar(buf, cap, pos, &tmp);
            }
        }
        if (kv->arr_n > 4 && pos < cap)
            snprintf(buf + pos, cap - pos, ", …");
    }
    buf[cap - 1] = '\0';
    return buf;
}
