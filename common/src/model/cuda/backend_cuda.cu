// backend_cuda.cu - the CUDA backend: device set-up, weight upload, the per-pass row upload,
// cuBLAS matmuls, reads, and the ops table (kernels in the other .cu files of this folder).
//
// Assumptions: one engine thread at a time drives a backend (as for the CPU); everything is
// issued on one non-blocking stream of the engine's device, so ops are ordered without
// synchronisation, and the only host waits are read/sync (once per pass) and the check in
// begin that the previous pass's row upload has left the pinned staging buffer.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/cuda/cuda_internal.cuh"

// cuBLAS workspace given to the handle (NVIDIA recommends 32 MiB on Hopper), so that GEMMs
// never allocate.
#define TDM_CUDA_BLAS_WS_BYTES ((size_t)32 << 20)
// Floats of the pinned buffer that carries dequantized weights to the device at create.
#define TDM_CUDA_UPLOAD_FLOATS ((size_t)8 << 20)
// Most block-table entries one pass may carry (64 MiB of staging at most).
#define TDM_CUDA_MAX_TABLE_WORDS ((size_t)16 << 20)

// ---- errors ----

int tdm_cuda_fail(cuda_be_t *be, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    be->err.code = code;
    vsnprintf(be->err.msg, sizeof be->err.msg, fmt, ap);
    va_end(ap);
    return code;
}

int tdm_cuda_status(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return TDM_OK;
    case cudaErrorMemoryAllocation: return TDM_ERESOURCE;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch: return TDM_EUNAVAILABLE;
    default: return TDM_EINTERNAL;
    }
}

int tdm_cublas_status(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return TDM_OK;
    case CUBLAS_STATUS_ALLOC_FAILED: return TDM_ERESOURCE;
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH: return TDM_EUNAVAILABLE;
    default: return TDM_EINTERNAL;
    }
}

// ---- weights ----

static size_t wmap_slot(const cuda_be_t *be, const void *host)
{
    uint64_t h = (uint64_t)(uintptr_t)host * UINT64_C(0x9e3779b97f4a7c15);
    return (size_t)(h >> 32) & (be->wmap_cap - 1);
}

static cuda_wentry_t *wmap_find(cuda_be_t *be, const void *host, bool insert)
{
    for (size_t i = wmap_slot(be, host), n = 0; n < be->wmap_cap;
         i = (i + 1) & (be->wmap_cap - 1), n++) {
        if (be->wmap[i].host == host)
            return &be->wmap[i];
        if (!be->wmap[i].host) {
            if (!insert)
                return NULL;
            be->wmap[i].host = host;
            return &be->wmap[i];
        }
    }
    return NULL;
}

const void *tdm_cuda_weight_gemm(cuda_be_t *be, const tdm_weight_t *w)
{
    cuda_wentry_t *e = wmap_find(be, w->data, false);
    if (!e || !e->gemm) {
        tdm_cuda_fail(be, TDM_EINTERNAL,
                      "weight '%s' has no device copy (not a matrix of the model)",
                      w->name ? w->name : "?");
        return NULL;
    }
    return e->gemm;
}

const float *tdm_cuda_weight_vec(cuda_be_t *be, const tdm_weight_t *w)
{
    cuda_wentry_t *e = wmap_find(be, w->data, false);
    if (!e || !e->vec) {
        tdm_cuda_fail(be, TDM_EINTERNAL,
                      "weight '%s' has no device copy (not a vector of the model)",
                      w->name ? w->name : "?");
        return NULL;
    }
    return e->vec;
}

// Every weight the forward pass uses, in a fixed order; n_out > 1 marks a matrix.
static size_t model_weights(const tdm_model_t *m, const tdm_weight_t **out)
{
    const tdm_llama_hparams_t *hp = tdm_model_hparams(m);
    size_t n = 0;
    if (out) {
        out[n] = tdm_model_token_embd(m);
        out[n + 1] = tdm_model_output(m);
        out[n + 2] = tdm_model_output_norm(m);
    }
    n += 3;
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        const tdm_layer_weights_t *lw = tdm_model_layer(m, l);
        const tdm_weight_t *ws[] = {&lw->attn_norm, &lw->wq,       &lw->wk,     &lw->wv,
                                    &lw->wo,        &lw->ffn_norm, &lw->w_gate, &lw->w_up,
                                    &lw->w_down,    &lw->bq,       &lw->bk,     &lw->bv};
        size_t k_max = hp->has_qkv_bias ? 12 : 9;
        for (size_t k = 0; k < k_max; k++, n++)
            if (out)
                out[n] = ws[k];
    }
    return n;
}

static bool weight_is_matrix(const tdm_weight_t *w)
{
    return w->n_out > 1;
}

static uint64_t weight_dev_bytes(const tdm_weight_t *w)
{
    uint64_t b = weight_is_matrix(w) ? w->n_in * w->n_out * 2 : w->n_in * sizeof(float);
    return (b + 255) / 256 * 256;
}

