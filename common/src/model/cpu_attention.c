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

/* Blocks ahead of the one a grouped kernel reads whose K or V rows are prefetched: a sequence's
 * blocks lie anywhere in the pool, so each block's record (block_size x head_dim values, 2 KiB
 * for SmolLM2's f16 cache) is a short stream the hardware prefetcher meets cold. Building with
 * -DATTN_PREFETCH_BLOCKS=0 turns it off (for an A/B: performance.md, "Long context"). */
#ifndef ATTN_PREFETCH_BLOCKS
#define ATTN_PREFETCH_BLOCKS 2
#endif

/* Records longer than this are long streams the hardware prefetcher follows by itself */
#define ATTN_PREFETCH_MAX_BYTES 8192

/* Prefetches the f16 or q8 rows of the K (kv 0) or V (kv 1) record of KV head g in the block
 * ATTN_PREFETCH_BLOCKS blocks after the one holding position j0, those before position hi
 * (n rows: n * head_dim * 2 bytes, or q8's scale and n * head_dim bytes). Reads nothing, so the
 * results' bits do not depend on it. */
static void kv_prefetch_ahead(const cpu_be_t *be, const tdm_batch_seq_t *sq, uint32_t j0,
                              uint32_t hi, uint32_t layer, uint32_t kv, uint32_t g)
{
    uint32_t bs = be->kl.block_size;
    bool q8 = be->kl.dtype == TDM_KV_Q8;
    size_t row = (size_t)be->kl.head_dim * (q8 ? 1 : 2), head = q8 ? sizeof(float) : 0;
    if (ATTN_PREFETCH_BLOCKS == 0 || bs * row > ATTN_PREFETCH_MAX_BYTES)
        return;
    uint32_t pb = (j0 / bs + ATTN_PREFETCH_BLOCKS) * bs; /* that block's first position */
    if (pb >= hi)
        return;
    const uint8_t *p = kv_record(be, sq, pb, layer, kv, g);
    size_t bytes = head + (size_t)(hi - pb < bs ? hi - pb : bs) * row;
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(p + off, 0, 3);
}

/* The K (kv 0) or V (kv 1) rows of KV head g from position j's slot to its block's end, f16
 * or int8 (*scale: a q8 record's scale, 1 for f16) */
static const void *kv_rows(const cpu_be_t *be, const tdm_batch_seq_t *sq, uint32_t j,
                           uint32_t layer, uint32_t kv, uint32_t g, float *scale)
{
    const uint8_t *rec = kv_record(be, sq, j, layer, kv, g);
    size_t off = (size_t)(j % be->kl.block_size) * be->kl.head_dim;
    *scale = 1.0f;
    if (be->kl.dtype != TDM_KV_Q8)
        return (const uint16_t *)rec + off;
    memcpy(scale, rec, sizeof *scale);
    return (const int8_t *)(rec + sizeof(float)) + off;
}

/* o_h += p_h[j - lo] * V_j of KV head g for the keys j = j0 .. j1 - 1 in order, a block's rows
 * at a time, for nh heads (o: [nh][head_dim], p: nh rows ld apart whose index 0 is key lo).
 * pv_f16 (pv_q8) is bit for bit one axpy_f16 (dequantization and axpy_f32) per key, so any
 * split of a key range into consecutive calls gives the same bits. */
static void attn_pv_keys(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                         float *o, uint32_t nh, const float *p, size_t ld, uint32_t lo, uint32_t j0,
                         uint32_t j1)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size;
    bool q8 = be->kl.dtype == TDM_KV_Q8;
    while (j0 < j1) {
        uint32_t slot = j0 % bs, nv = j1 - j0 < bs - slot ? j1 - j0 : bs - slot;
        float scale;
        const void *v = kv_rows(be, sq, j0, layer, 1, g, &scale);
        kv_prefetch_ahead(be, sq, j0, j1, layer, 1, g);
        if (q8)
            be->isa->pv_q8(o, nh, p + (j0 - lo), ld, v, scale, nv, D);
        else
            be->isa->pv_f16(o, nh, p + (j0 - lo), ld, v, nv, D);
        j0 += nv;
    }
}

