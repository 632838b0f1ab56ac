/* cpu.c - the CPU backend's ops (embedding, RMSNorm, RoPE, attention, SwiGLU, GeGLU, the
 * matmul driver) over OpenMP threads; the kernels are in one file per instruction set behind
 * cpu_kernels.h (scalar, AVX2, AVX-VNNI, AVX-512 VNNI, AMX-INT8), the best set the CPU has
 * chosen when the backend is created (TANDEM_CPU_KERNELS caps it).
 *
 * Matmuls with Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights (and Q5_0, rewritten as Q8_0 at
 * load) quantize each activation row to 8 bits in blocks of 32 (scale d = max|x| / 127 kept at
 * f16 precision, as ggml's Q8_0/Q8_1 activations) once per call and run a q8a GEMM. The SIMD
 * sets repack each weight once, at load, into groups of 8 interleaved rows, and a
 * micro-kernel keeps 8 rows x up to 8 tokens of accumulators in registers across the K loop;
 * the scalar set reads the GGUF rows in place. The other weight types (F32, F16, BF16, Q5_1;
 * K-quants too under TANDEM_CPU_KERNELS=f32k) take the f32 path: dequantized a row at a time
 * into per-thread scratch and dotted in f32 (dot_f32). Threads split the rows into chunks of
 * 16; each chunk goes over the tokens in tiles of 64 so its weights stay in L1: batched decode
 * costs little more weight traffic than one token.
 *
 * Batch invariance: every output element (a row of W against one token's activations) is
 * reduced by the same code in the same order whatever the batch holds, threads split work by
 * output rows only, and attention reduces over positions 0..pos in order. So a sequence's
 * logits do not depend on its neighbours in the batch or on how its prompt was chunked.
 *
 * Same bits on every CPU: every kernel set gives the scalar reference's bits on every op it
 * has, the f32 ones (attention's dots and axpys, the f32 matmul path, f16 rounding, softmax's
 * exp and sum, SwiGLU) as well as the activation quantizer and the q8a GEMMs (cpu_kernels.h
 * states each canonical order; tests/unit/test_cpu_kernels.c checks them). The ops written
 * here in plain C (RMSNorm, RoPE, GeGLU, the element-wise adds) are one code for every set.
 * The one exception is TANDEM_CPU_KERNELS=zdot, a comparison option: its AVX-512 row kernels
 * (cpu_avx512.c) are batch invariant but reduce in their own order.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "model/backend.h"
#include "model/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define TDM_X86 1
#endif

#define QK TDM_CPU_QK
#define TOKEN_TILE 64 /* tokens per pass over a weight row tile */

/* A parallel region wakes the other threads of the team: a few microseconds when they spin
 * (OMP_WAIT_POLICY=active, or libgomp's default spin), about 45-60 us through a futex when they
 * sleep (passive waiting, measured on a 2-vCPU VM: docs/performance.md, "OpenMP wait policy").
 * Split in two, an op of S us costs S / 2 plus the wake-up, so it stays on the calling thread
 * while S is under about twice the wake-up: up to par_min values (at 0.3-1 ns a value for the
 * element-wise ops, quantization and RMSNorm). The two thresholds were tuned on decode at
 * batch 8 and 32 (docs/performance.md, "Fewer thread wake-ups"). Which thread computes a row
 * never changes its bits, so they do not touch batch invariance. */
#define TDM_PAR_MIN_SPIN 8192
#define TDM_PAR_MIN_PASSIVE 65536

typedef struct cpu_be {
    const tdm_model_t *model;
    const tdm_llama_hparams_t *hp;
    tdm_kv_pool_t *pool;
    tdm_kv_layout_t kl;
    uint64_t block_bytes, rec_bytes;
    int n_threads;
    uint32_t max_rows, n_ctx;
    const tdm_cpu_isa_t *isa;    /* the kernels (cpu_kernels.h) */
    const tdm_cpu_isa_t *scalar; /* the reference, for what isa leaves NULL */
    const tdm_cpu_isa_t *narrow; /* 256-bit set over the same packed layout for a lone token
                                    (isa's 512-bit tile holds two tokens per register), or NULL */
    bool avx512;     /* AVX-512 F/BW/VL + VNNI kernels for Q4_0/Q4_1/Q8_0 (supersede isa's dots) */
    bool amx;        /* isa is the AMX set (cpu_amx.c) */
    bool kquant_f32; /* K-quants on the f32 path (TANDEM_CPU_KERNELS=f32k, for comparison) */
    char name[32];
    struct cpu_wkernel *wk; /* [n_wk] the kernel of each quantized matrix, chosen at load */
    size_t n_wk;
    uint64_t own_bytes; /* bytes of every buffer from cpu_alloc (scratch, packed weights) */
    uint64_t released;  /* model file bytes released after repacking (tdm_gguf_release) */
    void **allocs;      /* every buffer from cpu_alloc, freed at destroy */
    size_t n_allocs, cap_allocs;
    size_t par_min;   /* fewest values an op splits among threads (TDM_PAR_MIN_*) */
    size_t max_in;    /* widest matmul input (elements) */
    q8a_block_t *act; /* [max_rows][max_in / 32] quantized activations */
    uint8_t *zact;    /* [max_rows][zact stride] activations in the AVX-512 layout */
    uint8_t *zprep;   /* [n_threads][zprep stride] one weight row prepared for AVX-512 */
    float *wrow;      /* [n_threads][max_in] dequantized weight rows */
    float *scores;    /* [n_threads][heads per KV head][n_ctx] attention scores */
    float *kvrow;     /* [n_threads][heads per KV head + 2][head_dim] K/V rows, queries */
    float *rope_cs;   /* [max_rows][rope_dim] cos, sin pairs */
    float kq_scale;   /* attention scores' scale: 1 / sqrt(head_dim), or 1 when the model
                         scales q itself (hparams.attn_q_scale) */
} cpu_be_t;

/* How one weight is multiplied, chosen once when the backend is created: a q8a GEMM over the
 * matrix in place or repacked (cpu_kernels.h), AVX-512's prepared rows, or the f32 path. */
typedef struct cpu_wkernel {
    const tdm_weight_t *w;
    tdm_cpu_qmat_t m;      /* what gemm reads */
    tdm_cpu_gemm_fn gemm;  /* NULL: f32 path (or zdot) */
    tdm_cpu_gemm_fn gemm1; /* for the last token of an odd count (be->narrow's), or NULL */
    bool zdot;             /* the AVX-512 kernels on the rows in place */
} cpu_wkernel_t;