// Makes the weight map (room for twice the n_w weights) and returns the device bytes the
// weights take: a tied output matrix shares the embedding's copy, so each distinct host
// pointer counts once. The map is left empty. TDM_ERESOURCE on out of memory.
static int wmap_size(cuda_be_t *be, const tdm_weight_t **ws, size_t n_w, uint64_t *total)
{
    be->wmap_cap = 16;
    while (be->wmap_cap < 2 * n_w)
        be->wmap_cap *= 2;
    be->wmap = (cuda_wentry_t *)calloc(be->wmap_cap, sizeof *be->wmap);
    if (!be->wmap)
        return tdm_cuda_fail(be, TDM_ERESOURCE, "out of memory");
    *total = 0;
    for (size_t i = 0; i < n_w; i++) {
        if (wmap_find(be, ws[i]->data, false))
            continue;
        wmap_find(be, ws[i]->data, true);
        *total += weight_dev_bytes(ws[i]);
    }
    memset(be->wmap, 0, be->wmap_cap * sizeof *be->wmap);
    return TDM_OK;
}

// Uploads weight w to dst (weight_dev_bytes of device memory), a chunk of rows at a time:
// dequantized into the pinned h_buf, then copied as is (a vector) or through d_buf and
// converted to the GEMM type (a matrix). Both buffers hold TDM_CUDA_UPLOAD_FLOATS floats.
// Returns 0, TDM_EINVALID (rows too long, a type that cannot be dequantized) or a CUDA error.
static int upload_weight(cuda_be_t *be, const tdm_weight_t *w, uint8_t *dst, float *h_buf,
                         float *d_buf)
{
    if (w->n_in == 0 || w->n_in > TDM_CUDA_UPLOAD_FLOATS)
        return tdm_cuda_fail(be, TDM_EINVALID,
                             "weight '%s': rows of %llu values are not supported by the CUDA "
                             "backend",
                             w->name, (unsigned long long)w->n_in);
    size_t rows_per_chunk = TDM_CUDA_UPLOAD_FLOATS / w->n_in;
    for (uint64_t r0 = 0; r0 < w->n_out; r0 += rows_per_chunk) {
        uint64_t r1 = r0 + rows_per_chunk < w->n_out ? r0 + rows_per_chunk : w->n_out;
        for (uint64_t r = r0; r < r1; r++) {
            const uint8_t *src = (const uint8_t *)w->data + r * w->row_bytes;
            if (tdm_ggml_dequantize_row(w->type, src, h_buf + (r - r0) * w->n_in,
                                        (int64_t)w->n_in) != TDM_OK)
                return tdm_cuda_fail(be, TDM_EINVALID, "weight '%s': cannot dequantize its type %d",
                                     w->name, (int)w->type);
        }
        size_t count = (size_t)(r1 - r0) * w->n_in;
        if (weight_is_matrix(w)) {
            TDM_CUDA_TRY(be, cudaMemcpyAsync(d_buf, h_buf, count * sizeof(float),
                                             cudaMemcpyHostToDevice, be->stream));
            int rc = tdm_cuda_op_to_gemm(be, d_buf, count, dst + r0 * w->n_in * 2);
            if (rc != TDM_OK)
                return rc;
        } else {
            TDM_CUDA_TRY(be, cudaMemcpyAsync(dst, h_buf, count * sizeof(float),
                                             cudaMemcpyHostToDevice, be->stream));
        }
        // h_buf and d_buf are reused by the next chunk
        TDM_CUDA_TRY(be, cudaStreamSynchronize(be->stream));
    }
    return TDM_OK;
}

// Allocates the weight arena (total bytes; cuda_destroy frees it) and the two chunk buffers
// of upload_weight (the caller frees them, also after a failure). Returns 0 or a CUDA error.
static int upload_buffers(cuda_be_t *be, uint64_t total, float **h_buf, float **d_buf)
{
    TDM_CUDA_TRY(be, cudaMalloc((void **)&be->warena, total ? total : 256));
    be->warena_bytes = total;
    TDM_CUDA_TRY(be, cudaMallocHost((void **)h_buf, TDM_CUDA_UPLOAD_FLOATS * sizeof(float)));
    TDM_CUDA_TRY(be, cudaMalloc((void **)d_buf, TDM_CUDA_UPLOAD_FLOATS * sizeof(float)));
    return TDM_OK;
}