/* Scores of nq query heads (q: [nq][head_dim], rounded to f16 for an f16 cache) against keys
 * lo .. hi - 1 of KV head g of an f16 or q8 cache, a block's rows at a time:
 * sc[k * ld + j - lo] = q_k . K_j (unscaled; each bit for bit dot_f32_f16, or dot_f32 of the
 * dequantized row, whatever the range). */
static void run_scores(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                       const float *q, uint32_t nq, uint32_t lo, uint32_t hi, float *sc, size_t ld)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size;
    bool q8 = be->kl.dtype == TDM_KV_Q8;
    TDM_ASSERT(hi - lo <= ld); /* sc's rows are ld wide (cpu_be_t.sc_ld) */
    for (uint32_t j0 = lo; j0 < hi;) {
        uint32_t slot = j0 % bs, nk = hi - j0 < bs - slot ? hi - j0 : bs - slot;
        float scale;
        const void *k = kv_rows(be, sq, j0, layer, 0, g, &scale);
        kv_prefetch_ahead(be, sq, j0, hi, layer, 0, g);
        if (q8)
            be->isa->scores_q8(q, nq, k, scale, nk, D, sc + (j0 - lo), ld);
        else
            be->isa->scores_f16(q, nq, k, nk, D, sc + (j0 - lo), ld);
        j0 += nk;
    }
}

/* The keys row i of a run (positions p0 .. p0 + m - 1, row i's first key first[i]) sees within
 * a .. b - 1: *r0 .. *r1 - 1 (empty when *r0 >= *r1). */
static void run_row_keys(const uint32_t *first, uint32_t p0, uint32_t i, uint32_t a, uint32_t b,
                         uint32_t *r0, uint32_t *r1)
{
    *r0 = first[i] > a ? first[i] : a;
    *r1 = p0 + i + 1 < b ? p0 + i + 1 : b;
}

/* o_(i,h) += sum over the keys j row i sees within a .. b - 1 of p_(i,h)[j - lo] * V_j, for the
 * m rows of a run and nh heads each (o: [m * nh][head_dim], sc: [m * nh][ld] probabilities
 * whose index 0 is key lo), each row's keys in order: its own leading window keys, then the
 * keys every row sees (one pass for all m * nh heads), then its own causal tail. */
static void run_pv(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                   float *o, uint32_t nh, uint32_t m, uint32_t p0, const uint32_t *first,
                   const float *sc, size_t ld, uint32_t lo, uint32_t a, uint32_t b)
{
    uint32_t D = be->kl.head_dim;
    uint32_t cl = first[m - 1] > a ? first[m - 1] : a; /* the keys every row sees: cl .. ch - 1 */
    uint32_t ch = p0 + 1 < b ? p0 + 1 : b;
    if (cl >= ch)
        ch = cl; /* a window shorter than the run: each row alone */
    for (uint32_t i = 0; i < m; i++) {
        uint32_t r0, r1;
        run_row_keys(first, p0, i, a, b, &r0, &r1);
        attn_pv_keys(be, layer, sq, g, o + (size_t)i * nh * D, nh, sc + (size_t)i * nh * ld, ld, lo,
                     r0, cl < r1 ? cl : r1);
    }
    attn_pv_keys(be, layer, sq, g, o, m * nh, sc, ld, lo, cl, ch);
    for (uint32_t i = 0; i < m; i++) {
        uint32_t r0, r1;
        run_row_keys(first, p0, i, a, b, &r0, &r1);
        attn_pv_keys(be, layer, sq, g, o + (size_t)i * nh * D, nh, sc + (size_t)i * nh * ld, ld, lo,
                     ch > r0 ? ch : r0, r1);
    }
}