/* ---- dispatch helpers ---- */

static float dot_f32(const cpu_be_t *be, const float *x, const float *y, size_t n)
{
    return be->isa->dot_f32(x, y, n);
}

static void quantize_act(const cpu_be_t *be, const float *x, size_t n, q8a_block_t *out)
{
    be->isa->quantize_act(x, n, out);
}

/* The kernel record of w: the one chosen at load, or (for a weight the backend was not
 * created with) one over the rows in place, which gives the same bits. */
static const cpu_wkernel_t *cpu_wkernel_for(const cpu_be_t *be, const tdm_weight_t *w,
                                            cpu_wkernel_t *tmp)
{
    for (size_t i = 0; i < be->n_wk; i++)
        if (be->wk[i].w == w)
            return &be->wk[i];
    int qt = tdm_cpu_qtype_of(w->type);
    bool kquant = qt >= TDM_CPU_Q4_K;
    *tmp = (cpu_wkernel_t){.w = w};
    if (qt < 0 || w->n_in % (kquant ? 8 * QK : QK) != 0 || (kquant && be->kquant_f32))
        return tmp;
    tmp->m =
        (tdm_cpu_qmat_t){w->data, w->row_bytes, 8 * w->row_bytes, w->n_out, w->n_in / QK, false};
    tmp->zdot = be->avx512 && !kquant; /* zdot has no K-quant kernels: those take the GEMM */
    tmp->gemm = tmp->zdot ? NULL : be->isa->packed ? be->scalar->gemm[qt] : be->isa->gemm[qt];
    return tmp;
}

/* ---- ops ---- */

static float *cpu_alloc(void *vbe, size_t n)
{
    cpu_be_t *be = vbe;
    if (be->n_allocs == be->cap_allocs) {
        size_t cap = be->cap_allocs ? be->cap_allocs * 2 : 16;
        void **a = realloc(be->allocs, cap * sizeof *a);
        if (!a)
            return NULL;
        be->allocs = a;
        be->cap_allocs = cap;
    }
    size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (!p)
        return NULL;
    memset(p, 0, bytes ? bytes : 64);
    be->allocs[be->n_allocs++] = p;
    be->own_bytes += bytes ? bytes : 64;
    return p;
}

static void cpu_destroy(void *vbe)
{
    cpu_be_t *be = vbe;
    if (!be)
        return;
    for (size_t i = 0; i < be->n_allocs; i++)
        free(be->allocs[i]);
    free(be->allocs);
    free(be);
}

/* Picks the kernels: the best the CPU has, capped by TANDEM_CPU_KERNELS; names them.
 * TANDEM_CPU_KERNELS=scalar|avx2|vnni|avx512|amx caps the GEMM family (tests compare them; every
 * family gives the same bits); "zdot" selects the older AVX-512 per-row kernels, kept for
 * comparison (not bitwise equal to the others); "f32k" is the best with the K-quants on the
 * older f32 path (dequantized rows, for comparison); unset or "auto" is the best. */
static void cpu_pick_kernels(cpu_be_t *be)
{
    const char *cap = getenv("TANDEM_CPU_KERNELS");
    int level = 5; /* 0 scalar, 1 avx2, 2 vnni, 3 avx512, 4 amx, 5 auto */
    static const char *const names[] = {"scalar", "avx2", "vnni", "avx512", "amx"};
    for (int i = 0; cap && i < 5; i++)
        if (strcmp(cap, names[i]) == 0)
            level = i;
    be->kquant_f32 = cap && strcmp(cap, "f32k") == 0;
    const tdm_cpu_isa_t *isa = NULL;
    if (level >= 4)
        isa = tdm_cpu_isa_amx();
    if (!isa && level >= 3)
        isa = tdm_cpu_isa_avx512();
    if (!isa && level >= 2)
        isa = tdm_cpu_isa_vnni();
    if (!isa && level >= 1)
        isa = tdm_cpu_isa_avx2();
    be->scalar = tdm_cpu_isa_scalar();
    be->isa = isa ? isa : be->scalar;
    be->avx512 = cap && strcmp(cap, "zdot") == 0 && tdm_cpu_isa_avx2() && tdm_cpu_has_avx512vnni();
    if (be->avx512)
        be->isa = tdm_cpu_isa_avx2();
    /* AVX-512's packed tile (AMX's below 8 tokens) holds two tokens per register, so a lone token
     * (a batch-1 step, the odd row of a batch) wastes half of it; the 256-bit set over the same
     * layout gives the same bits (cpu_kernels.h) in half the width */
    const tdm_cpu_isa_t *n256 = tdm_cpu_isa_vnni();
    if (!n256)
        n256 = tdm_cpu_isa_avx2();
    be->amx = isa && isa == tdm_cpu_isa_amx();
    bool wide = isa && (isa == tdm_cpu_isa_avx512() || be->amx);
    be->narrow = wide && n256 && n256->packed && isa->packed ? n256 : NULL;
    snprintf(be->name, sizeof be->name, "cpu/%s%s", be->avx512 ? "avx512-zdot" : be->isa->name,
             be->kquant_f32 ? "+f32k" : "");
}

/* The per-thread and per-row scratch, sized for the largest matmul input (max_in). */
static int cpu_scratch_new(cpu_be_t *be, tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = be->hp;
    size_t max_in = hp->n_embd;
    if (hp->n_ff > max_in)
        max_in = hp->n_ff;
    if ((size_t)hp->n_heads * hp->head_dim > max_in)
        max_in = (size_t)hp->n_heads * hp->head_dim;
    be->max_in = max_in;
    size_t nt = (size_t)be->n_threads;
    size_t act_blocks = (size_t)be->max_rows * ((max_in + QK - 1) / QK);
    be->act = (q8a_block_t *)cpu_alloc(be, act_blocks * sizeof(q8a_block_t) / sizeof(float));
    be->wrow = cpu_alloc(be, nt * max_in);
    size_t group = hp->n_heads / hp->n_kv_heads;
    be->scores = cpu_alloc(be, nt * group * be->n_ctx);
    be->kvrow = cpu_alloc(be, nt * (group + 2) * hp->head_dim);
    be->rope_cs = cpu_alloc(be, (size_t)be->max_rows * hp->rope_dim);
    size_t znb = (max_in + QK - 1) / QK;
    be->zact =
        (uint8_t *)cpu_alloc(be, (size_t)be->max_rows * tdm_cpu_zact_stride(znb) / sizeof(float));
    be->zprep = (uint8_t *)cpu_alloc(be, nt * tdm_cpu_zprep_stride(znb) / sizeof(float));
    if (!be->act || !be->wrow || !be->scores || !be->kvrow || !be->rope_cs || !be->zact ||
        !be->zprep) {
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory allocating CPU backend scratch");
    }
    return TDM_OK;
}

