/* writer.c - builds GGUF v3 files in memory and writes them out (see tandem/gguf.h).
 *
 * Layout written (GGUF spec, ggml/docs/gguf.md): magic "GGUF", u32 version 3, u64 tensor
 * count, u64 key/value count, the key/value pairs in the order their keys were first set,
 * the tensor infos in the order the tensors were added (name, u32 n_dims, u64 ne[n_dims],
 * u32 type, u64 offset), zero padding to the alignment, then each tensor's data at an offset
 * (from the start of the data section) that is a multiple of the alignment, each followed by
 * zero padding to the alignment as llama.cpp's writer does. The alignment is the uint32
 * general.alignment when set (it must be a power of two), else 32. The output depends only on
 * the calls made, so it is byte-for-byte reproducible.
 */
#include "tandem/gguf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GGUF_VERSION 3
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NAME 63 /* ggml's GGML_MAX_NAME (64) less the NUL */

/* One metadata pair, kept serialised: `value` is everything after the key on disk (u32 type,
 * then the value). */
typedef struct wkv {
    char *key;
    tdm_gguf_vtype_t type;
    uint8_t *value;
    size_t value_len; /* bytes */
} wkv_t;

typedef struct wtensor {
    char *name;
    uint32_t n_dims;
    uint64_t ne[TDM_GGUF_MAX_DIMS];
    tdm_ggml_type_t type;
    void *data;     /* n_bytes, in the type's block layout */
    size_t n_bytes; /* bytes */
} wtensor_t;

struct tdm_gguf_writer {
    wkv_t *kvs; /* [n_kv], insertion order */
    size_t n_kv, cap_kv;
    wtensor_t *tensors; /* [n_tensors], insertion order */
    size_t n_tensors, cap_tensors;
};

tdm_gguf_writer_t *tdm_gguf_writer_new(void)
{
    return calloc(1, sizeof(tdm_gguf_writer_t));
}

void tdm_gguf_writer_destroy(tdm_gguf_writer_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_gguf_writer_t *w = *self_p;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].value);
    }
    free(w->kvs);
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w);
    *self_p = NULL;
}

/* ---- metadata ---- */

/* Values and the header are built in a tdm_buf_t; its oom flag is sticky, so the bb_*
 * appenders ignore results and set_kv / writer_header check once. */
static void bb_put(tdm_buf_t *b, const void *src, size_t n)
{
    (void)tdm_buf_append(b, src, n);
}

static void bb_u32(tdm_buf_t *b, uint32_t v)
{
    bb_put(b, &v, sizeof v);
}

static void bb_u64(tdm_buf_t *b, uint64_t v)
{
    bb_put(b, &v, sizeof v);
}

static void bb_str(tdm_buf_t *b, const char *s)
{
    const size_t n = strlen(s);
    bb_u64(b, (uint64_t)n);
    bb_put(b, s, n);
}

/* Stores key = the value serialised in b (takes b's buffer); replaces an earlier value of the
 * key in place so the key keeps its first position. Returns TDM_OK, TDM_ERESOURCE or
 * TDM_EINVALID (NULL key). */
static int set_kv(tdm_gguf_writer_t *w, const char *key, tdm_gguf_vtype_t type, tdm_buf_t *b)
{
    int rc = TDM_OK;
    if (!w || !key) {
        rc = TDM_EINVALID;
        goto out_free_value;
    }
    if (b->oom) {
        rc = TDM_ERESOURCE;
        goto out_free_value;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].value);
            w->kvs[i].type = type;
            w->kvs[i].value = (uint8_t *)b->data;
            w->kvs[i].value_len = b->len;
            return TDM_OK;
        }
    }
    if (w->n_kv == w->cap_kv) {
        const size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        wkv_t *kvs = realloc(w->kvs, cap * sizeof *kvs);
        if (!kvs) {
            rc = TDM_ERESOURCE;
            goto out_free_value;
        }
        w->kvs = kvs;
        w->cap_kv = cap;
    }
    char *k = tdm_strdup(key);
    if (!k) {
        rc = TDM_ERESOURCE;
        goto out_free_value;
    }
    w->kvs[w->n_kv++] =
        (wkv_t){.key = k, .type = type, .value = (uint8_t *)b->data, .value_len = b->len};
    return TDM_OK;