// Uploads every weight of the model into one device arena (upload_weight) and maps each
// host pointer to its copy. Returns 0, TDM_ERESOURCE on out of memory, upload_weight's errors.
static int upload_weights(cuda_be_t *be)
{
    size_t n_w = model_weights(be->model, NULL);
    const tdm_weight_t **ws = (const tdm_weight_t **)calloc(n_w, sizeof *ws);
    if (!ws)
        return tdm_cuda_fail(be, TDM_ERESOURCE, "out of memory");
    model_weights(be->model, ws);
    float *h_buf = NULL, *d_buf = NULL;
    uint64_t total = 0, off = 0;
    int rc = wmap_size(be, ws, n_w, &total);
    if (rc != TDM_OK)
        goto out_free;
    rc = upload_buffers(be, total, &h_buf, &d_buf);
    if (rc != TDM_OK)
        goto out_free;
    for (size_t i = 0; i < n_w && rc == TDM_OK; i++) {
        const tdm_weight_t *w = ws[i];
        if (wmap_find(be, w->data, false))
            continue; // a tied matrix, already there
        cuda_wentry_t *e = wmap_find(be, w->data, true);
        uint8_t *dst = be->warena + off;
        off += weight_dev_bytes(w);
        if (weight_is_matrix(w))
            e->gemm = dst;
        else
            e->vec = (float *)dst;
        rc = upload_weight(be, w, dst, h_buf, d_buf);
    }
out_free: // freeing cannot usefully fail
    (void)cudaFree(d_buf);
    (void)cudaFreeHost(h_buf);
    free(ws);
    return rc;
}

// ---- create / destroy ----

static void cuda_destroy(void *vbe)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (!be)
        return;
    // errors are ignored: nothing can be done about them while tearing down
    (void)cudaSetDevice(be->device);
    if (be->stream)
        (void)cudaStreamSynchronize(be->stream);
    for (size_t i = 0; i < be->n_allocs; i++)
        (void)cudaFree(be->allocs[i]);
    free(be->allocs);
    (void)cudaFree(be->xh);
    (void)cudaFree(be->d_stage);
    (void)cudaFreeHost(be->h_stage);
    (void)cudaFree(be->kv);
    (void)cudaFree(be->warena);
    if (be->blas)
        (void)cublasDestroy(be->blas);
    (void)cudaFree(be->blas_ws);
    if (be->staged)
        (void)cudaEventDestroy(be->staged);
    if (be->stream)
        (void)cudaStreamDestroy(be->stream);
    free(be->wmap);
    free(be->h_seq_off);
    free(be->h_seq_need);
    free(be->h_seq_count);
    free(be);
}

// Words of staging for a pass of up to max_rows rows and max_logits logit rows: tokens, pos,
// tab_off, logit rows, run rows, run starts (n + 1), then block tables.
static size_t stage_fixed_words(const cuda_be_t *be)
{
    return (size_t)be->max_rows * 5 + 1 + be->max_logits;
}

// Checks that cuda:be->device exists and that the model's shapes suit the kernels, picks the
// GEMM type (TANDEM_CUDA_GEMM: bf16, the default, or f16) and names the backend. Returns 0,
// TDM_EUNAVAILABLE (no such device), TDM_EINVALID (shapes, TANDEM_CUDA_GEMM) or a CUDA error.
static int cuda_open_device(cuda_be_t *be)
{
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0)
        return tdm_cuda_fail(be, TDM_EUNAVAILABLE, "no usable CUDA device: %s",
                             ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices");
    if (be->device < 0 || be->device >= count)
        return tdm_cuda_fail(be, TDM_EUNAVAILABLE, "cuda:%d does not exist (%d device(s))",
                             be->device, count);
    TDM_CUDA_TRY(be, cudaSetDevice(be->device));
    cudaDeviceProp prop;
    TDM_CUDA_TRY(be, cudaGetDeviceProperties(&prop, be->device));

    const tdm_llama_hparams_t *hp = be->hp;
    if (hp->head_dim > TDM_CUDA_MAX_HEAD_DIM || hp->head_dim % 4 != 0)
        return tdm_cuda_fail(be, TDM_EINVALID,
                             "head_dim %u is not supported by the CUDA backend (a multiple of 4, "
                             "at most %d)",
                             hp->head_dim, TDM_CUDA_MAX_HEAD_DIM);
    if (hp->rope_dim % 2 != 0 || hp->rope_dim > hp->head_dim)
        return tdm_cuda_fail(be, TDM_EINVALID, "rope_dim %u must be even and <= head_dim %u",
                             hp->rope_dim, hp->head_dim);
    const char *gemm = getenv("TANDEM_CUDA_GEMM");
    if (!gemm || !gemm[0] || strcmp(gemm, "bf16") == 0)
        be->gemm_type = CUDA_R_16BF;
    else if (strcmp(gemm, "f16") == 0)
        be->gemm_type = CUDA_R_16F;
    else
        return tdm_cuda_fail(be, TDM_EINVALID, "TANDEM_CUDA_GEMM must be bf16 or f16, got '%s'",
                             gemm);
    snprintf(be->name, sizeof be->name, "cuda:%d/%s %.100s", be->device,
             be->gemm_type == CUDA_R_16BF ? "bf16" : "f16", prop.name);
    return TDM_OK;
}