/* The kernel record of one quantized weight: a GEMM over the rows repacked for the kernel
 * set (the copy costs the matrix's own size once per engine, counted in own_bytes) or in
 * place; the other types keep the f32 path. Fails only on out of memory. */
static int cpu_wkernel_init(cpu_be_t *be, const tdm_weight_t *w, cpu_wkernel_t *wk)
{
    cpu_wkernel_t tmp;
    be->n_wk = 0; /* cpu_wkernel_for builds the in-place record */
    *wk = *cpu_wkernel_for(be, w, &tmp);
    int qt = tdm_cpu_qtype_of(w->type);
    if (!wk->gemm || !be->isa->packed)
        return TDM_OK;
    size_t bytes = tdm_cpu_pack_bytes(w->type, w->n_out, wk->m.nb);
    uint8_t *dst = (uint8_t *)cpu_alloc(be, (bytes + sizeof(float) - 1) / sizeof(float));
    if (!dst)
        return TDM_ERESOURCE;
    tdm_cpu_pack(w->type, w->data, w->n_out, wk->m.nb, dst);
    /* the forward pass reads the copy only: the file's pages can leave memory (not those of
     * a tied output matrix, whose rows the embedding lookup still reads) */
    if (w->data != tdm_model_token_embd(be->model)->data)
        be->released +=
            tdm_gguf_release(tdm_model_gguf(be->model), w->data, (size_t)w->row_bytes * w->n_out);
    wk->m.data = dst;
    wk->m.group_bytes = tdm_cpu_pack_bytes(w->type, 8, wk->m.nb);
    wk->m.packed = true;
    wk->gemm = be->isa->gemm[qt];
    wk->gemm1 = be->narrow ? be->narrow->gemm[qt] : NULL;
    return TDM_OK;
}

/* Q5_0 blocks (ggml's block_q5_0: f16 d, the 5th bits in a little-endian u32 qh, the low
 * nibbles in qs[16]; x_j = (q_j - 16) d) rewritten as Q8_0 blocks (f16 d, int8 qs[32]; x_j =
 * q_j d) with the same d and q_j - 16 in -16..15: the same values, so a Q8_0 kernel computes
 * exactly the integer sums a Q5_0 one would. n_blocks blocks from src to dst. */
static void q5_0_to_q8_0(const uint8_t *src, uint64_t n_blocks, uint8_t *dst)
{
    for (uint64_t i = 0; i < n_blocks; i++, src += 22, dst += 34) {
        uint32_t qh;
        memcpy(dst, src, 2); /* d */
        memcpy(&qh, src + 2, sizeof qh);
        const uint8_t *qs = src + 6;
        int8_t *q = (int8_t *)(dst + 2);
        for (int j = 0; j < QK / 2; j++) {
            int h0 = (int)((qh >> j) << 4) & 0x10, h1 = (int)(qh >> (j + 12)) & 0x10;
            q[j] = (int8_t)(((qs[j] & 0x0f) | h0) - 16);
            q[j + QK / 2] = (int8_t)(((qs[j] >> 4) | h1) - 16);
        }
    }
}

/* A Q5_0 matrix runs on the Q8_0 kernels over a converted copy (q5_0_to_q8_0): 34 bytes per
 * 32 values read instead of 22, against dequantizing every row to f32 for every pass on the
 * f32 path. Packed kernel sets pack from a temporary copy (one packed copy is kept); the
 * in-place ones (scalar) keep the converted copy. The file's pages of the Q5_0 rows are
 * released. Not under TANDEM_CPU_KERNELS=zdot (its row kernels read the weight's own type).
 * Fails only on out of memory. */
static int cpu_wkernel_init_q5_0(cpu_be_t *be, const tdm_weight_t *w, cpu_wkernel_t *wk)
{
    uint64_t n_blocks = w->n_out * (w->n_in / QK);
    size_t bytes = (size_t)n_blocks * 34;
    bool keep = !be->isa->packed;
    uint8_t *copy = keep ? (uint8_t *)cpu_alloc(be, (bytes + sizeof(float) - 1) / sizeof(float))
                         : malloc(bytes);
    if (!copy)
        return TDM_ERESOURCE;
    q5_0_to_q8_0(w->data, n_blocks, copy);
    tdm_weight_t w8 = *w;
    w8.type = TDM_GGML_TYPE_Q8_0;
    w8.row_bytes = (w->n_in / QK) * 34;
    w8.data = copy;
    int rc = cpu_wkernel_init(be, &w8, wk);
    if (!keep)
        free(copy);
    if (rc != TDM_OK)
        return rc;
    wk->w = w; /* the record answers for the model's weight (cpu_wkernel_for) */
    if (w->data != tdm_model_token_embd(be->model)->data)
        be->released +=
            tdm_gguf_release(tdm_model_gguf(be->model), w->data, (size_t)w->row_bytes * w->n_out);
    return TDM_OK;
}

/* Chooses the kernel of every matrix the forward pass multiplies (cpu_wkernel_init). */
static int cpu_wkernels_new(cpu_be_t *be, tdm_error_t *err)
{
    uint32_t n_layers = be->hp->n_layers;
    size_t n = (size_t)n_layers * 7 + 1;
    cpu_wkernel_t *wk = (cpu_wkernel_t *)cpu_alloc(be, n * sizeof *wk / sizeof(float) + 1);
    const tdm_weight_t **ws = (const tdm_weight_t **)cpu_alloc(be, n * 2);
    if (!wk || !ws)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory allocating CPU kernel table");
    for (uint32_t l = 0; l < n_layers; l++) {
        const tdm_layer_weights_t *lw = tdm_model_layer(be->model, l);
        const tdm_weight_t *lws[7] = {&lw->wq,     &lw->wk,   &lw->wv,    &lw->wo,
                                      &lw->w_gate, &lw->w_up, &lw->w_down};
        memcpy(ws + (size_t)l * 7, lws, sizeof lws);
    }
    ws[n - 1] = tdm_model_output(be->model);
    for (size_t i = 0; i < n; i++) {
        bool q5_0 = ws[i]->type == TDM_GGML_TYPE_Q5_0 && ws[i]->n_in % QK == 0 && !be->avx512;
        if ((q5_0 ? cpu_wkernel_init_q5_0(be, ws[i], &wk[i])
                  : cpu_wkernel_init(be, ws[i], &wk[i])) != TDM_OK)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory repacking weights");
    }
    be->wk = wk;
    be->n_wk = n;
    return TDM_OK;
}