/* A run of m <= TDM_ATTN_QTILE consecutive query rows of one sequence (positions p0 ..
 * p0 + m - 1), each with at most TDM_ATTN_SPAN keys, against KV head g over an f16 or q8 cache
 * with the grouped kernels (scores_f16 / pv_f16, scores_q8 / pv_q8): the run's m * nh query heads
 * share each K and V block read and each conversion of it to f32 (a prefill reads the cache m
 * times less). Per head the arithmetic is the single-row path's (attn_head): each score is the
 * same dot product (a row's scores past its own position or before its window are computed and
 * never read), each softmax runs over the row's own keys first .. p0 + i (q8: the
 * probabilities e_j * (1 / sum), as attn_head multiplies them), and the V rows are accumulated
 * in key order (run_pv), so every row's output is bit for bit what it is alone.
 * q: [m * nh][head_dim] queries (rounded to f16 for an f16 cache), sc: [m * nh][ld] scores
 * (ld >= p0 + m), o: [m * nh][head_dim] outputs. */
static void attn_run(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                     const float *q, uint32_t nh, uint32_t m, uint32_t p0, float *sc, size_t ld,
                     float *o)
{
    uint32_t D = be->kl.head_dim, nq = m * nh;
    bool f16 = be->kl.dtype == TDM_KV_F16;
    uint32_t first[TDM_ATTN_QTILE] = {0};
    for (uint32_t i = 0; i < m; i++)
        first[i] = tdm_llama_layer_first_key(be->hp, layer, p0 + i);
    uint32_t lo = first[0], hi = p0 + m; /* the keys any row of the run sees */
    run_scores(be, layer, sq, g, q, nq, lo, hi, sc, ld);
    for (uint32_t i = 0; i < m; i++)
        for (uint32_t h = 0; h < nh; h++) {
            float *sh = sc + (size_t)(i * nh + h) * ld + (first[i] - lo);
            uint32_t n = p0 + i + 1 - first[i];
            float inv = attn_softmax(be, sh, n, be->isa->scale_max(sh, n, be->kq_scale), f16);
            if (!f16)
                be->isa->scale_max(sh, n, inv); /* p_j = e_j * inv, one rounding */
        }
    memset(o, 0, (size_t)nq * D * sizeof(float));
    run_pv(be, layer, sq, g, o, nh, m, p0, first, sc, ld, lo, lo, hi);
}

/* ---- long rows: spans (flash-decoding) ----
 *
 * A row with more than TDM_ATTN_SPAN keys reduces them span by span, the spans aligned to
 * multiples of TDM_ATTN_SPAN positions (a window's first span may start inside one). Per span
 * and query head: the scaled scores' maximum m_s, the exponentials e_j = exp(s_j - m_s) with
 * their sum l_s (exp_sum's order, in double; with an f16 cache the e_j then rounded to f16, as
 * the short rows' probabilities are before their f16 P.V), and o_s = sum e_j V_j in key order from
 * zero. span_fold combines the spans in span order (Milakov & Gimelshein 2018, "Online
 * normalizer calculation for softmax"; Dao et al. 2023, "Flash-Decoding"), span_finish divides
 * by the sum. What a span computes and the fold's order depend only on the row's own position
 * and keys, not on which thread ran a span or on the other rows of the pass: a decode pass
 * runs a long row's spans as separate work items on any number of threads, a prefill run folds
 * them as it goes, and both give the same bits. Rows with at most TDM_ATTN_SPAN keys keep the
 * two-pass softmax over all their keys (attn_run, attn_head). */

/* Folds span partial (m, l, oc) into the running (*mx, *l_run, o) ([head_dim] vectors);
 * first: oc is the row's first span. exp via tdm_cpu_expf; every step is a single operation
 * (-ffp-contract=off), the same in every kernel family. */