out_free_value:
    tdm_buf_free(b);
    return rc;
}

static int set_scalar(tdm_gguf_writer_t *w, const char *key, tdm_gguf_vtype_t type, const void *v,
                      size_t n)
{
    tdm_buf_t b = TDM_BUF_INIT;
    bb_u32(&b, (uint32_t)type);
    bb_put(&b, v, n);
    return set_kv(w, key, type, &b);
}

int tdm_gguf_writer_set_u32(tdm_gguf_writer_t *w, const char *key, uint32_t v)
{
    return set_scalar(w, key, TDM_GGUF_VTYPE_UINT32, &v, sizeof v);
}

int tdm_gguf_writer_set_i32(tdm_gguf_writer_t *w, const char *key, int32_t v)
{
    return set_scalar(w, key, TDM_GGUF_VTYPE_INT32, &v, sizeof v);
}

int tdm_gguf_writer_set_u64(tdm_gguf_writer_t *w, const char *key, uint64_t v)
{
    return set_scalar(w, key, TDM_GGUF_VTYPE_UINT64, &v, sizeof v);
}

int tdm_gguf_writer_set_f32(tdm_gguf_writer_t *w, const char *key, float v)
{
    return set_scalar(w, key, TDM_GGUF_VTYPE_FLOAT32, &v, sizeof v);
}

int tdm_gguf_writer_set_bool(tdm_gguf_writer_t *w, const char *key, bool v)
{
    const uint8_t b = v ? 1 : 0;
    return set_scalar(w, key, TDM_GGUF_VTYPE_BOOL, &b, sizeof b);
}

int tdm_gguf_writer_set_str(tdm_gguf_writer_t *w, const char *key, const char *v)
{
    if (!v)
        return TDM_EINVALID;
    tdm_buf_t b = TDM_BUF_INIT;
    bb_u32(&b, TDM_GGUF_VTYPE_STRING);
    bb_str(&b, v);
    return set_kv(w, key, TDM_GGUF_VTYPE_STRING, &b);
}

int tdm_gguf_writer_set_arr_str(tdm_gguf_writer_t *w, const char *key, const char *const *v,
                                size_t n)
{
    if (n > 0 && !v)
        return TDM_EINVALID;
    for (size_t i = 0; i < n; i++)
        if (!v[i])
            return TDM_EINVALID;
    tdm_buf_t b = TDM_BUF_INIT;
    bb_u32(&b, TDM_GGUF_VTYPE_ARRAY);
    bb_u32(&b, TDM_GGUF_VTYPE_STRING);
    bb_u64(&b, (uint64_t)n);
    for (size_t i = 0; i < n; i++)
        bb_str(&b, v[i]);
    return set_kv(w, key, TDM_GGUF_VTYPE_ARRAY, &b);
}

/* Numeric array of n elements of elem_size bytes each (already little-endian). */
static int set_arr_num(tdm_gguf_writer_t *w, const char *key, tdm_gguf_vtype_t elem_type,
                       const void *v, size_t n, size_t elem_size)
{
    size_t bytes;
    if ((n > 0 && !v) || !tdm_mul_size(n, elem_size, &bytes))
        return TDM_EINVALID;
    tdm_buf_t b = TDM_BUF_INIT;
    bb_u32(&b, TDM_GGUF_VTYPE_ARRAY);
    bb_u32(&b, (uint32_t)elem_type);
    bb_u64(&b, (uint64_t)n);
    bb_put(&b, v, bytes);
    return set_kv(w, key, TDM_GGUF_VTYPE_ARRAY, &b);
}

int tdm_gguf_writer_set_arr_f32(tdm_gguf_writer_t *w, const char *key, const float *v, size_t n)
{
    return set_arr_num(w, key, TDM_GGUF_VTYPE_FLOAT32, v, n, sizeof(float));
}

int tdm_gguf_writer_set_arr_i32(tdm_gguf_writer_t *w, const char *key, const int32_t *v, size_t n)
{
    return set_arr_num(w, key, TDM_GGUF_VTYPE_INT32, v, n, sizeof(int32_t));
}

/* ---- tensors ---- */