/* par_min from the OpenMP wait policy (libgomp's reading: surrounding blanks ignored, any
 * case), or TANDEM_CPU_PAR_MIN (a whole number >= 1: the tests set 1 to run every op's
 * parallel path). TDM_EINVALID naming the variable for any other value. */
static int cpu_pick_par_min(cpu_be_t *be, tdm_error_t *err)
{
    const char *wait = getenv("OMP_WAIT_POLICY");
    bool passive = false;
    if (wait) {
        wait += strspn(wait, " \t");
        passive = strncasecmp(wait, "passive", 7) == 0 && wait[7 + strspn(wait + 7, " \t")] == '\0';
    }
    be->par_min = passive ? TDM_PAR_MIN_PASSIVE : TDM_PAR_MIN_SPIN;
    const char *v = getenv("TANDEM_CPU_PAR_MIN");
    if (!v || !*v)
        return TDM_OK;
    char *end;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    if (errno || *end || n < 1 || n > SIZE_MAX || v[0] == '-')
        return tdm_error_set(err, TDM_EINVALID,
                             "TANDEM_CPU_PAR_MIN: expected a whole number of values >= 1, got '%s'",
                             v);
    be->par_min = (size_t)n;
    return TDM_OK;
}

static void *cpu_create(const tdm_model_t *m, const tdm_engine_params_t *p, tdm_kv_pool_t *pool,
                        tdm_error_t *err)
{
    cpu_be_t *be = calloc(1, sizeof *be);
    if (!be) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    be->model = m;
    be->hp = tdm_model_hparams(m);
    be->pool = pool;
    be->kl = *tdm_kv_pool_layout(pool);
    be->block_bytes = tdm_kv_block_bytes(&be->kl);
    be->rec_bytes = tdm_kv_record_bytes(&be->kl);
    be->n_threads = p->n_threads > 0 ? p->n_threads : omp_get_max_threads();
    be->max_rows = p->max_batch_tokens;
    be->n_ctx = p->n_ctx;
    be->kq_scale = be->hp->attn_q_scale > 0.0f ? 1.0f : 1.0f / sqrtf((float)be->hp->head_dim);
    cpu_pick_kernels(be);
    if (cpu_pick_par_min(be, err) != TDM_OK || cpu_scratch_new(be, err) != TDM_OK ||
        cpu_wkernels_new(be, err) != TDM_OK) {
        cpu_destroy(be);
        return NULL;
    }
    return be;
}

static uint64_t cpu_own_bytes(const void *vbe)
{
    return ((const cpu_be_t *)vbe)->own_bytes;
}

static uint64_t cpu_released_bytes(const void *vbe)
{
    return ((const cpu_be_t *)vbe)->released;
}

static const char *cpu_kernel_name(const void *vbe)
{
    return ((const cpu_be_t *)vbe)->name;
}

static int cpu_embed(void *vbe, const tdm_weight_t *emb, const int32_t *tokens, uint32_t n,
                     float *x)
{
    cpu_be_t *be = vbe;
    size_t E = emb->n_in;
    int rc = TDM_OK;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (n * E >= be->par_min)
    for (uint32_t t = 0; t < n; t++) {
        const uint8_t *row = (const uint8_t *)emb->data + (size_t)tokens[t] * emb->row_bytes;
        if (tdm_ggml_dequantize_row(emb->type, row, x + t * E, (int64_t)E) != TDM_OK) {
#pragma omp atomic write
            rc = TDM_EINVALID;
        }
    }
    return rc;
}

static int cpu_rmsnorm(void *vbe, const float *x, const tdm_weight_t *w, uint32_t n, float eps,
                       float *out)
{
    cpu_be_t *be = vbe;
    size_t E = w->n_in;
    if (w->type != TDM_GGML_TYPE_F32)
        return TDM_EINVALID;
    const float *g = w->data;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (n * E >= be->par_min)
    for (uint32_t t = 0; t < n; t++) {
        const float *xr = x + t * E;
        float *o = out + t * E;
        double sum = 0.0;
        for (size_t i = 0; i < E; i++)
            sum += (double)(xr[i] * xr[i]);
        float mean = (float)(sum / (double)E);
        float scale = 1.0f / sqrtf(mean + eps);
        for (size_t i = 0; i < E; i++)
            o[i] = (xr[i] * scale) * g[i];
    }
    return TDM_OK;
}

/* AVX-512: rows [r0, r1) of wk against tokens [t0, t1) from the prepared activations. */
static void matmul_rows_zdot(cpu_be_t *be, const cpu_wkernel_t *wk, uint64_t r0, uint64_t r1,
                             uint32_t t0, uint32_t t1, float *o)
{
#ifdef TDM_X86
    size_t nb = wk->m.nb, zs = tdm_cpu_zact_stride(nb);
    const tdm_weight_t *W = wk->w;
    uint8_t *prep = be->zprep + (size_t)omp_get_thread_num() * tdm_cpu_zprep_stride(nb);
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *wr = wk->m.data + r * W->row_bytes;
        if (t1 - t0 == 1 && nb <= TDM_ZMAX_BLOCKS) {
            o[(size_t)t0 * W->n_out + r] =
                tdm_cpu_zdot_fused1(W->type, wr, nb, be->zact + (size_t)t0 * zs);
            continue;
        }
        tdm_cpu_zrow_prep(W->type, wr, nb, prep);
        for (uint32_t t = t0; t < t1; t += 8) {
            int nt = t1 - t < 8 ? (int)(t1 - t) : 8;
            const uint8_t *tok[8];
            float y[8];
            for (int j = 0; j < nt; j++)
                tok[j] = be->zact + (size_t)(t + (uint32_t)j) * zs;
            tdm_cpu_zdot(prep, nb, tok, y, nt);
            for (int j = 0; j < nt; j++)
                o[(size_t)(t + (uint32_t)j) * W->n_out + r] = y[j];
        }
    }