static void span_fold(float *mx, double *l_run, float *o, float m, double l, const float *oc,
                      uint32_t D, bool first)
{
    if (first) {
        *mx = m;
        *l_run = l;
        memcpy(o, oc, D * sizeof(float));
        return;
    }
    float mn = m > *mx ? m : *mx;
    float alpha = tdm_cpu_expf(*mx - mn), beta = tdm_cpu_expf(m - mn);
    *l_run = *l_run * alpha + l * beta;
    for (uint32_t d = 0; d < D; d++)
        o[d] = o[d] * alpha + oc[d] * beta;
    *mx = mn;
}

/* o /= l: the softmax's normalisation after the last span */
static void span_finish(float *o, double l, uint32_t D)
{
    float inv = (float)(1.0 / l);
    for (uint32_t d = 0; d < D; d++)
        o[d] *= inv;
}

/* The span a .. b - 1's softmax partials of a run's rows (grouped path): for row i, head h
 * (k = i * nh + h) over the keys it sees there, scores scaled in place, replaced by their
 * exponentials (rounded to f16 for an f16 cache, as head_span does); pm[k] their maximum, pl[k]
 * their sum (untouched for a row that sees none of the span's keys). sc: [m * nh][ld], index
 * 0 = key lo. */
static void span_softmax(const cpu_be_t *be, uint32_t nh, uint32_t m, uint32_t p0,
                         const uint32_t *first, float *sc, size_t ld, uint32_t lo, uint32_t a,
                         uint32_t b, double *pm, double *pl)
{
    for (uint32_t i = 0; i < m; i++) {
        uint32_t r0, r1;
        run_row_keys(first, p0, i, a, b, &r0, &r1);
        if (r0 >= r1)
            continue;
        for (uint32_t h = 0; h < nh; h++) {
            uint32_t k = i * nh + h, n = r1 - r0;
            float *sh = sc + (size_t)k * ld + (r0 - lo);
            float mx = be->isa->scale_max(sh, n, be->kq_scale);
            pl[k] = be->isa->exp_sum(sh, n, mx);
            pm[k] = mx;
            if (be->kl.dtype == TDM_KV_F16)
                be->isa->round_f16(sh, sh, 1.0f, n);
        }
    }
}

/* The end of the span that holds key a (exclusive), at most hi */
static uint32_t span_end(uint32_t a, uint32_t hi)
{
    uint32_t b = (a / TDM_ATTN_SPAN + 1) * TDM_ATTN_SPAN;
    return b < hi ? b : hi;
}

/* attn_run for rows with more than TDM_ATTN_SPAN keys each: span by span the scores of the
 * span's keys (each score's bits do not depend on the range it is computed in, so sc holds one
 * span, ld >= TDM_ATTN_SPAN, not the whole context), the partial softmax, P.V (one read of each
 * V block for the run's m * nh heads) and the fold. os: [m * nh][head_dim] scratch, ml:
 * 4 * m * nh doubles. */
static void attn_run_span(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                          const float *q, uint32_t nh, uint32_t m, uint32_t p0, float *sc,
                          size_t ld, float *o, float *os, double *ml)
{
    uint32_t D = be->kl.head_dim, nq = m * nh;
    uint32_t first[TDM_ATTN_QTILE] = {0};
    for (uint32_t i = 0; i < m; i++)
        first[i] = tdm_llama_layer_first_key(be->hp, layer, p0 + i);
    uint32_t lo = first[0], hi = p0 + m;
    double *pm = ml, *pl = ml + nq, *lrun = ml + 2 * nq, *mrun = ml + 3 * nq; /* each [nq] */
    for (uint32_t a = lo; a < hi;) {
        uint32_t b = span_end(a, hi);
        run_scores(be, layer, sq, g, q, nq, a, b, sc, ld); /* index 0 = key a */
        span_softmax(be, nh, m, p0, first, sc, ld, a, a, b, pm, pl);
        memset(os, 0, (size_t)nq * D * sizeof(float));
        run_pv(be, layer, sq, g, os, nh, m, p0, first, sc, ld, a, a, b);
        for (uint32_t i = 0; i < m; i++) {
            uint32_t r0, r1;
            run_row_keys(first, p0, i, a, b, &r0, &r1);
            if (r0 >= r1)
                continue;
            for (uint32_t k = i * nh; k < (i + 1) * nh; k++) {
                float mx = (float)mrun[k]; /* a float held in a double: exact both ways */
                span_fold(&mx, &lrun[k], o + (size_t)k * D, (float)pm[k], pl[k], os + (size_t)k * D,
                          D, r0 == first[i]);
                mrun[k] = mx;
            }
        }
        a = b;
    }
    for (uint32_t k = 0; k < nq; k++)
        span_finish(o + (size_t)k * D, lrun[k], D);
}