int tdm_gguf_writer_add_tensor(tdm_gguf_writer_t *w, const char *name, tdm_ggml_type_t type,
                               uint32_t n_dims, const uint64_t *ne, const void *data)
{
    if (!w || !name || !ne || n_dims < 1 || n_dims > TDM_GGUF_MAX_DIMS)
        return TDM_EINVALID;
    const size_t name_len = strlen(name);
    if (name_len == 0 || name_len > GGUF_MAX_NAME)
        return TDM_EINVALID;
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get((uint32_t)type);
    if (!ti)
        return TDM_EINVALID;
    uint64_t rows = 1;
    for (uint32_t d = 1; d < n_dims; d++)
        if (ne[d] == 0 || !tdm_mul_u64(rows, ne[d], &rows))
            return TDM_EINVALID;
    const size_t row_bytes = tdm_ggml_row_size(type, ne[0]);
    uint64_t n_bytes;
    if (ne[0] == 0 || row_bytes == 0 || !tdm_mul_u64(row_bytes, rows, &n_bytes) ||
        n_bytes > SIZE_MAX || !data)
        return TDM_EINVALID;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return TDM_EINVALID;

    if (w->n_tensors == w->cap_tensors) {
        const size_t cap = w->cap_tensors ? 2 * w->cap_tensors : 16;
        wtensor_t *ts = realloc(w->tensors, cap * sizeof *ts);
        if (!ts)
            return TDM_ERESOURCE;
        w->tensors = ts;
        w->cap_tensors = cap;
    }
    wtensor_t t = {.n_dims = n_dims, .type = type, .n_bytes = (size_t)n_bytes};
    for (uint32_t d = 0; d < TDM_GGUF_MAX_DIMS; d++)
        t.ne[d] = d < n_dims ? ne[d] : 1;
    t.name = tdm_strdup(name);
    if (!t.name)
        return TDM_ERESOURCE;
    t.data = malloc(t.n_bytes ? t.n_bytes : 1);
    if (!t.data) {
        free(t.name);
        return TDM_ERESOURCE;
    }
    memcpy(t.data, data, t.n_bytes);
    w->tensors[w->n_tensors++] = t;
    return TDM_OK;
}

/* ---- serialisation ---- */

/* The alignment to use: general.alignment when it is a uint32, else 32. Returns 0 when the
 * key holds 0 or a value that is not a power of two (readers reject such files). */
static uint32_t writer_alignment(const tdm_gguf_writer_t *w)
{
    for (size_t i = 0; i < w->n_kv; i++) {
        const wkv_t *kv = &w->kvs[i];
        if (strcmp(kv->key, "general.alignment") == 0 && kv->type == TDM_GGUF_VTYPE_UINT32) {
            uint32_t a;
            memcpy(&a, kv->value + 4, sizeof a);
            return a != 0 && (a & (a - 1)) == 0 ? a : 0;
        }
    }
    return GGUF_DEFAULT_ALIGNMENT;
}

static uint64_t pad_to(uint64_t n, uint32_t align)
{
    return (align - n % align) % align;
}

/* Serialises everything before the tensor data (header, key/values, tensor infos, padding to
 * the alignment) into a new heap buffer *hdr of *hdr_len bytes; *data_len gets the size of
 * the data section (every tensor padded to the alignment, so each one's offset is the padded
 * sizes of those before it).
 * Returns TDM_OK, TDM_ERESOURCE or TDM_EINVALID (bad general.alignment). */