// The stream, the staging event and cuBLAS with its workspace. Returns 0 or a CUDA/cuBLAS error.
static int cuda_open_stream(cuda_be_t *be)
{
    TDM_CUDA_TRY(be, cudaStreamCreateWithFlags(&be->stream, cudaStreamNonBlocking));
    TDM_CUDA_TRY(be, cudaEventCreateWithFlags(&be->staged, cudaEventDisableTiming));
    TDM_CUBLAS_TRY(be, cublasCreate(&be->blas));
    TDM_CUBLAS_TRY(be, cublasSetStream(be->blas, be->stream));
    // after cublasSetStream, which resets the workspace to cuBLAS's own pool
    be->blas_ws_bytes = TDM_CUDA_BLAS_WS_BYTES;
    TDM_CUDA_TRY(be, cudaMalloc(&be->blas_ws, be->blas_ws_bytes));
    TDM_CUBLAS_TRY(be, cublasSetWorkspace(be->blas, be->blas_ws, be->blas_ws_bytes));
    return TDM_OK;
}

// The device copy of the KV pool: same layout, same size, zeroed like the host pool. Returns
// 0 or a CUDA error.
static int cuda_alloc_kv(cuda_be_t *be, tdm_kv_pool_t *pool)
{
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    be->n_blocks = st.n_blocks;
    be->block_bytes = tdm_kv_pool_block_bytes(pool);
    be->rec_bytes = tdm_kv_record_bytes(&be->kl);
    uint64_t kv_bytes = be->block_bytes * be->n_blocks;
    cudaError_t ce = cudaMalloc((void **)&be->kv, kv_bytes);
    if (ce != cudaSuccess)
        return tdm_cuda_fail(
            be, tdm_cuda_status(ce), "cudaMalloc of the KV pool copy (%llu bytes): %s (%s:%d)",
            (unsigned long long)kv_bytes, cudaGetErrorString(ce), __FILE__, __LINE__);
    TDM_CUDA_TRY(be, cudaMemsetAsync(be->kv, 0, kv_bytes, be->stream));
    return TDM_OK;
}

// The GEMM input buffer and the staging for the rows of a pass (sized for max_rows rows and
// n_ctx positions). Returns 0, TDM_ERESOURCE on out of memory, or a CUDA error.
static int cuda_alloc_staging(cuda_be_t *be)
{
    const tdm_llama_hparams_t *hp = be->hp;
    size_t max_in = hp->n_embd;
    if (hp->n_ff > max_in)
        max_in = hp->n_ff;
    if ((size_t)hp->n_heads * hp->head_dim > max_in)
        max_in = (size_t)hp->n_heads * hp->head_dim;
    be->max_in = max_in;
    TDM_CUDA_TRY(be, cudaMalloc(&be->xh, (size_t)be->max_rows * max_in * 2));

    size_t blocks_per_seq = (be->n_ctx + be->kl.block_size - 1) / be->kl.block_size;
    size_t table_words = (size_t)be->max_rows * blocks_per_seq;
    if (table_words > TDM_CUDA_MAX_TABLE_WORDS)
        table_words = TDM_CUDA_MAX_TABLE_WORDS;
    be->stage_words = stage_fixed_words(be) + table_words;
    TDM_CUDA_TRY(be, cudaMallocHost((void **)&be->h_stage, be->stage_words * sizeof(uint32_t)));
    TDM_CUDA_TRY(be, cudaMalloc((void **)&be->d_stage, be->stage_words * sizeof(uint32_t)));
    be->h_seq_off = (uint32_t *)calloc((size_t)be->max_rows + 1, sizeof(uint32_t));
    be->h_seq_need = (uint32_t *)calloc((size_t)be->max_rows + 1, sizeof(uint32_t));
    be->h_seq_count = (uint32_t *)calloc((size_t)be->max_rows + 1, sizeof(uint32_t));
    if (!be->h_seq_off || !be->h_seq_need || !be->h_seq_count)
        return tdm_cuda_fail(be, TDM_ERESOURCE, "out of memory");
    return TDM_OK;
}

// Everything the backend holds on the device, made once for the engine's life: the device
// and its stream, the KV pool's copy, the pass staging, the weights. Returns 0 or the first
// error (the message on be->err); cuda_destroy frees what was made.
static int cuda_setup(cuda_be_t *be, tdm_kv_pool_t *pool)
{
    int rc = cuda_open_device(be);
    if (rc == TDM_OK)
        rc = cuda_open_stream(be);
    if (rc == TDM_OK)
        rc = cuda_alloc_kv(be, pool);
    if (rc == TDM_OK)
        rc = cuda_alloc_staging(be);
    if (rc != TDM_OK)
        return rc;

    // as cpu_rope computes it, so both backends rotate by the same angles
    be->theta_scale = powf(be->hp->rope_freq_base, -2.0f / (float)be->hp->rope_dim);

    rc = upload_weights(be);
    if (rc != TDM_OK)
        return rc;
    TDM_CUDA_TRY(be, cudaStreamSynchronize(be->stream));
    return TDM_OK;
}