#else
    (void)be, (void)wk, (void)r0, (void)r1, (void)t0, (void)t1, (void)o;
#endif
}

/* Other types: rows [r0, r1) dequantized to f32 one at a time, dotted with tokens [t0, t1). */
static int matmul_rows_f32(cpu_be_t *be, const tdm_weight_t *W, const float *x, uint64_t r0,
                           uint64_t r1, uint32_t t0, uint32_t t1, float *o)
{
    size_t K = W->n_in;
    float *wrow = be->wrow + (size_t)omp_get_thread_num() * be->max_in;
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)W->data + r * W->row_bytes;
        if (tdm_ggml_dequantize_row(W->type, wr, wrow, (int64_t)K) != TDM_OK)
            return TDM_EINVALID;
        for (uint32_t t = t0; t < t1; t++)
            o[(size_t)t * W->n_out + r] = dot_f32(be, wrow, x + (size_t)t * K, K);
    }
    return TDM_OK;
}

/* Groups [ga, gb) (rows 8 ga .. 8 gb - 1) of wk against tokens [t0, t1). */
static int matmul_groups(cpu_be_t *be, const cpu_wkernel_t *wk, const float *x, uint64_t ga,
                         uint64_t gb, uint32_t t0, uint32_t t1, float *o)
{
    const tdm_weight_t *W = wk->w;
    uint64_t r0 = 8 * ga, r1 = 8 * gb < W->n_out ? 8 * gb : W->n_out;
    if (wk->gemm) {
        size_t nb = wk->m.nb;
        /* an odd token to the narrow set, unless the tiles take any count (AMX) */
        uint32_t n = t1 - t0;
        bool split = wk->gemm1 && (n & 1) && !(be->amx && n >= TDM_AMX_MIN_TOKENS);
        uint32_t n_wide = split ? n - 1 : n;
        if (n_wide)
            wk->gemm(&wk->m, ga, gb, be->act + (size_t)t0 * nb, n_wide, o + (size_t)t0 * W->n_out,
                     W->n_out);
        if (n_wide < n)
            wk->gemm1(&wk->m, ga, gb, be->act + (size_t)(t1 - 1) * nb, 1,
                      o + (size_t)(t1 - 1) * W->n_out, W->n_out);
        return TDM_OK;
    }
    if (wk->zdot) {
        matmul_rows_zdot(be, wk, r0, r1, t0, t1, o);
        return TDM_OK;
    }
    return matmul_rows_f32(be, W, x, r0, r1, t0, t1, o);
}

/* Quantizes the n activation rows for the q8a kernels (and AVX-512's layout). */
static void matmul_quantize(cpu_be_t *be, const float *x, uint32_t n, size_t K)
{
    size_t nb = K / QK;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(be->n_threads) if (n > 1 && n * K >= be->par_min)
    for (uint32_t t = 0; t < n; t++) {
        quantize_act(be, x + t * K, K, be->act + t * nb);
#ifdef TDM_X86
        if (be->avx512)
            tdm_cpu_zact_fill(be->act + t * nb, nb, be->zact + t * tdm_cpu_zact_stride(nb));
#endif
    }
}

#define TDM_MATMUL_MAX_W 4 /* weights one matmul call may share an input across */
#define TDM_CHUNK_GROUPS 2 /* 8-row groups per thread work unit (16 rows) */

/* The groups of all weights form one index space, split among threads in chunks; each chunk
 * goes over the tokens in tiles of TOKEN_TILE, so its weights stay in L1 and the tile's
 * activations in L2. An output element's value does not depend on the split. */
static int cpu_matmul(void *vbe, const float *x, uint32_t n, uint32_t n_w,
                      const tdm_weight_t *const *w, float *const *out)
{
    cpu_be_t *be = vbe;
    size_t K = w[0]->n_in;
    cpu_wkernel_t tmp[TDM_MATMUL_MAX_W];
    const cpu_wkernel_t *wk[TDM_MATMUL_MAX_W];
    uint64_t gstart[TDM_MATMUL_MAX_W + 1] = {0};
    bool need_q8 = false;
    if (n_w > TDM_MATMUL_MAX_W)
        return TDM_EINTERNAL;
    for (uint32_t k = 0; k < n_w; k++) {
        if (w[k]->n_in != K || K > be->max_in)
            return TDM_EINTERNAL;
        wk[k] = cpu_wkernel_for(be, w[k], &tmp[k]);
        need_q8 |= wk[k]->gemm || wk[k]->zdot;
        gstart[k + 1] = gstart[k] + (w[k]->n_out + 7) / 8;
    }
    if (need_q8)
        matmul_quantize(be, x, n, K);
    int64_t n_chunks = (int64_t)((gstart[n_w] + TDM_CHUNK_GROUPS - 1) / TDM_CHUNK_GROUPS);
    int rc = TDM_OK;
#pragma omp parallel for schedule(static) num_threads(be->n_threads)
    for (int64_t c = 0; c < n_chunks; c++) {
        uint64_t g0 = (uint64_t)c * TDM_CHUNK_GROUPS;
        uint64_t g1 = g0 + TDM_CHUNK_GROUPS < gstart[n_w] ? g0 + TDM_CHUNK_GROUPS : gstart[n_w];
        for (uint32_t t0 = 0; t0 < n; t0 += TOKEN_TILE) {
            uint32_t t1 = t0 + TOKEN_TILE < n ? t0 + TOKEN_TILE : n;
            /* the chunk's groups, one call per weight they belong to */
            for (uint64_t g = g0; g < g1;) {
                uint32_t k = 0;
                while (g >= gstart[k + 1])
                    k++;
                uint64_t ge = g1 < gstart[k + 1] ? g1 : gstart[k + 1];
                if (matmul_groups(be, wk[k], x, g - gstart[k], ge - gstart[k], t0, t1, out[k]) !=
                    TDM_OK) {
#pragma omp atomic write
                    rc = TDM_EINVALID;
                }
                g = ge;
            }
        }
    }
    return rc;
}

static int cpu_add_bias(void *vbe, float *x, const tdm_weight_t *b, uint32_t n)
{
    (void)vbe;
    if (b->type != TDM_GGML_TYPE_F32)
        return TDM_EINVALID;
    const float *bias = b->data;
    size_t D = b->n_in;
    for (uint32_t t = 0; t < n; t++)
        for (size_t i = 0; i < D; i++)
            x[t * D + i] += bias[i];
    return TDM_OK;
}