/* One query head's span partial over keys a .. b - 1 on any cache (the non-grouped path):
 * *pm, *pl the maximum and sum, os ([head_dim]) sum e_j V_j from zero (sc: b - a floats;
 * tmp: head_dim floats). */
static void head_span(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq, uint32_t g,
                      const float *qh, uint32_t a, uint32_t b, float *sc, float *tmp, float *os,
                      double *pm, double *pl)
{
    uint32_t D = be->kl.head_dim, bs = be->kl.block_size;
    bool f16 = be->kl.dtype == TDM_KV_F16, f16_fast = be->isa->dot_f32_f16 && f16;
    float mx = attn_scores(be, layer, sq, g, qh, a, b, sc, tmp);
    *pl = be->isa->exp_sum(sc, b - a, mx);
    *pm = mx;
    if (f16)
        be->isa->round_f16(sc, sc, 1.0f, b - a);
    memset(os, 0, D * sizeof(float));
    for (uint32_t j = a; j < b; j++) {
        const uint8_t *rec = kv_record(be, sq, j, layer, 1, g);
        if (f16_fast) {
            be->isa->axpy_f16(os, sc[j - a], (const uint16_t *)rec + (size_t)(j % bs) * D, D);
            continue;
        }
        kv_get(be, rec, j % bs, tmp);
        be->isa->axpy_f32(os, sc[j - a], tmp, D);
    }
}

/* attn_head for a row with more than TDM_ATTN_SPAN keys: span by span, folded into o
 * (tmp: 2 * head_dim floats). */
static void attn_head_long(const cpu_be_t *be, uint32_t layer, const tdm_batch_seq_t *sq,
                           uint32_t g, const float *qh, uint32_t j0, uint32_t n_pos, float *sc,
                           float *tmp, float *o)
{
    uint32_t D = be->kl.head_dim;
    float mx = 0.0f;
    double l = 0.0;
    for (uint32_t a = j0; a < n_pos;) {
        uint32_t b = span_end(a, n_pos);
        double pm, pl;
        head_span(be, layer, sq, g, qh, a, b, sc, tmp, tmp + D, &pm, &pl);
        span_fold(&mx, &l, o, (float)pm, pl, tmp + D, D, a == j0);
        a = b;
    }
    span_finish(o, l, D);
}

/* The nh query heads of a KV group (q: [nh][head_dim]) as the grouped kernels take them into
 * dst: rounded to f16 for an f16 cache (llama.cpp's f16 KQ mat-mul), else copied */
static void attn_query(const cpu_be_t *be, float *dst, const float *q, uint32_t nh)
{
    size_t n = (size_t)nh * be->kl.head_dim;
    if (be->kl.dtype == TDM_KV_F16)
        be->isa->round_f16(dst, q, 1.0f, n);
    else
        memcpy(dst, q, n * sizeof *dst);
}