static void *cuda_create(const tdm_model_t *m, const tdm_engine_params_t *p, tdm_kv_pool_t *pool,
                         tdm_error_t *err)
{
    cuda_be_t *be = (cuda_be_t *)calloc(1, sizeof *be);
    if (!be) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    be->device = p->device;
    be->model = m;
    be->hp = tdm_model_hparams(m);
    be->kl = *tdm_kv_pool_layout(pool);
    be->max_rows = p->max_batch_tokens;
    be->max_logits = p->max_logits;
    be->n_ctx = p->n_ctx;
    if (cuda_setup(be, pool) != TDM_OK) {
        tdm_error_set(err, be->err.code, "CUDA backend: %s", be->err.msg);
        cuda_destroy(be);
        return NULL;
    }
    return be;
}

static const char *cuda_kernel_name(const void *vbe)
{
    return ((const cuda_be_t *)vbe)->name;
}

static const char *cuda_errmsg(const void *vbe)
{
    return ((const cuda_be_t *)vbe)->err.msg;
}

static void *cuda_kv_device_base(const void *vbe)
{
    return ((const cuda_be_t *)vbe)->kv;
}

static float *cuda_alloc(void *vbe, size_t n)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (be->n_allocs == be->cap_allocs) {
        size_t cap = be->cap_allocs ? be->cap_allocs * 2 : 16;
        void **a = (void **)realloc(be->allocs, cap * sizeof *a);
        if (!a)
            return NULL;
        be->allocs = a;
        be->cap_allocs = cap;
    }
    size_t bytes = n ? n * sizeof(float) : sizeof(float);
    float *d = NULL;
    cudaError_t ce = cudaMalloc((void **)&d, bytes);
    if (ce != cudaSuccess) {
        tdm_cuda_fail(be, tdm_cuda_status(ce), "cudaMalloc(%zu): %s (%s:%d)", bytes,
                      cudaGetErrorString(ce), __FILE__, __LINE__);
        return NULL;
    }
    be->allocs[be->n_allocs++] = d;
    ce = cudaMemsetAsync(d, 0, bytes, be->stream);
    if (ce != cudaSuccess) {
        tdm_cuda_fail(be, tdm_cuda_status(ce), "cudaMemsetAsync: %s (%s:%d)",
                      cudaGetErrorString(ce), __FILE__, __LINE__);
        return NULL;
    }
    return d;
}

// ---- the rows of a pass ----

int tdm_cuda_check_pass(cuda_be_t *be, const char *op, const uint32_t *pos, uint32_t n)
{
    if (!be->pass.active || pos != be->pass.h_pos || n != be->pass.n_rows)
        return tdm_cuda_fail(be, TDM_EINTERNAL,
                             "%s: called with rows that begin did not stage (begin must start "
                             "every pass)",
                             op);
    return TDM_OK;
}

// Checks every row's sequence, token and position against the backend's bounds; sets
// *n_seqs to the highest sequence + 1. Returns 0 or TDM_EINVALID naming the row.
static int begin_check_rows(cuda_be_t *be, const tdm_fwd_rows_t *rows, const int32_t *tokens,
                            uint32_t *n_seqs)
{
    *n_seqs = 0;
    for (uint32_t t = 0; t < rows->n; t++) {
        if (rows->seq[t] >= be->max_rows)
            return tdm_cuda_fail(be, TDM_EINVALID, "begin: row %u: seq %u >= %u", t, rows->seq[t],
                                 be->max_rows);
        if (tokens[t] < 0 || (uint32_t)tokens[t] >= be->hp->n_vocab)
            return tdm_cuda_fail(be, TDM_EINVALID, "begin: row %u: token %d out of the vocabulary",
                                 t, tokens[t]);
        if (rows->pos[t] >= be->n_ctx)
            return tdm_cuda_fail(be, TDM_EINVALID, "begin: row %u: position %u >= n_ctx %u", t,
                                 rows->pos[t], be->n_ctx);
        if (rows->seq[t] + 1 > *n_seqs)
            *n_seqs = rows->seq[t] + 1;
    }
    return TDM_OK;
}

// Writes the block tables of the n_seqs sequences to table (room for cap entries): for each,
// the blocks that cover its positions in the pass, and its offset into them in
// be->h_seq_off. Sets *n_table to the entries written. Returns 0, TDM_EINVALID (a table too
// short, a block outside the pool) or TDM_ERESOURCE (more entries than cap).
static int begin_stage_tables(cuda_be_t *be, const tdm_fwd_rows_t *rows, uint32_t n_seqs,
                              uint32_t *table, size_t cap, size_t *n_table)
{
    uint32_t *need = be->h_seq_need, *soff = be->h_seq_off, bs = be->kl.block_size;
    memset(need, 0, n_seqs * sizeof *need);
    for (uint32_t t = 0; t < rows->n; t++) {
        uint32_t s = rows->seq[t], nb = rows->pos[t] / bs + 1;
        need[s] = nb > need[s] ? nb : need[s];
    }
    size_t n = 0;
    for (uint32_t s = 0; s < n_seqs; s++) {
        soff[s] = (uint32_t)n;
        if (need[s] == 0)
            continue;
        const tdm_batch_seq_t *sq = &rows->seqs[s];
        if (sq->n_blocks < need[s])
            return tdm_cuda_fail(be, TDM_EINVALID,
                                 "begin: seq %u needs %u blocks, its table has %u", s, need[s],
                                 sq->n_blocks);
        if (n + need[s] > cap)
            return tdm_cuda_fail(be, TDM_ERESOURCE,
                                 "begin: the block tables of this pass exceed the %zu entries "
                                 "staged per pass",
                                 cap);
        for (uint32_t j = 0; j < need[s]; j++) {
            if (sq->blocks[j] >= be->n_blocks)
                return tdm_cuda_fail(be, TDM_EINVALID,
                                     "begin: seq %u: block %u is outside the pool (%u blocks)", s,
                                     sq->blocks[j], be->n_blocks);
            table[n + j] = sq->blocks[j];
        }
        n += need[s];
    }
    *n_table = n;
    return TDM_OK;
}

