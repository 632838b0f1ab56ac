/* cpu.c - the CPU backend: creation (kernel choice, scratch, per-weight kernel records) and
 * the ops table; the ops are in cpu_ops.c, cpu_matmul.c and cpu_attention.c, the kernels in
 * one file per instruction set behind cpu_kernels.h (scalar, AVX2, AVX-VNNI, AVX-512 VNNI,
 * AMX-INT8), the best set the CPU has chosen when the backend is created (TANDEM_CPU_KERNELS
 * caps it). Everything runs over OpenMP threads.
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
 * in plain C (cpu_ops.c: RMSNorm, RoPE, GeGLU, the element-wise adds) are one code for every set.
 * The one exception is TANDEM_CPU_KERNELS=zdot, a comparison option: its AVX-512 row kernels
 * (cpu_avx512.c) are batch invariant but reduce in their own order.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "model/cpu_internal.h"

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

/* The kernel record of w: the one chosen at load, or (for a weight the backend was not
 * created with) one over the rows in place, which gives the same bits. */
const cpu_wkernel_t *tdm_cpu_wkernel_for(const cpu_be_t *be, const tdm_weight_t *w,
                                         cpu_wkernel_t *tmp)
{
    if (be->exp_wk && w >= be->exp_w && w < be->exp_w + be->n_exp_w) /* an expert: O(1) */
        return &be->exp_wk[w - be->exp_w];
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
 * older f32 path (dequantized rows, for comparison); unset, empty or "auto" is the best.
 * TDM_EINVALID naming the variable and its values for anything else (a typo would otherwise
 * run, and measure, other kernels than the ones asked for). */
static int cpu_pick_kernels(cpu_be_t *be, tdm_error_t *err)
{
    const char *cap = getenv("TANDEM_CPU_KERNELS");
    if (cap && !cap[0])
        cap = NULL;
    int level = 5; /* 0 scalar, 1 avx2, 2 vnni, 3 avx512, 4 amx, 5 auto */
    static const char *const names[] = {"scalar", "avx2", "vnni", "avx512", "amx"};
    for (int i = 0; cap && i < 5; i++)
        if (strcmp(cap, names[i]) == 0)
            level = i;
    if (cap && level == 5 && strcmp(cap, "auto") != 0 && strcmp(cap, "zdot") != 0 &&
        strcmp(cap, "f32k") != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "TANDEM_CPU_KERNELS='%.64s' is not one of auto, scalar, avx2, vnni, "
                             "avx512, amx, zdot, f32k (unset it for the best the CPU has)",
                             cap);
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
    return TDM_OK;
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
    if (hp->n_ff_exp > max_in)
        max_in = hp->n_ff_exp;
    be->max_in = max_in;
    size_t nt = (size_t)be->n_threads;
    size_t act_blocks = (size_t)be->max_rows * ((max_in + QK - 1) / QK);
    be->act = (q8a_block_t *)cpu_alloc(be, act_blocks * sizeof(q8a_block_t) / sizeof(float));
    be->wrow = cpu_alloc(be, nt * max_in);
    size_t group = hp->n_heads / hp->n_kv_heads;
    be->sc_ld = be->n_ctx < TDM_ATTN_SPAN + TDM_ATTN_QTILE - 1 ? be->n_ctx
                                                               : TDM_ATTN_SPAN + TDM_ATTN_QTILE - 1;
    be->scores = cpu_alloc(be, nt * TDM_ATTN_QTILE * group * be->sc_ld);
    be->kvrow = cpu_alloc(be, nt * (3 * TDM_ATTN_QTILE * group + 2) * hp->head_dim);
    be->run_ml = (double *)cpu_alloc(be, nt * 8 * TDM_ATTN_QTILE * group);
    be->max_spans = be->n_ctx / TDM_ATTN_SPAN + 2;
    size_t per_row = (size_t)hp->n_kv_heads * be->max_spans * group *
                     (hp->head_dim * sizeof(float) + 2 * sizeof(double));
    size_t split = TDM_ATTN_SPLIT_BYTES / per_row;
    be->split_rows = nt < 2                        ? 0
                     : split < TDM_ATTN_SPLIT_ROWS ? (uint32_t)split
                                                   : TDM_ATTN_SPLIT_ROWS;
    size_t n_part = (size_t)be->split_rows * hp->n_kv_heads * be->max_spans * group;
    be->span_o = cpu_alloc(be, n_part * hp->head_dim);
    be->span_ml = (double *)cpu_alloc(be, n_part * 4);
    be->span_left = (atomic_uint *)cpu_alloc(be, (size_t)be->split_rows * hp->n_kv_heads);
    be->rope_cs = cpu_alloc(be, (size_t)be->max_rows * hp->rope_dim);
    size_t znb = (max_in + QK - 1) / QK;
    be->zact =
        (uint8_t *)cpu_alloc(be, (size_t)be->max_rows * tdm_cpu_zact_stride(znb) / sizeof(float));
    be->zprep = (uint8_t *)cpu_alloc(be, nt * tdm_cpu_zprep_stride(znb) / sizeof(float));
    if (!be->act || !be->wrow || !be->scores || !be->kvrow || !be->rope_cs || !be->zact ||
        !be->zprep || !be->run_ml || !be->span_o || !be->span_ml || !be->span_left) {
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
    be->n_wk = 0; /* tdm_cpu_wkernel_for builds the in-place record */
    *wk = *tdm_cpu_wkernel_for(be, w, &tmp);
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
    wk->w = w; /* the record answers for the model's weight (tdm_cpu_wkernel_for) */
    if (w->data != tdm_model_token_embd(be->model)->data)
        be->released +=
            tdm_gguf_release(tdm_model_gguf(be->model), w->data, (size_t)w->row_bytes * w->n_out);
    return TDM_OK;
}

/* The kernel record of w (cpu_wkernel_init, or its Q5_0 variant). Fails only on out of memory. */
static int cpu_wkernel_choose(cpu_be_t *be, const tdm_weight_t *w, cpu_wkernel_t *wk)
{
    bool q5_0 = w->type == TDM_GGML_TYPE_Q5_0 && w->n_in % QK == 0 && !be->avx512;
    return q5_0 ? cpu_wkernel_init_q5_0(be, w, wk) : cpu_wkernel_init(be, w, wk);
}

/* Chooses the kernel of every matrix the forward pass multiplies (cpu_wkernel_init): per layer
 * q, k, v, o and the dense FFN's three or the experts' router, then the output matrix; the
 * experts' slices get their own table in tdm_model_experts' order (an O(1) lookup). */
static int cpu_wkernels_new(cpu_be_t *be, tdm_error_t *err)
{
    uint32_t n_layers = be->hp->n_layers;
    size_t n = (size_t)n_layers * 7 + 1, m = 0, n_exp = 0;
    const tdm_weight_t *exp_w = tdm_model_experts(be->model, &n_exp);
    cpu_wkernel_t *wk = (cpu_wkernel_t *)cpu_alloc(be, n * sizeof *wk / sizeof(float) + 1);
    const tdm_weight_t **ws = (const tdm_weight_t **)cpu_alloc(be, n * 2);
    cpu_wkernel_t *ewk =
        n_exp ? (cpu_wkernel_t *)cpu_alloc(be, n_exp * sizeof *ewk / sizeof(float) + 1) : NULL;
    if (!wk || !ws || (n_exp && !ewk))
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory allocating CPU kernel table");
    for (uint32_t l = 0; l < n_layers; l++) {
        const tdm_layer_weights_t *lw = tdm_model_layer(be->model, l);
        const tdm_weight_t *lws[7] = {&lw->wq,     &lw->wk,   &lw->wv,    &lw->wo,
                                      &lw->w_gate, &lw->w_up, &lw->w_down};
        if (be->hp->n_expert > 0)
            lws[4] = &lw->gate_inp;
        size_t k = be->hp->n_expert > 0 ? 5 : 7;
        memcpy(ws + m, lws, k * sizeof lws[0]);
        m += k;
    }
    ws[m++] = tdm_model_output(be->model);
    for (size_t i = 0; i < m; i++)
        if (cpu_wkernel_choose(be, ws[i], &wk[i]) != TDM_OK)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory repacking weights");
    for (size_t i = 0; i < n_exp; i++)
        if (cpu_wkernel_choose(be, &exp_w[i], &ewk[i]) != TDM_OK)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory repacking expert weights");
    be->wk = wk;
    be->n_wk = m;
    be->exp_w = exp_w;
    be->n_exp_w = n_exp;
    be->exp_wk = ewk;
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
    be->groups = tdm_kv_pool_groups(pool);
    be->block_bytes = tdm_kv_block_bytes(&be->kl);
    be->rec_bytes = tdm_kv_record_bytes(&be->kl);
    be->n_threads = p->n_threads > 0 ? p->n_threads : omp_get_max_threads();
    be->max_rows = p->max_batch_tokens;
    be->n_ctx = p->n_ctx;
    be->kq_scale = be->hp->attn_q_scale > 0.0f ? 1.0f : 1.0f / sqrtf((float)be->hp->head_dim);
    if (cpu_pick_kernels(be, err) != TDM_OK || cpu_pick_par_min(be, err) != TDM_OK ||
        cpu_scratch_new(be, err) != TDM_OK || cpu_wkernels_new(be, err) != TDM_OK ||
        tdm_cpu_moe_scratch_new(be, err) != TDM_OK) {
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

const tdm_backend_ops_t tdm_model_backend_cpu = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .kernel_name = cpu_kernel_name,
    .own_bytes = cpu_own_bytes,
    .released_bytes = cpu_released_bytes,
    .alloc = cpu_alloc,
    .embed = tdm_cpu_embed,
    .rmsnorm = tdm_cpu_rmsnorm,
    .matmul = tdm_cpu_matmul,
    .add_bias = tdm_cpu_add_bias,
    .rope = tdm_cpu_rope,
    .kv_store = tdm_cpu_kv_store,
    .attention = tdm_cpu_attention,
    .swiglu = tdm_cpu_swiglu,
    .moe_ffn = tdm_cpu_moe_ffn,
    .geglu = tdm_cpu_geglu,
    .scale = tdm_cpu_scale,
    .add = tdm_cpu_add,
    .gather_rows = tdm_cpu_gather_rows,
    .read = tdm_cpu_read,
    .host_memory = true,
    .arch_features = true,
    .kv_groups = true,
};