/* RoPE (Su et al. 2021) as llama.cpp computes it: theta_i = pos * base^(-2i/rope_dim), with
 * the power taken iteratively in f32 (ggml_rope's theta_scale), divided by frequency factor i
 * when the model has them (Llama 3.x), pairs (2i, 2i+1) for the normal mode and
 * (i, i + rope_dim/2) for neox. Dimensions past rope_dim are unchanged. */
static int cpu_rope(void *vbe, uint32_t layer, float *q, float *k, const tdm_fwd_rows_t *rows)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t half = hp->rope_dim / 2, D = hp->head_dim;
    float freq_base, freq_scale; /* linear scaling multiplies each angle (ggml's rope_yarn) */
    tdm_llama_layer_rope(hp, layer, &freq_base, &freq_scale);
    float theta_scale = powf(freq_base, -2.0f / (float)hp->rope_dim);
    bool neox = hp->rope_type == TDM_ROPE_NEOX;
    const float *ff = hp->n_rope_freq_factors ? hp->rope_freq_factors : NULL;
    size_t rope_values = (size_t)rows->n * (hp->n_heads + hp->n_kv_heads) * D;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (rope_values >= be->par_min)
    for (uint32_t t = 0; t < rows->n; t++) {
        float *cs = be->rope_cs + (size_t)t * hp->rope_dim;
        float theta = (float)rows->pos[t];
        for (uint32_t i = 0; i < half; i++) {
            float th = ff ? theta / ff[i] : theta;
            cs[2 * i] = cosf(th * freq_scale);
            cs[2 * i + 1] = sinf(th * freq_scale);
            theta *= theta_scale;
        }
        for (int which = 0; which < 2; which++) {
            uint32_t nh = which == 0 ? hp->n_heads : hp->n_kv_heads;
            float *base =
                which == 0 ? q + (size_t)t * hp->n_heads * D : k + (size_t)t * hp->n_kv_heads * D;
            for (uint32_t h = 0; h < nh; h++) {
                float *x = base + (size_t)h * D;
                for (uint32_t i = 0; i < half; i++) {
                    uint32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                    float x0 = x[i0], x1 = x[i1], c = cs[2 * i], s = cs[2 * i + 1];
                    x[i0] = x0 * c - x1 * s;
                    x[i1] = x0 * s + x1 * c;
                }
            }
        }
    }
    return TDM_OK;
}

/* Address of the record (layer, kv, head) of the block holding position pos of a sequence. */
static uint8_t *kv_record(const cpu_be_t *be, const tdm_batch_seq_t *sq, uint32_t pos,
                          uint32_t layer, uint32_t kv, uint32_t head)
{
    uint8_t *base = tdm_kv_pool_base(be->pool);
    uint32_t block = sq->blocks[pos / be->kl.block_size];
    return base + (uint64_t)block * be->block_bytes +
           tdm_kv_record_offset(&be->kl, be->rec_bytes, layer, kv, head);
}

/* Stores one K or V head vector into its slot. q8 keeps one scale per record (block, layer,
 * K|V, head): the running max|x| / 127 of the slots written so far; when a new slot needs a
 * larger scale the earlier slots are requantized to it. */
static void kv_put(const cpu_be_t *be, uint8_t *rec, uint32_t slot, const float *src)
{
    uint32_t D = be->kl.head_dim;
    switch (be->kl.dtype) {
    case TDM_KV_F32: memcpy((float *)rec + (size_t)slot * D, src, D * sizeof(float)); break;
    case TDM_KV_F16: be->isa->store_f16((uint16_t *)rec + (size_t)slot * D, src, D); break;
    case TDM_KV_Q8: {
        float scale;
        memcpy(&scale, rec, sizeof scale);
        int8_t *qv = (int8_t *)(rec + sizeof(float));
        float amax = 0.0f;
        for (uint32_t i = 0; i < D; i++)
            amax = fmaxf(amax, fabsf(src[i]));
        float need = amax / 127.0f;
        if (slot == 0)
            scale = need;
        else if (need > scale) {
            for (size_t i = 0; i < (size_t)slot * D; i++)
                qv[i] = (int8_t)nearbyintf((float)qv[i] * scale / need);
            scale = need;
        }
        float id = scale != 0.0f ? 1.0f / scale : 0.0f;
        for (uint32_t i = 0; i < D; i++) {
            float v = nearbyintf(src[i] * id);
            qv[(size_t)slot * D + i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
        memcpy(rec, &scale, sizeof scale);
        break;
    }
    }
}

static int cpu_kv_store(void *vbe, uint32_t layer, const float *k, const float *v,
                        const tdm_fwd_rows_t *rows)
{
    cpu_be_t *be = vbe;
    uint32_t H = be->kl.n_kv_heads, D = be->kl.head_dim;
    /* rows in order: q8 requantization depends on slot order within a record */
    for (uint32_t t = 0; t < rows->n; t++) {
        const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
        uint32_t slot = rows->pos[t] % be->kl.block_size;
        for (uint32_t h = 0; h < H; h++) {
            size_t off = ((size_t)t * H + h) * D;
            kv_put(be, kv_record(be, sq, rows->pos[t], layer, 0, h), slot, k + off);
            kv_put(be, kv_record(be, sq, rows->pos[t], layer, 1, h), slot, v + off);
        }
    }
    return TDM_OK;
}

/* Converts slot `slot` of a K or V record to f32 in dst (f32 and q8 caches). */
static void kv_get(const cpu_be_t *be, const uint8_t *rec, uint32_t slot, float *dst)
{
    uint32_t D = be->kl.head_dim;
    if (be->kl.dtype == TDM_KV_F32) {
        memcpy(dst, (const float *)rec + (size_t)slot * D, D * sizeof(float));
    } else if (be->kl.dtype == TDM_KV_F16) {
        const uint16_t *s = (const uint16_t *)rec + (size_t)slot * D;
        for (uint32_t i = 0; i < D; i++)
            dst[i] = tdm_fp16_to_fp32(s[i]);
    } else {
        float scale;
        memcpy(&scale, rec, sizeof scale);
        const int8_t *qv = (const int8_t *)(rec + sizeof(float)) + (size_t)slot * D;
        for (uint32_t i = 0; i < D; i++)
            dst[i] = (float)qv[i] * scale;
    }
}

/* sc[j - j0] = q . K[j] * kq_scale for positions j0 <= j < n_pos of KV head g (tmp:
 * head_dim floats of scratch); returns their maximum. */
static float attn_scores(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                         const float *qh, uint32_t j0, uint32_t n_pos, float *sc, float *tmp)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size;
    float scale = be->kq_scale, mx = -INFINITY;
    bool f16_fast = be->isa->dot_f32_f16 && be->kl.dtype == TDM_KV_F16;
    for (uint32_t j = j0; j < n_pos; j++) {
        const uint8_t *rec = kv_record(be, sq, j, layer, 0, g);
        float s;
        if (f16_fast) {
            s = be->isa->dot_f32_f16(qh, (const uint16_t *)rec + (size_t)(j % bs) * D, D);
        } else {
            kv_get(be, rec, j % bs, tmp);
            s = dot_f32(be, qh, tmp, D);
        }
        s *= scale;
        sc[j - j0] = s;
        mx = s > mx ? s : mx; /* fmaxf without the libm call (never NaN: mx starts at -inf) */
    }
    return mx;
}

/* Softmax of n scaled scores in place, the max subtracted and the sum in double
 * (ggml_soft_max; exp and the summation order as cpu_kernels.h's exp_sum defines them);
 * returns 1 / sum. With an f16 cache the normalised probabilities are then rounded to f16
 * (llama.cpp's f16 KQV mat-mul rounds them), else left unnormalised. */
static float attn_softmax(const cpu_be_t *be, float *sc, uint32_t n, float mx, bool f16)
{
    double sum = be->isa->exp_sum(sc, n, mx);
    float inv = (float)(1.0 / sum);
    if (f16)
        be->isa->round_f16(sc, sc, inv, n);
    return inv;
}

/* One query head over any cache: scores position by position over j0 .. n_pos - 1, softmax,
 * then the weighted sum of V rows in order (tmp: 2 * head_dim floats). */
static void attn_head(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                      const float *qh, uint32_t j0, uint32_t n_pos, float *sc, float *tmp, float *o)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size;
    bool f16 = be->kl.dtype == TDM_KV_F16, f16_fast = be->isa->dot_f32_f16 && f16;
    float mx = attn_scores(be, layer, sq, g, qh, j0, n_pos, sc, tmp);
    float inv = attn_softmax(be, sc, n_pos - j0, mx, f16);
    memset(o, 0, D * sizeof(float));
    for (uint32_t j = j0; j < n_pos; j++) {
        const uint8_t *rec = kv_record(be, sq, j, layer, 1, g);
        float pj = f16 ? sc[j - j0] : sc[j - j0] * inv;
        if (f16_fast) {
            be->isa->axpy_f16(o, pj, (const uint16_t *)rec + (size_t)(j % bs) * D, D);
            continue;
        }
        kv_get(be, rec, j % bs, tmp);
        be->isa->axpy_f32(o, pj, tmp, D);
    }
}