// Writes the rows ordered by sequence to run_rows [n] (a stable counting sort keeps each
// sequence's positions in order), and the starts of the runs of rows that share a KV block
// to run_start [n_runs + 1] (the last is n). Returns n_runs. Cannot fail.
static uint32_t begin_stage_runs(cuda_be_t *be, const tdm_fwd_rows_t *rows, uint32_t n_seqs,
                                 uint32_t *run_rows, uint32_t *run_start)
{
    uint32_t *cnt = be->h_seq_count, n = rows->n, bs = be->kl.block_size;
    memset(cnt, 0, (n_seqs + 1) * sizeof *cnt);
    for (uint32_t t = 0; t < n; t++)
        cnt[rows->seq[t] + 1]++;
    for (uint32_t s = 0; s < n_seqs; s++)
        cnt[s + 1] += cnt[s];
    for (uint32_t t = 0; t < n; t++)
        run_rows[cnt[rows->seq[t]]++] = t;
    uint32_t n_runs = 0;
    for (uint32_t r = 0; r < n; r++) {
        uint32_t t = run_rows[r];
        if (r > 0) {
            uint32_t u = run_rows[r - 1];
            if (rows->seq[u] == rows->seq[t] && rows->pos[u] / bs == rows->pos[t] / bs)
                continue;
        }
        run_start[n_runs++] = r;
    }
    run_start[n_runs] = n;
    return n_runs;
}

// Copies the pass's rows to the device in one transfer: tokens, positions, each row's block
// table offset, the logit rows, the rows grouped into runs that write one KV block (ordered
// by sequence and position, as kv_store needs for q8), and the block tables of the sequences
// (the blocks that cover each sequence's positions in the pass).
static int cuda_begin(void *vbe, const tdm_fwd_rows_t *rows, const int32_t *tokens,
                      const uint32_t *logit_rows, uint32_t n_logits)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    be->pass.active = false;
    tdm_error_clear(&be->err);
    uint32_t n = rows->n, n_seqs = 0;
    if (n == 0 || n > be->max_rows || n_logits > be->max_logits)
        return tdm_cuda_fail(be, TDM_EINVALID,
                             "begin: %u rows and %u logit rows (at most %u and %u)", n, n_logits,
                             be->max_rows, be->max_logits);
    TDM_CUDA_TRY(be, cudaSetDevice(be->device));
    if (be->staged_recorded) // the previous upload has left h_stage
        TDM_CUDA_TRY(be, cudaEventSynchronize(be->staged));
    int rc = begin_check_rows(be, rows, tokens, &n_seqs);
    if (rc != TDM_OK)
        return rc;

    uint32_t *h = be->h_stage;
    size_t o_tok = 0, o_pos = o_tok + n, o_tab = o_pos + n, o_lr = o_tab + n,
           o_rr = o_lr + n_logits, o_rs = o_rr + n, o_table = o_rs + n + 1, n_table = 0;
    memcpy(h + o_tok, tokens, n * sizeof(uint32_t));
    memcpy(h + o_pos, rows->pos, n * sizeof(uint32_t));
    for (uint32_t k = 0; k < n_logits; k++) {
        if (logit_rows[k] >= n)
            return tdm_cuda_fail(be, TDM_EINVALID, "begin: logit row %u is %u, beyond %u rows", k,
                                 logit_rows[k], n);
        h[o_lr + k] = logit_rows[k];
    }
    rc = begin_stage_tables(be, rows, n_seqs, h + o_table, be->stage_words - o_table, &n_table);
    if (rc != TDM_OK)
        return rc;
    for (uint32_t t = 0; t < n; t++)
        h[o_tab + t] = be->h_seq_off[rows->seq[t]];
    uint32_t n_runs = begin_stage_runs(be, rows, n_seqs, h + o_rr, h + o_rs);

    size_t words = o_table + n_table;
    TDM_CUDA_TRY(be, cudaMemcpyAsync(be->d_stage, h, words * sizeof(uint32_t),
                                     cudaMemcpyHostToDevice, be->stream));
    TDM_CUDA_TRY(be, cudaEventRecord(be->staged, be->stream));
    be->staged_recorded = true;

    cuda_pass_t *ps = &be->pass;
    uint32_t *d = be->d_stage;
    ps->n_rows = n;
    ps->n_logits = n_logits;
    ps->n_runs = n_runs;
    ps->tokens = (const int32_t *)(d + o_tok);
    ps->pos = d + o_pos;
    ps->tab_off = d + o_tab;
    ps->logit_rows = d + o_lr;
    ps->run_rows = d + o_rr;
    ps->run_start = d + o_rs;
    ps->table = d + o_table;
    ps->h_tokens = tokens;
    ps->h_pos = rows->pos;
    ps->h_logit_rows = logit_rows;
    ps->active = true;
    return TDM_OK;
}