/* Whether the row at pos has more than TDM_ATTN_SPAN keys in this layer */
static bool attn_row_long(const cpu_be_t *be, uint32_t layer, uint32_t pos)
{
    return pos + 1 - tdm_llama_layer_first_key(be->hp, layer, pos) > TDM_ATTN_SPAN;
}

/* Rows t .. t + m - 1 of the pass against KV head g (m > 1 only for consecutive positions of
 * one sequence on the grouped path): the short rows as a run (attn_run), the long ones as a
 * run of spans (attn_run_span), or without the grouped kernels (an f32 cache, the scalar set's
 * q8) head by head. Scratch: thread tid's. */
static void attn_rows(const cpu_be_t *be, uint32_t layer, const float *q,
                      const tdm_fwd_rows_t *rows, uint32_t t, uint32_t m, uint32_t g, int tid,
                      bool grouped, float *out)
{
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t H = hp->n_heads, D = hp->head_dim, group = H / hp->n_kv_heads;
    const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
    float *sc = be->scores + (size_t)tid * TDM_ATTN_QTILE * group * be->sc_ld;
    float *tmp = be->kvrow + (size_t)tid * (3 * TDM_ATTN_QTILE * group + 2) * D;
    float *qr = tmp + 2 * D, *ob = qr + (size_t)TDM_ATTN_QTILE * group * D;
    float *os = ob + (size_t)TDM_ATTN_QTILE * group * D;
    if (grouped) {
        for (uint32_t i0 = 0; i0 < m;) {
            bool lng = attn_row_long(be, layer, rows->pos[t + i0]);
            uint32_t n = 1; /* rows' key counts only grow along a run: short ones, then long */
            while (i0 + n < m && attn_row_long(be, layer, rows->pos[t + i0 + n]) == lng)
                n++;
            for (uint32_t i = 0; i < n; i++)
                attn_query(be, qr + (size_t)i * group * D,
                           q + ((size_t)(t + i0 + i) * H + (size_t)g * group) * D, group);
            if (lng)
                attn_run_span(be, layer, sq, g, qr, group, n, rows->pos[t + i0], sc, be->sc_ld, ob,
                              os, be->run_ml + (size_t)tid * 4 * TDM_ATTN_QTILE * group);
            else
                attn_run(be, layer, sq, g, qr, group, n, rows->pos[t + i0], sc, be->sc_ld, ob);
            for (uint32_t i = 0; i < n; i++)
                memcpy(out + ((size_t)(t + i0 + i) * H + (size_t)g * group) * D,
                       ob + (size_t)i * group * D, (size_t)group * D * sizeof(float));
            i0 += n;
        }
        return;
    }
    const float *qg = q + ((size_t)t * H + (size_t)g * group) * D;
    float *og = out + ((size_t)t * H + (size_t)g * group) * D;
    uint32_t n_pos = rows->pos[t] + 1;
    uint32_t first = tdm_llama_layer_first_key(hp, layer, rows->pos[t]);
    if (be->kl.dtype == TDM_KV_F16) {
        be->isa->round_f16(qr, qg, 1.0f, (size_t)group * D);
        qg = qr;
    }
    bool lng = n_pos - first > TDM_ATTN_SPAN;
    for (uint32_t h = 0; h < group; h++) {
        if (lng)
            attn_head_long(be, layer, sq, g, qg + (size_t)h * D, first, n_pos, sc, tmp,
                           og + (size_t)h * D);
        else
            attn_head(be, layer, sq, g, qg + (size_t)h * D, first, n_pos, sc, tmp,
                      og + (size_t)h * D);
    }
}

/* One span item of a split decode pass: row t's keys a .. b - 1 against KV head g, its group's
 * partials into span_o / span_ml at index pidx (the heads' [head_dim] outputs, then max and
 * sum pairs). */