/* The nh query heads of one KV head g over an f16 cache with the grouped kernels
 * (scores_f16, pv_f16): each K and V row is converted once for all nh heads, a block's rows
 * at a time. Bit for bit attn_head for each head. q: the nh heads (rounded to f16), sc:
 * [nh][ld] scores, o: [nh][head_dim]. */
static void attn_group_f16(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq,
                           uint32_t g, const float *q, uint32_t nh, uint32_t first, uint32_t n_pos,
                           float *sc, size_t ld, float *o)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size, n = n_pos - first;
    /* the keys first .. n_pos - 1 a block's rows at a time (the first block from its slot) */
    for (uint32_t j0 = first; j0 < n_pos;) {
        uint32_t slot = j0 % bs, nk = n_pos - j0 < bs - slot ? n_pos - j0 : bs - slot;
        const uint16_t *k = (const uint16_t *)kv_record(be, sq, j0, layer, 0, g) + slot * D;
        be->isa->scores_f16(q, nh, k, nk, D, sc + (j0 - first), ld);
        j0 += nk;
    }
    for (uint32_t h = 0; h < nh; h++) {
        float *sh = sc + (size_t)h * ld;
        attn_softmax(be, sh, n, be->isa->scale_max(sh, n, be->kq_scale), true);
    }
    memset(o, 0, (size_t)nh * D * sizeof(float));
    for (uint32_t j0 = first; j0 < n_pos;) {
        uint32_t slot = j0 % bs, nv = n_pos - j0 < bs - slot ? n_pos - j0 : bs - slot;
        const uint16_t *v = (const uint16_t *)kv_record(be, sq, j0, layer, 1, g) + slot * D;
        be->isa->pv_f16(o, nh, sc + (j0 - first), ld, v, nv, D);
        j0 += nv;
    }
}

/* Causal scaled dot-product attention (Vaswani et al. 2017) with GQA: query head h reads KV
 * head h / (n_heads / n_kv_heads). Scores over positions 0..pos in order (from
 * pos + 1 - n_swa in a sliding-window layer: the keys llama.cpp's SWA mask leaves; a masked
 * key's exp is an exact 0 there, so skipping it sums the same terms), softmax with the
 * max subtracted, then the weighted sum of V rows in order. Work items are (token, KV head):
 * the heads of a group run together, and with an f16 cache through the grouped kernels. With
 * an f16 cache the query and the probabilities are rounded to f16 too, as llama.cpp's f16
 * mat-muls of KQ and KQV do, so the two engines round alike. */
static int cpu_attention(void *vbe, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                         float *out)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t H = hp->n_heads, KVH = hp->n_kv_heads, D = hp->head_dim, group = H / KVH;
    bool f16 = be->kl.dtype == TDM_KV_F16;
    bool grouped = f16 && be->isa->scores_f16 && be->isa->pv_f16;
    int64_t n_items = (int64_t)rows->n * KVH;
    size_t kv_values = 0; /* K and V values the pass reads: a K or V value costs ~1/4 of an
                             element-wise op's (one fma per head of the group, f16 loads) */
    for (uint32_t t = 0; t < rows->n; t++)
        kv_values += ((size_t)rows->pos[t] + 1) * KVH * D * 2;
