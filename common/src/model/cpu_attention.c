/* cpu_attention.c - the CPU backend's KV cache writes (f32, f16, q8 records) and causal
 * attention with GQA over them, reduced over positions 0..pos in order (batch invariance:
 * cpu.c). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "model/cpu_internal.h"

/* Address of the record (layer, kv, head) of the block holding position pos of a sequence
 * (over a pool with layer groups, of the layer's group's block). */
static uint8_t *kv_record(const cpu_be_t *be, const tdm_batch_seq_t *sq, uint32_t pos,
                          uint32_t layer, uint32_t kv, uint32_t head)
{
    uint8_t *base = tdm_kv_pool_base(be->pool);
    const tdm_kv_groups_t *g = be->groups;
    if (g) { /* the layer's records are in its group's blocks, at its slot */
        uint32_t block = sq->group_blocks[g->group_of[layer]][pos / be->kl.block_size];
        return base + (uint64_t)block * be->block_bytes +
               tdm_kv_record_offset(&be->kl, be->rec_bytes, g->slot_of[layer], kv, head);
    }
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

int tdm_cpu_kv_store(void *vbe, uint32_t layer, const float *k, const float *v,
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

/* o_h += p_h[j - lo] * V_j of KV head g for the keys j = j0 .. j1 - 1 in order, a block's rows
 * at a time, for nh heads (o: [nh][head_dim], p: nh rows ld apart whose index 0 is key lo).
 * pv_f16 is bit for bit one axpy_f16 per key, so any split of a key range into consecutive
 * calls gives the same bits. */
static void attn_pv_keys(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                         float *o, uint32_t nh, const float *p, size_t ld, uint32_t lo, uint32_t j0,
                         uint32_t j1)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size;
    while (j0 < j1) {
        uint32_t slot = j0 % bs, nv = j1 - j0 < bs - slot ? j1 - j0 : bs - slot;
        const uint16_t *v = (const uint16_t *)kv_record(be, sq, j0, layer, 1, g) + slot * D;
        be->isa->pv_f16(o, nh, p + (j0 - lo), ld, v, nv, D);
        j0 += nv;
    }
}

/* A run of m <= TDM_ATTN_QTILE consecutive query rows of one sequence (positions p0 ..
 * p0 + m - 1) against KV head g over an f16 cache with the grouped kernels (scores_f16,
 * pv_f16): the run's m * nh query heads share each K and V block read and each f16 -> f32
 * conversion of it (a prefill reads the cache m times less). Per head the arithmetic is the
 * single-row path's: each score is the same dot product (a row's scores past its own
 * position or before its window are computed and never read), each softmax runs over the
 * row's own keys first .. p0 + i, and the V rows are accumulated in key order (a row's own
 * leading window keys, then the keys every row of the run sees, in one pass for all heads,
 * then its trailing causal keys), so every row's output is bit for bit what it is alone.
 * q: [m * nh][head_dim] queries (rounded to f16), sc: [m * nh][ld] scores (ld >= p0 + m),
 * o: [m * nh][head_dim] outputs. */
static void attn_run_f16(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                         const float *q, uint32_t nh, uint32_t m, uint32_t p0, float *sc, size_t ld,
                         float *o)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size, nq = m * nh;
    uint32_t first[TDM_ATTN_QTILE] = {0};
    for (uint32_t i = 0; i < m; i++)
        first[i] = tdm_llama_layer_first_key(be->hp, layer, p0 + i);
    uint32_t lo = first[0], hi = p0 + m; /* the keys any row of the run sees */
    for (uint32_t j0 = lo; j0 < hi;) {
        uint32_t slot = j0 % bs, nk = hi - j0 < bs - slot ? hi - j0 : bs - slot;
        const uint16_t *k = (const uint16_t *)kv_record(be, sq, j0, layer, 0, g) + slot * D;
        be->isa->scores_f16(q, nq, k, nk, D, sc + (j0 - lo), ld);
        j0 += nk;
    }
    for (uint32_t i = 0; i < m; i++)
        for (uint32_t h = 0; h < nh; h++) {
            float *sh = sc + (size_t)(i * nh + h) * ld + (first[i] - lo);
            uint32_t n = p0 + i + 1 - first[i];
            attn_softmax(be, sh, n, be->isa->scale_max(sh, n, be->kq_scale), true);
        }
    memset(o, 0, (size_t)nq * D * sizeof(float));
    uint32_t cl = first[m - 1], ch = p0 + 1; /* the keys every row sees: cl .. ch - 1 */
    if (cl >= ch)
        ch = cl; /* a window shorter than the run: each row alone */
    for (uint32_t i = 0; i < m; i++)
        attn_pv_keys(be, layer, sq, g, o + (size_t)i * nh * D, nh, sc + (size_t)i * nh * ld, ld, lo,
                     first[i], cl < p0 + i + 1 ? cl : p0 + i + 1);
    attn_pv_keys(be, layer, sq, g, o, nq, sc, ld, lo, cl, ch);
    for (uint32_t i = 0; i < m; i++)
        attn_pv_keys(be, layer, sq, g, o + (size_t)i * nh * D, nh, sc + (size_t)i * nh * ld, ld, lo,
                     ch > first[i] ? ch : first[i], p0 + i + 1);
}