static void attn_split_span(const cpu_be_t *be, uint32_t layer, const float *q,
                            const tdm_fwd_rows_t *rows, uint32_t t, uint32_t g, uint32_t first,
                            uint32_t a, uint32_t b, size_t pidx, int tid, bool grouped)
{
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t H = hp->n_heads, D = hp->head_dim, group = H / hp->n_kv_heads;
    const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
    float *sc = be->scores + (size_t)tid * TDM_ATTN_QTILE * group * be->sc_ld;
    float *tmp = be->kvrow + (size_t)tid * (3 * TDM_ATTN_QTILE * group + 2) * D;
    float *qr = tmp + 2 * D;
    double *ml = be->run_ml + (size_t)tid * 4 * TDM_ATTN_QTILE * group;
    float *os = be->span_o + pidx * D;
    double *pml = be->span_ml + pidx * 2;
    const float *qg = q + ((size_t)t * H + (size_t)g * group) * D;
    if (be->kl.dtype == TDM_KV_F16) {
        be->isa->round_f16(qr, qg, 1.0f, (size_t)group * D);
        qg = qr;
    }
    if (grouped) {
        run_scores(be, layer, sq, g, qg, group, a, b, sc, be->sc_ld);
        span_softmax(be, group, 1, rows->pos[t], &first, sc, be->sc_ld, a, a, b, ml, ml + group);
        memset(os, 0, (size_t)group * D * sizeof(float));
        run_pv(be, layer, sq, g, os, group, 1, rows->pos[t], &first, sc, be->sc_ld, a, a, b);
        for (uint32_t h = 0; h < group; h++) {
            pml[2 * h] = ml[h];
            pml[2 * h + 1] = ml[group + h];
        }
        return;
    }
    for (uint32_t h = 0; h < group; h++)
        head_span(be, layer, sq, g, qg + (size_t)h * D, a, b, sc, tmp, os + (size_t)h * D,
                  &pml[2 * h], &pml[2 * h + 1]);
}

/* A decode pass of at most be->split_rows rows, some long: each long row's (KV head, span)
 * pairs are work items of their own (a short row's KV heads one item each, as in the plain
 * pass), so a lone row's keys spread over every thread. The thread that finishes a (row, KV
 * head)'s last span folds its partials in span order (an acquire-release count, no barrier):
 * the bits attn_rows gives the row. */
static void attn_split(cpu_be_t *be, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                       bool grouped, bool par, float *out)
{
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t H = hp->n_heads, KVH = hp->n_kv_heads, D = hp->head_dim, group = H / KVH;
    uint32_t first[TDM_ATTN_SPLIT_ROWS], ns[TDM_ATTN_SPLIT_ROWS], off[TDM_ATTN_SPLIT_ROWS + 1];
    off[0] = 0;
    for (uint32_t t = 0; t < rows->n; t++) {
        first[t] = tdm_llama_layer_first_key(hp, layer, rows->pos[t]);
        ns[t] = attn_row_long(be, layer, rows->pos[t])
                    ? rows->pos[t] / TDM_ATTN_SPAN - first[t] / TDM_ATTN_SPAN + 1
                    : 0;
        off[t + 1] = off[t] + KVH * (ns[t] ? ns[t] : 1);
        for (uint32_t g = 0; g < KVH; g++)
            atomic_store_explicit(&be->span_left[t * KVH + g], ns[t], memory_order_relaxed);
    }
    int64_t n_items = off[rows->n];
#pragma omp parallel for schedule(dynamic, 1) num_threads(be->n_threads) if (par)
    for (int64_t it = 0; it < n_items; it++) {
        uint32_t t = 0;
        while (off[t + 1] <= (uint32_t)it)
            t++;
        uint32_t local = (uint32_t)it - off[t];
        int tid = omp_get_thread_num();
        if (!ns[t]) {
            attn_rows(be, layer, q, rows, t, 1, local, tid, grouped, out);
            continue;
        }
        uint32_t g = local / ns[t], ci = local % ns[t];
        uint32_t a = (first[t] / TDM_ATTN_SPAN + ci) * TDM_ATTN_SPAN;
        a = a > first[t] ? a : first[t];
        uint32_t b = span_end(a, rows->pos[t] + 1);
        size_t base = (size_t)(t * KVH + g) * be->max_spans;
        attn_split_span(be, layer, q, rows, t, g, first[t], a, b, (base + ci) * group, tid,
                        grouped);
        if (atomic_fetch_sub_explicit(&be->span_left[t * KVH + g], 1, memory_order_acq_rel) != 1)
            continue;
        for (uint32_t h = 0; h < group; h++) { /* the last span done: fold in span order */
            float *o = out + ((size_t)t * H + (size_t)g * group + h) * D, mx = 0.0f;
            double l = 0.0;
            for (uint32_t c = 0; c < ns[t]; c++) {
                size_t p = (base + c) * group + h;
                span_fold(&mx, &l, o, (float)be->span_ml[2 * p], be->span_ml[2 * p + 1],
                          be->span_o + p * D, D, c == 0);
            }
            span_finish(o, l, D);
        }
    }
}