// ---- ops ----

static int cuda_embed(void *vbe, const tdm_weight_t *emb, const int32_t *tokens, uint32_t n,
                      float *x)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (!be->pass.active || tokens != be->pass.h_tokens || n != be->pass.n_rows)
        return tdm_cuda_fail(be, TDM_EINTERNAL,
                             "embed: called with tokens that begin did not stage");
    const void *table = tdm_cuda_weight_gemm(be, emb);
    if (!table)
        return be->err.code;
    return tdm_cuda_op_embed(be, table, n, (uint32_t)emb->n_in, x);
}

static int cuda_rmsnorm(void *vbe, const float *x, const tdm_weight_t *w, uint32_t n, float eps,
                        float *out)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (w->type != TDM_GGML_TYPE_F32)
        return tdm_cuda_fail(be, TDM_EINVALID, "rmsnorm: weight '%s' is not F32", w->name);
    const float *g = tdm_cuda_weight_vec(be, w);
    if (!g)
        return be->err.code;
    return tdm_cuda_op_rmsnorm(be, x, g, n, (uint32_t)w->n_in, eps, out);
}

// y[t][o] = sum_i x[t][i] W[o][i]: with row-major x [n][K] and W [N][K] this is, in cuBLAS's
// column-major terms, Y (N x n) = W^T(K x N)^T * X (K x n), all leading dimensions natural.
static int cuda_matmul(void *vbe, const float *x, uint32_t n, uint32_t n_w,
                       const tdm_weight_t *const *w, float *const *out)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    size_t K = w[0]->n_in;
    if (n == 0 || n > be->max_rows || K > be->max_in)
        return tdm_cuda_fail(be, TDM_EINTERNAL, "matmul: %u rows of %zu values (at most %u of %zu)",
                             n, K, be->max_rows, be->max_in);
    for (uint32_t k = 0; k < n_w; k++)
        if (w[k]->n_in != K || w[k]->n_out > INT32_MAX)
            return tdm_cuda_fail(be, TDM_EINTERNAL, "matmul: weight '%s' does not fit the batch",
                                 w[k]->name);
    int rc = tdm_cuda_op_to_gemm(be, x, (size_t)n * K, be->xh);
    if (rc != TDM_OK)
        return rc;
    const float one = 1.0f, zero = 0.0f;
    for (uint32_t k = 0; k < n_w; k++) {
        const void *W = tdm_cuda_weight_gemm(be, w[k]);
        if (!W)
            return be->err.code;
        TDM_CUBLAS_TRY(be, cublasGemmEx(be->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w[k]->n_out,
                                        (int)n, (int)K, &one, W, be->gemm_type, (int)K, be->xh,
                                        be->gemm_type, (int)K, &zero, out[k], CUDA_R_32F,
                                        (int)w[k]->n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return TDM_OK;
}

static int cuda_add_bias(void *vbe, float *x, const tdm_weight_t *b, uint32_t n)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (b->type != TDM_GGML_TYPE_F32)
        return tdm_cuda_fail(be, TDM_EINVALID, "add_bias: weight '%s' is not F32", b->name);
    const float *bias = tdm_cuda_weight_vec(be, b);
    if (!bias)
        return be->err.code;
    return tdm_cuda_op_add_bias(be, x, bias, n, (uint32_t)b->n_in);
}

// Every layer has the same RoPE here: models whose layers differ (sliding-window layers' base)
// or that scale positions need arch_features, which this backend does not declare.
static int cuda_rope(void *vbe, uint32_t layer, float *q, float *k, const tdm_fwd_rows_t *rows)
{
    (void)layer;
    cuda_be_t *be = (cuda_be_t *)vbe;
    int rc = tdm_cuda_check_pass(be, "rope", rows->pos, rows->n);
    return rc != TDM_OK ? rc : tdm_cuda_op_rope(be, q, k);
}

static int cuda_kv_store(void *vbe, uint32_t layer, const float *k, const float *v,
                         const tdm_fwd_rows_t *rows)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    int rc = tdm_cuda_check_pass(be, "kv_store", rows->pos, rows->n);
    if (rc != TDM_OK)
        return rc;
    if (layer >= be->kl.n_layers)
        return tdm_cuda_fail(be, TDM_EINTERNAL, "kv_store: layer %u of %u", layer, be->kl.n_layers);
    return tdm_cuda_op_kv_store(be, layer, k, v);
}