static int serialise_header(const tdm_gguf_writer_t *w, uint8_t **hdr, size_t *hdr_len,
                            uint64_t *data_len)
{
    const uint32_t align = writer_alignment(w);
    if (align == 0)
        return TDM_EINVALID;
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!tdm_add_u64(off, w->tensors[i].n_bytes, &off) ||
            !tdm_add_u64(off, pad_to(off, align), &off))
            return TDM_ERESOURCE;
    *data_len = off;

    tdm_buf_t b = TDM_BUF_INIT;
    bb_put(&b, "GGUF", 4);
    bb_u32(&b, GGUF_VERSION);
    bb_u64(&b, (uint64_t)w->n_tensors);
    bb_u64(&b, (uint64_t)w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        bb_str(&b, w->kvs[i].key);
        bb_put(&b, w->kvs[i].value, w->kvs[i].value_len);
    }
    off = 0; /* each tensor at the next aligned offset; no overflow: checked above */
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor_t *t = &w->tensors[i];
        bb_str(&b, t->name);
        bb_u32(&b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            bb_u64(&b, t->ne[d]);
        bb_u32(&b, (uint32_t)t->type);
        bb_u64(&b, off);
        off += t->n_bytes + pad_to(t->n_bytes, align);
    }
    static const uint8_t zeros[256];
    uint64_t pad = pad_to(b.len, align);
    while (pad > 0) {
        const size_t n = pad < sizeof zeros ? (size_t)pad : sizeof zeros;
        bb_put(&b, zeros, n);
        pad -= n;
    }
    if (b.oom) {
        tdm_buf_free(&b);
        return TDM_ERESOURCE;
    }
    *hdr = (uint8_t *)b.data;
    *hdr_len = b.len;
    return TDM_OK;
}

int tdm_gguf_writer_to_memory(const tdm_gguf_writer_t *w, void **data, size_t *size)
{
    if (!w || !data || !size)
        return TDM_EINVALID;
    uint8_t *hdr;
    size_t hdr_len;
    uint64_t data_len;
    int rc = serialise_header(w, &hdr, &hdr_len, &data_len);
    if (rc != TDM_OK)
        return rc;
    size_t total;
    if (data_len > SIZE_MAX || !tdm_add_size(hdr_len, (size_t)data_len, &total)) {
        rc = TDM_ERESOURCE;
        goto out_free_hdr;
    }
    uint8_t *out = calloc(1, total ? total : 1); /* calloc: the padding is zeros */
    if (!out) {
        rc = TDM_ERESOURCE;
        goto out_free_hdr;
    }
    memcpy(out, hdr, hdr_len);
    const uint32_t align = writer_alignment(w);
    size_t off = hdr_len;
    for (size_t i = 0; i < w->n_tensors; i++) {
        memcpy(out + off, w->tensors[i].data, w->tensors[i].n_bytes);
        off += w->tensors[i].n_bytes + (size_t)pad_to(w->tensors[i].n_bytes, align);
    }
    *data = out;
    *size = total;

out_free_hdr:
    free(hdr);
    return rc;
}

/* Writes the file directly (no copy of the tensor data in memory). */
int tdm_gguf_writer_write_file(const tdm_gguf_writer_t *w, const char *path, tdm_error_t *err)
{
    if (!w || !path)
        return tdm_error_set(err, TDM_EINVALID, "gguf writer: NULL writer or path");
    uint8_t *hdr;
    size_t hdr_len;
    uint64_t data_len;
    int rc = serialise_header(w, &hdr, &hdr_len, &data_len);
    if (rc == TDM_EINVALID)
        return tdm_error_set(err, rc, "%s: general.alignment must be a power of two", path);
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "%s: out of memory serialising the GGUF header", path);
    FILE *f = fopen(path, "wb");
    if (!f) {
        rc = tdm_error_set(err, TDM_EUNAVAILABLE, "cannot create %s: %s", path, strerror(errno));
        goto out_free_hdr;
    }
    bool ok = fwrite(hdr, 1, hdr_len, f) == hdr_len;
    const uint32_t align = writer_alignment(w);
    static const uint8_t zeros[256];
    for (size_t i = 0; ok && i < w->n_tensors; i++) {
        const wtensor_t *t = &w->tensors[i];
        ok = fwrite(t->data, 1, t->n_bytes, f) == t->n_bytes;
        const size_t pad = (size_t)pad_to(t->n_bytes, align); /* offsets are aligned */
        for (size_t done = 0; ok && done < pad;) {
            const size_t n = pad - done < sizeof zeros ? pad - done : sizeof zeros;
            ok = fwrite(zeros, 1, n, f) == n;
            done += n;
        }
    }
    int saved_errno = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        saved_errno = errno;
    }
    if (!ok) {
        rc = tdm_error_set(err, TDM_EUNAVAILABLE, "cannot write %s: %s", path,
                           strerror(saved_errno));
        remove(path);
        goto out_free_hdr;
    }
    tdm_error_clear(err);

out_free_hdr:
    free(hdr);
    return rc;
}