/* Causal scaled dot-product attention (Vaswani et al. 2017) with GQA: query head h reads KV
 * head h / (n_heads / n_kv_heads). Scores over positions 0..pos in order (from
 * pos + 1 - n_swa in a sliding-window layer: the keys llama.cpp's SWA mask leaves; a masked
 * key's exp is an exact 0 there, so skipping it sums the same terms), softmax with the
 * max subtracted, then the weighted sum of V rows in order; a row with more than
 * TDM_ATTN_SPAN keys in spans folded in order (above). Work items are (tile of
 * TDM_ATTN_QTILE rows, or one row when no two rows are consecutive positions, KV head): the heads
 * of a group run together, and with an f16 or q8 cache through the grouped kernels (the scalar
 * set has none for q8: its reference path gives the same bits), consecutive positions of one
 * sequence within the tile as one run (attn_run), which gives each row the bits it has alone
 * (batch invariance). A decode pass of up to split_rows rows with a long one makes each
 * of its spans an item (attn_split), the same bits on any number of threads. With an f16 cache
 * the query and the probabilities are rounded to f16 too, as llama.cpp's f16 mat-muls of KQ and
 * KQV do, so the two engines round alike. */
int tdm_cpu_attention(void *vbe, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                      float *out)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t KVH = hp->n_kv_heads, D = hp->head_dim;
    bool f16 = be->kl.dtype == TDM_KV_F16, q8 = be->kl.dtype == TDM_KV_Q8;
    bool grouped = (f16 && be->isa->scores_f16 && be->isa->pv_f16) ||
                   (q8 && be->isa->scores_q8 && be->isa->pv_q8);
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
    bool any_long = false;
    for (uint32_t t = 0; t < rows->n; t++) {
        kv_values += ((size_t)rows->pos[t] + 1) * KVH * D * 2;
        any_long = any_long || attn_row_long(be, layer, rows->pos[t]);
    }
    bool par = kv_values >= 4 * be->par_min;
    if (qtile == 1 && any_long && par && rows->n <= be->split_rows) {
        attn_split(be, layer, q, rows, grouped, par, out);
        return TDM_OK;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(be->n_threads) if (par)
    for (int64_t it = 0; it < n_items; it++) {
        uint32_t r0 = (uint32_t)(it / KVH) * qtile, g = (uint32_t)(it % KVH);
        uint32_t r1 = r0 + qtile < rows->n ? r0 + qtile : rows->n;
        int tid = omp_get_thread_num();
        for (uint32_t t = r0; t < r1;) {
            uint32_t m = 1;
            while (grouped && t + m < r1 && rows->seq[t + m] == rows->seq[t] &&
                   rows->pos[t + m] == rows->pos[t] + m)
                m++;
            attn_rows(be, layer, q, rows, t, m, g, tid, grouped, out);
            t += m;
        }
    }
    return TDM_OK;
}