#pragma omp parallel for schedule(dynamic, 1)                                                      \
    num_threads(be->n_threads) if (kv_values >= 4 * be->par_min)
    for (int64_t it = 0; it < n_items; it++) {
        uint32_t t = (uint32_t)(it / KVH), g = (uint32_t)(it % KVH);
        int tid = omp_get_thread_num();
        float *sc = be->scores + (size_t)tid * group * be->n_ctx;
        float *tmp = be->kvrow + (size_t)tid * (group + 2) * D, *qr = tmp + 2 * D;
        const float *qg = q + ((size_t)t * H + (size_t)g * group) * D;
        float *og = out + ((size_t)t * H + (size_t)g * group) * D;
        const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
        uint32_t n_pos = rows->pos[t] + 1;
        uint32_t first = tdm_llama_layer_first_key(hp, layer, rows->pos[t]);
        if (f16) {
            be->isa->round_f16(qr, qg, 1.0f, (size_t)group * D);
            qg = qr;
        }
        if (grouped) {
            attn_group_f16(be, layer, sq, g, qg, group, first, n_pos, sc, be->n_ctx, og);
            continue;
        }
        for (uint32_t h = 0; h < group; h++)
            attn_head(be, layer, sq, g, qg + (size_t)h * D, first, n_pos, sc, tmp,
                      og + (size_t)h * D);
    }
    return TDM_OK;
}

/* Element-wise ops go to the threads in chunks of this many values, from par_min values on. */
#define TDM_ELEMWISE_CHUNK 4096

/* GELU with the tanh approximation as ggml_gelu_f32 spells it, in f32 with libm's tanhf. */
static float gelu_tanh(float x)
{
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f, coef_a = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + coef_a * x * x)));
}

/* GeGLU rounds like llama.cpp's CPU backend (ggml_vec_geglu_f32 under GGML_GELU_FP16), so that
 * the two engines round alike, as attention does: gelu(x) is looked up by x rounded to f16 in
 * a table of f16-rounded values, x itself for x >= 10 and 0 for x <= -10. One table for every
 * kernel family: the bits do not depend on the set. Built once (65,536 floats). */
static float gelu_f16_table[65536];
static pthread_once_t gelu_f16_once = PTHREAD_ONCE_INIT;

static void gelu_f16_table_init(void)
{
    for (uint32_t i = 0; i < 65536; i++)
        gelu_f16_table[i] =
            tdm_fp16_to_fp32(tdm_fp32_to_fp16(gelu_tanh(tdm_fp16_to_fp32((uint16_t)i))));
}

static inline float gelu_f16(float x)
{
    if (x <= -10.0f)
        return 0.0f;
    if (x >= 10.0f)
        return x;
    return gelu_f16_table[tdm_fp32_to_fp16(x)];
}

typedef enum elem_op { ELEM_SWIGLU, ELEM_GEGLU, ELEM_SCALE, ELEM_ADD } elem_op_t;

/* Values [i, i + m) of an element-wise op: out = act(a) * b (SwiGLU, GeGLU), out = a * s,
 * out = a + b (out may be a). */
static void elem_chunk(const cpu_be_t *be, elem_op_t op, float *out, const float *a, const float *b,
                       float s, size_t i, size_t m)
{
    out += i, a += i, b = b ? b + i : NULL;
    switch (op) {
    case ELEM_SWIGLU: be->isa->swiglu(out, a, b, m); break;
    case ELEM_GEGLU:
        for (size_t j = 0; j < m; j++)
            out[j] = gelu_f16(a[j]) * b[j];
        break;
    case ELEM_SCALE:
        for (size_t j = 0; j < m; j++)
            out[j] = a[j] * s;
        break;
    case ELEM_ADD:
        for (size_t j = 0; j < m; j++)
            out[j] = a[j] + b[j];
        break;
    }
}

/* An element-wise op over count values, split among the threads in chunks of
 * TDM_ELEMWISE_CHUNK from par_min values on (which thread computes a value never changes it). */
static int cpu_elementwise(cpu_be_t *be, elem_op_t op, float *out, const float *a, const float *b,
                           float s, size_t count)
{
    int64_t n_chunks = (int64_t)((count + TDM_ELEMWISE_CHUNK - 1) / TDM_ELEMWISE_CHUNK);
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (count >= be->par_min)
    for (int64_t c = 0; c < n_chunks; c++) {
        size_t i = (size_t)c * TDM_ELEMWISE_CHUNK;
        elem_chunk(be, op, out, a, b, s, i,
                   count - i < TDM_ELEMWISE_CHUNK ? count - i : TDM_ELEMWISE_CHUNK);
    }
    return TDM_OK;
}

static int cpu_swiglu(void *vbe, const float *gate, const float *up, size_t count, float *out)
{
    return cpu_elementwise(vbe, ELEM_SWIGLU, out, gate, up, 0.0f, count);
}

static int cpu_geglu(void *vbe, const float *gate, const float *up, size_t count, float *out)
{
    pthread_once(&gelu_f16_once, gelu_f16_table_init);
    return cpu_elementwise(vbe, ELEM_GEGLU, out, gate, up, 0.0f, count);
}

static int cpu_scale(void *vbe, float *x, float s, size_t count)
{
    return cpu_elementwise(vbe, ELEM_SCALE, x, x, NULL, s, count);
}

static int cpu_add(void *vbe, float *x, const float *y, size_t count)
{
    return cpu_elementwise(vbe, ELEM_ADD, x, x, y, 0.0f, count);
}

static int cpu_gather_rows(void *vbe, const float *src, const uint32_t *rows, uint32_t n,
                           uint32_t dim, float *dst)
{
    (void)vbe;
    for (uint32_t k = 0; k < n; k++)
        memcpy(dst + (size_t)k * dim, src + (size_t)rows[k] * dim, dim * sizeof(float));
    return TDM_OK;
}

static int cpu_read(void *vbe, const float *src, size_t count, float *host_dst)
{
    (void)vbe;
    memcpy(host_dst, src, count * sizeof(float));
    return TDM_OK;
}

const tdm_backend_ops_t tdm_model_backend_cpu = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .kernel_name = cpu_kernel_name,
    .own_bytes = cpu_own_bytes,
    .released_bytes = cpu_released_bytes,
    .alloc = cpu_alloc,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .add_bias = cpu_add_bias,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .geglu = cpu_geglu,
    .scale = cpu_scale,
    .add = cpu_add,
    .gather_rows = cpu_gather_rows,
    .read = cpu_read,
    .host_memory = true,
    .arch_features = true,
};