static int cuda_attention(void *vbe, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                          float *out)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    int rc = tdm_cuda_check_pass(be, "attention", rows->pos, rows->n);
    if (rc != TDM_OK)
        return rc;
    if (layer >= be->kl.n_layers)
        return tdm_cuda_fail(be, TDM_EINTERNAL, "attention: layer %u of %u", layer,
                             be->kl.n_layers);
    return tdm_cuda_op_attention(be, layer, q, out);
}

static int cuda_swiglu(void *vbe, const float *gate, const float *up, size_t count, float *out)
{
    return tdm_cuda_op_swiglu((cuda_be_t *)vbe, gate, up, count, out);
}

static int cuda_add(void *vbe, float *x, const float *y, size_t count)
{
    return tdm_cuda_op_add((cuda_be_t *)vbe, x, y, count);
}

static int cuda_gather_rows(void *vbe, const float *src, const uint32_t *rows, uint32_t n,
                            uint32_t dim, float *dst)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (!be->pass.active || rows != be->pass.h_logit_rows || n != be->pass.n_logits)
        return tdm_cuda_fail(be, TDM_EINTERNAL,
                             "gather_rows: called with rows that begin did not stage");
    return tdm_cuda_op_gather(be, src, n, dim, dst);
}

static int cuda_read(void *vbe, const float *src, size_t count, float *host_dst)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    TDM_CUDA_TRY(be, cudaMemcpyAsync(host_dst, src, count * sizeof(float), cudaMemcpyDeviceToHost,
                                     be->stream));
    TDM_CUDA_TRY(be, cudaStreamSynchronize(be->stream));
    return TDM_OK;
}

static int cuda_sync(void *vbe)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    TDM_CUDA_TRY(be, cudaStreamSynchronize(be->stream));
    return TDM_OK;
}

// ---- test accessors (cuda_backend.h) ----

extern "C" int tdm_model_cuda_write(void *vbe, float *dst, const float *host_src, size_t count)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    TDM_CUDA_TRY(be, cudaMemcpyAsync(dst, host_src, count * sizeof(float), cudaMemcpyHostToDevice,
                                     be->stream));
    TDM_CUDA_TRY(be, cudaStreamSynchronize(be->stream));
    return TDM_OK;
}

extern "C" int tdm_model_cuda_read_kv(void *vbe, uint64_t offset, size_t bytes, void *host_dst)
{
    cuda_be_t *be = (cuda_be_t *)vbe;
    if (offset > be->block_bytes * be->n_blocks || bytes > be->block_bytes * be->n_blocks - offset)
        return tdm_cuda_fail(be, TDM_EINVALID, "read_kv: %zu bytes at %llu are outside the pool",
                             bytes, (unsigned long long)offset);
    TDM_CUDA_TRY(
        be, cudaMemcpyAsync(host_dst, be->kv + offset, bytes, cudaMemcpyDeviceToHost, be->stream));
    TDM_CUDA_TRY(be, cudaStreamSynchronize(be->stream));
    return TDM_OK;
}

static void cuda_device_bytes(const void *vbe, uint64_t *weights, uint64_t *workspace)
{
    const cuda_be_t *be = (const cuda_be_t *)vbe;
    *weights = be->warena_bytes;
    *workspace = (uint64_t)be->blas_ws_bytes + (uint64_t)be->max_rows * be->max_in * 2 +
                 (uint64_t)be->stage_words * sizeof(uint32_t);
}

// C linkage from the declaration in cuda_backend.h
const tdm_backend_ops_t tdm_model_backend_cuda = {
    .name = "cuda",
    .begin = cuda_begin,
    .sync = cuda_sync,
    .errmsg = cuda_errmsg,
    .kv_device_base = cuda_kv_device_base,
    .device_bytes = cuda_device_bytes,
    .create = cuda_create,
    .destroy = cuda_destroy,
    .kernel_name = cuda_kernel_name,
    .own_bytes = NULL,
    .released_bytes = NULL,
    .alloc = cuda_alloc,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .matmul = cuda_matmul,
    .add_bias = cuda_add_bias,
    .rope = cuda_rope,
    .kv_store = cuda_kv_store,
    .attention = cuda_attention,
    .swiglu = cuda_swiglu,
    .geglu = NULL,   /* Gemma 3 is refused here (arch_features) */
    .moe_ffn = NULL, /* so are models with experts (qwen3moe, Mixtral), naming them */
    .scale = NULL,
    .add = cuda_add,
    .gather_rows = cuda_gather_rows,
    .read = cuda_read,
    .host_memory = false,   /* device buffers: logits come back through read */
    .arch_features = false, /* no sliding windows, QK-norm, post-norms or RoPE scaling yet */
    .kv_groups = false,     /* one block table of every layer (grouped pools are refused) */
};