/* Causal scaled dot-product attention (Vaswani et al. 2017) with GQA: query head h reads KV
 * head h / (n_heads / n_kv_heads). Scores over positions 0..pos in order (from
 * pos + 1 - n_swa in a sliding-window layer: the keys llama.cpp's SWA mask leaves; a masked
 * key's exp is an exact 0 there, so skipping it sums the same terms), softmax with the
 * max subtracted, then the weighted sum of V rows in order. Work items are (tile of
 * TDM_ATTN_QTILE rows, or one row when no two rows are consecutive positions, KV head): the heads
 * of a group run together, and with an f16 cache through the grouped kernels, consecutive positions
 * of one sequence within the tile as one run (attn_run_f16), which gives each row the bits it has
 * alone (batch invariance). With an f16 cache the query and the probabilities are rounded to f16
 * too, as llama.cpp's f16 mat-muls of KQ and KQV do, so the two engines round alike. */
int tdm_cpu_attention(void *vbe, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                      float *out)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t H = hp->n_heads, KVH = hp->n_kv_heads, D = hp->head_dim, group = H / KVH;
    bool f16 = be->kl.dtype == TDM_KV_F16;
    bool grouped = f16 && be->isa->scores_f16 && be->isa->pv_f16;
    /* rows in tiles of TDM_ATTN_QTILE when some are consecutive positions of one sequence (a
     * prefill chunk), else one row an item (a decode batch keeps its finer items) */
    uint32_t qtile = 1;
    for (uint32_t t = 1; t < rows->n && qtile == 1; t++)
        if (rows->seq[t] == rows->seq[t - 1] && rows->pos[t] == rows->pos[t - 1] + 1)
            qtile = TDM_ATTN_QTILE;
    uint32_t n_tiles = (rows->n + qtile - 1) / qtile;
    int64_t n_items = (int64_t)n_tiles * KVH;
    size_t kv_values = 0; /* K and V values the pass reads: a K or V value costs ~1/4 of an
                             element-wise op's (one fma per head of the group, f16 loads) */
    for (uint32_t t = 0; t < rows->n; t++)
        kv_values += ((size_t)rows->pos[t] + 1) * KVH * D * 2;
#pragma omp parallel for schedule(dynamic, 1)                                                      \
    num_threads(be->n_threads) if (kv_values >= 4 * be->par_min)
    for (int64_t it = 0; it < n_items; it++) {
        uint32_t r0 = (uint32_t)(it / KVH) * qtile, g = (uint32_t)(it % KVH);
        uint32_t r1 = r0 + qtile < rows->n ? r0 + qtile : rows->n;
        int tid = omp_get_thread_num();
        float *sc = be->scores + (size_t)tid * TDM_ATTN_QTILE * group * be->n_ctx;
        float *tmp = be->kvrow + (size_t)tid * (2 * TDM_ATTN_QTILE * group + 2) * D;
        float *qr = tmp + 2 * D, *ob = qr + (size_t)TDM_ATTN_QTILE * group * D;
        for (uint32_t t = r0; t < r1;) {
            const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
            uint32_t m = 1;
            while (grouped && t + m < r1 && rows->seq[t + m] == rows->seq[t] &&
                   rows->pos[t + m] == rows->pos[t] + m)
                m++;
            if (grouped) {
                for (uint32_t i = 0; i < m; i++)
                    be->isa->round_f16(qr + (size_t)i * group * D,
                                       q + ((size_t)(t + i) * H + (size_t)g * group) * D, 1.0f,
                                       (size_t)group * D);
                attn_run_f16(be, layer, sq, g, qr, group, m, rows->pos[t], sc, be->n_ctx, ob);
                for (uint32_t i = 0; i < m; i++)
                    memcpy(out + ((size_t)(t + i) * H + (size_t)g * group) * D,
                           ob + (size_t)i * group * D, (size_t)group * D * sizeof(float));
                t += m;
                continue;
            }
            const float *qg = q + ((size_t)t * H + (size_t)g * group) * D;
            float *og = out + ((size_t)t * H + (size_t)g * group) * D;
            uint32_t n_pos = rows->pos[t] + 1;
            uint32_t first = tdm_llama_layer_first_key(hp, layer, rows->pos[t]);
            if (f16) {
                be->isa->round_f16(qr, qg, 1.0f, (size_t)group * D);
                qg = qr;
            }
            for (uint32_t h = 0; h < group; h++)
                attn_head(be, layer, sq, g, qg + (size_t)h * D, first, n_pos, sc, tmp,
                          og + (size_t)h * D);
            t++;
        }
    }
    return TDM_OK;
}
