/* sampling.c - sampling parameters, presets and the token sampler (see tandem/sampling.h).
 *
 * How it stays O(n_vocab), allocation-free and deterministic:
 *  - Every step is a pass over the vocabulary. Top-k and top-p never sort: they find their
 *    boundary token by a three-level radix selection (11 + 11 + 10 bits of an order-preserving
 *    integer key of the logit; ties by token id), then zero the weights of the tokens that rank
 *    after it. The draw walks the kept tokens in token-id order, so no order is ever needed
 *    beyond the boundary.
 *  - Weights are our own exp() (Cephes' expf polynomial, relative error < 1e-7), so a token
 *    does not depend on the libm version; sums are double, in a fixed association order
 *    (8 lanes per block of 256 tokens, blocks in order). Element-wise loops are marked
 *    `omp simd`; vectorizing them does not change a bit because nothing is reassociated.
 *  - Floating-point contraction (FMA) is off: GCC's default for ISO C, clang by the pragma.
 *  - Zeros are made +0 (x + 0.0f) so -0 and +0 have one key and rank as ties.
 * All scratch lives in the sampler, sized in tdm_sampler_new.
 */
#include "tandem/sampling.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(_OPENMP)
#define TDM_PRAGMA(x) _Pragma(#x)
#define TDM_SIMD TDM_PRAGMA(omp simd)
#define TDM_SIMD_REDUCE(op, var) TDM_PRAGMA(omp simd reduction(op : var))
#else
#define TDM_SIMD
#define TDM_SIMD_REDUCE(op, var)
#endif

/* The passes over the vocabulary are most of a call's time: on x86-64 they also get an AVX2
 * build, picked at load time. Same operations in wider registers, so the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define TDM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TDM_CLONES
#endif

#define BLOCK 256       /* tokens per partial sum (the draw finds its block first) */
#define RADIX_BINS 2048 /* buckets per radix level (11 bits) */
#define RADIX_SUB 4     /* interleaved copies of the first level's histogram */

/* A token in radix selection: its id and the order-preserving key of its logit. */
typedef struct cand {
    int32_t id;
    uint32_t key;
} cand_t;

/* The last kept token in rank order: kept = {i : key_i > key, or key_i == key and i <= id}. */
typedef struct boundary {
    uint32_t key;
    int32_t id;
} boundary_t;

struct tdm_sampler {
    uint32_t n_vocab;
    float *logits;     /* [n_vocab] penalized logits, zeros as +0 */
    float *w;          /* [n_vocab] weights exp((logit - max) / T), 0 when dropped */
    double *block_sum; /* [ceil(n_vocab / BLOCK)] sums of w per block */
    uint32_t *counts;  /* [n_vocab] occurrences in the penalty window; all 0 between
                          calls */
    int32_t *uniq;     /* [n_vocab] distinct tokens of the penalty window */
    cand_t *cand;      /* [n_vocab] radix selection candidates */
    uint32_t bin_n[RADIX_SUB][RADIX_BINS]; /* tokens per radix bucket (sub-histograms) */
    double bin_w[RADIX_SUB][RADIX_BINS];   /* weight per radix bucket (top-p) */
    tdm_error_t err;                       /* last failure of tdm_sampler_sample */
};

/* ---- parameters ---- */

void tdm_sampling_params_default(tdm_sampling_params_t *p)
{
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
    p->presence_penalty = 0.0f;
    p->frequency_penalty = 0.0f;
    p->penalty_last_n = TDM_SAMPLING_DEFAULT_PENALTY_LAST_N;
    p->seed = 0;
    p->max_tokens = TDM_SAMPLING_DEFAULT_MAX_TOKENS;
    p->n_stop_token_ids = 0;
    p->ignore_eos = false;
    p->n_logprobs = 0;
}

/* Presets: only temperature and top_p; immutable. */
static const struct {
    const char *name;
    float temperature;
    float top_p;
} presets[] = {
    {"precise", 0.0f, 1.0f},
    {"chat", 0.7f, 0.9f},
    {"creative", 0.95f, 0.95f},
};

int tdm_sampling_preset(const char *name, tdm_sampling_params_t *p, tdm_error_t *err)
{
    for (size_t i = 0; name && i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name) == 0) {
            p->temperature = presets[i].temperature;
            p->top_p = presets[i].top_p;
            return TDM_OK;
        }
    }
    return tdm_error_set(err, TDM_EINVALID,
                         "unknown sampling preset '%s' (presets: precise, chat, creative)",
                         name ? name : "(null)");
}

/* True when lo <= x <= hi; false for NaN. */
static bool in_closed(float x, float lo, float hi)
{
    return x >= lo && x <= hi;
}

int tdm_sampling_params_validate(const tdm_sampling_params_t *p, uint32_t n_vocab, tdm_error_t *err)
{
    const int e = TDM_EINVALID;
    if (!in_closed(p->temperature, 0.0f, TDM_SAMPLING_MAX_TEMPERATURE))
        return tdm_error_set(err, e, "temperature must be in [0, %g], got %g",
                             (double)TDM_SAMPLING_MAX_TEMPERATURE, (double)p->temperature);
    if (p->top_k < 0 || (n_vocab && (uint32_t)p->top_k > n_vocab)) {
        if (n_vocab)
            return tdm_error_set(err, e, "top_k must be in [0, %u], got %d", n_vocab, p->top_k);
        return tdm_error_set(err, e, "top_k must be >= 0, got %d", p->top_k);
    }
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return tdm_error_set(err, e, "top_p must be in (0, 1], got %g", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p < 1.0f))
        return tdm_error_set(err, e, "min_p must be in [0, 1), got %g", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f &&
          p->repetition_penalty <= TDM_SAMPLING_MAX_REPETITION_PENALTY))
        return tdm_error_set(err, e, "repetition_penalty must be in (0, %g], got %g",
                             (double)TDM_SAMPLING_MAX_REPETITION_PENALTY,
                             (double)p->repetition_penalty);
    if (!in_closed(p->presence_penalty, -TDM_SAMPLING_MAX_PENALTY, TDM_SAMPLING_MAX_PENALTY))
        return tdm_error_set(err, e, "presence_penalty must be in [-%g, %g], got %g",
                             (double)TDM_SAMPLING_MAX_PENALTY, (double)TDM_SAMPLING_MAX_PENALTY,
                             (double)p->presence_penalty);
    if (!in_closed(p->frequency_penalty, -TDM_SAMPLING_MAX_PENALTY, TDM_SAMPLING_MAX_PENALTY))
        return tdm_error_set(err, e, "frequency_penalty must be in [-%g, %g], got %g",
                             (double)TDM_SAMPLING_MAX_PENALTY, (double)TDM_SAMPLING_MAX_PENALTY,
                             (double)p->frequency_penalty);
    if (p->penalty_last_n < -1)
        return tdm_error_set(err, e, "penalty_last_n must be >= -1 (-1 = all, 0 = off), got %d",
                             p->penalty_last_n);
    if (p->max_tokens < 1)
        return tdm_error_set(err, e, "max_tokens must be >= 1, got %d", p->max_tokens);
    if (p->n_stop_token_ids > TDM_SAMPLING_MAX_STOP)
        return tdm_error_set(err, e, "n_stop_token_ids must be in [0, %d], got %u",
                             TDM_SAMPLING_MAX_STOP, p->n_stop_token_ids);
    for (uint32_t i = 0; i < p->n_stop_token_ids; i++) {
        int32_t t = p->stop_token_ids[i];
        if (t < 0 || (n_vocab && (uint32_t)t >= n_vocab)) {
            if (n_vocab)
                return tdm_error_set(err, e, "stop_token_ids[%u] must be in [0, %u), got %d", i,
                                     n_vocab, t);
            return tdm_error_set(err, e, "stop_token_ids[%u] must be >= 0, got %d", i, t);
        }
    }
    int32_t max_logprobs = TDM_SAMPLING_MAX_LOGPROBS;
    if (n_vocab && n_vocab < (uint32_t)max_logprobs)
        max_logprobs = (int32_t)n_vocab;
    if (p->n_logprobs < 0 || p->n_logprobs > max_logprobs)
        return tdm_error_set(err, e, "n_logprobs must be in [0, %d], got %d", max_logprobs,
                             p->n_logprobs);
    return TDM_OK;
}

bool tdm_sampling_is_stop(const tdm_sampling_params_t *p, int32_t token)
{
    uint32_t n =
        p->n_stop_token_ids < TDM_SAMPLING_MAX_STOP ? p->n_stop_token_ids : TDM_SAMPLING_MAX_STOP;
    for (uint32_t i = 0; i < n; i++)
        if (p->stop_token_ids[i] == token)
            return true;
    return false;
}

/* ---- counter-based randomness ---- */

/* SplitMix64's step as a pure function of x (Steele, Lea & Flood 2014; Vigna's splitmix64.c). */
static uint64_t splitmix64(uint64_t x)
{
    uint64_t z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double tdm_sampling_uniform(uint64_t seed, uint64_t index)
{
    return (double)(splitmix64(seed ^ splitmix64(index)) >> 11) * 0x1.0p-53;
}

/* ---- arithmetic helpers ---- */

static inline uint32_t float_bits(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

static inline float bits_float(uint32_t b)
{
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* An unsigned key with the order of the float (-inf lowest); +0 and -0 differ, which is why
 * logits are stored with +0 only. */
static inline uint32_t logit_key(float x)
{
    uint32_t b = float_bits(x);
    uint32_t neg = 0u - (b >> 31); /* all ones for negative x */
    return b ^ (neg | 0x80000000u);
}

/* The logit of a key (the inverse of logit_key). */
static inline float key_logit(uint32_t key)
{
    uint32_t neg = 0u - (uint32_t)((key >> 31) == 0); /* all ones for negative logits */
    return bits_float(key ^ (neg | 0x80000000u));
}

/* e^x for x <= 0, branch-free so loops vectorize: 0 for x < -87 (and -inf), else Cephes'
 * expf (range reduction by ln 2 in two parts, degree-6 polynomial), relative error < 1e-7.
 * e^0 is exactly 1. */
static inline float exp_neg(float x)
{
    uint32_t xb = float_bits(x);
    uint32_t keep = 0u - (uint32_t)((xb & 0x7fffffffu) <= 0x42ae0000u); /* |x| <= 87 */
    float v = bits_float((xb & keep) | (0xc2ae0000u & ~keep));          /* else -87 */
    /* n = round(v / ln 2) by the 1.5 * 2^23 trick: t's low mantissa bits hold n. */
    float t = v * 1.44269504088896341f + 12582912.0f;
    float n = t - 12582912.0f;
    float r = v - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float q = 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    q = q * r * r + r + 1.0f;
    uint32_t scale = (float_bits(t) - 0x4b400000u + 127u) << 23; /* 2^n, n in [-126, 0] */
    return bits_float(float_bits(q * bits_float(scale)) & keep);
}

/* w[i] = exp_neg((l[i] - max) * inv_t) for i < n. */
TDM_CLONES static void fill_weights(const float *restrict l, float *restrict w, size_t n, float max,
                                    float inv_t)
{
    TDM_SIMD
    for (size_t i = 0; i < n; i++)
        w[i] = exp_neg((l[i] - max) * inv_t);
}

/* Sums w[0..n) per block of BLOCK into bsum and returns the total: 8 lanes per block, lanes
 * and then blocks added in a fixed order (so the result does not depend on vectorization). */
TDM_CLONES static double sum_blocks(const float *w, size_t n, double *bsum)
{
    double total = 0.0;
    for (size_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        size_t hi = n - lo < BLOCK ? n : lo + BLOCK;
        double acc[8] = {0};
        size_t i = lo;
        for (; i + 8 <= hi; i += 8)
            for (size_t j = 0; j < 8; j++)
                acc[j] += (double)w[i + j];
        for (size_t j = 0; i < hi; i++, j++)
            acc[j] += (double)w[i];
        double sum =
            ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        bsum[b] = sum;
        total += sum;
    }
    return total;
}

/* The token at which the running sum of w, in token-id order, first exceeds target
 * (inverse CDF); the blocks' sums find the block. Rounding can leave no such token (target
 * at the very top): then the last token of positive weight. Requires some w > 0. */
static int32_t walk_cdf(const float *w, size_t n, const double *bsum, double target)
{
    double cum = 0.0;
    for (size_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        if (!(target < cum + bsum[b])) {
            cum += bsum[b];
            continue;
        }
        size_t hi = n - lo < BLOCK ? n : lo + BLOCK;
        size_t last = hi;
        for (size_t i = lo; i < hi; i++) {
            if (w[i] <= 0.0f)
                continue;
            cum += (double)w[i];
            last = i;
            if (target < cum)
                return (int32_t)i;
        }
        TDM_ASSERT(last < hi); /* bsum[b] > 0: the block has a positive weight */
        return (int32_t)last;
    }
    size_t i = n;
    while (i > 0 && !(w[i - 1] > 0.0f))
        i--;
    TDM_ASSERT(i > 0);
    return (int32_t)(i - 1);
}

/* ---- radix selection of the top-k / top-p boundary ---- */

/* Scans buckets from the highest; returns the first at which *above plus its weight reaches
 * target, adding the weights passed over to *above. When rounding leaves none, the lowest
 * non-empty bucket. weight = bin_w (mass) or bin_n (count), both in sub-histogram 0. */
static uint32_t radix_pick(const tdm_sampler_t *s, uint32_t n_bins, bool mass, double target,
                           double *above)
{
    uint32_t lowest = n_bins;
    for (uint32_t b = n_bins; b-- > 0;) {
        if (s->bin_n[0][b] == 0)
            continue;
        double wb = mass ? s->bin_w[0][b] : (double)s->bin_n[0][b];
        if (*above + wb >= target)
            return b;
        *above += wb;
        lowest = b;
    }
    TDM_ASSERT(lowest < n_bins);
    return lowest;
}

/* Histograms the candidates cand[0..n) on bits [shift, shift + log2(n_bins)) of their key,
 * picks the boundary bucket and keeps only its candidates (in order). Returns how many
 * remain. */
static size_t radix_level(tdm_sampler_t *s, size_t n, uint32_t shift, uint32_t n_bins,
                          const float *wt, double target, double *above)
{
    uint32_t mask = n_bins - 1;
    memset(s->bin_n[0], 0, sizeof s->bin_n[0]);
    memset(s->bin_w[0], 0, sizeof s->bin_w[0]);
    for (size_t j = 0; j < n; j++) {
        uint32_t b = (s->cand[j].key >> shift) & mask;
        s->bin_n[0][b]++;
        if (wt)
            s->bin_w[0][b] += (double)wt[s->cand[j].id];
    }
    uint32_t pick = radix_pick(s, n_bins, wt != NULL, target, above);
    size_t m = 0;
    for (size_t j = 0; j < n; j++)
        if (((s->cand[j].key >> shift) & mask) == pick)
            s->cand[m++] = s->cand[j];
    return m;
}

/* Level-1 histogram of the whole vocabulary on the key's top 11 bits. Logits crowd into a
 * few buckets, so token i goes to sub-histogram i % RADIX_SUB (no wait on the previous
 * token's store); the copies are then added, in a fixed order, into sub-histogram 0. */
static void radix_hist_all(tdm_sampler_t *s, const float *wt)
{
    _Static_assert(RADIX_SUB == 4, "the loops below are unrolled by 4");
    const float *l = s->logits;
    size_t n = s->n_vocab, n4 = n - n % RADIX_SUB;
    memset(s->bin_n, 0, sizeof s->bin_n);
    if (wt) {
        memset(s->bin_w, 0, sizeof s->bin_w);
        for (size_t i = 0; i < n4; i += RADIX_SUB) {
            uint32_t b0 = logit_key(l[i]) >> 21, b1 = logit_key(l[i + 1]) >> 21;
            uint32_t b2 = logit_key(l[i + 2]) >> 21, b3 = logit_key(l[i + 3]) >> 21;
            s->bin_n[0][b0]++;
            s->bin_n[1][b1]++;
            s->bin_n[2][b2]++;
            s->bin_n[3][b3]++;
            s->bin_w[0][b0] += (double)wt[i];
            s->bin_w[1][b1] += (double)wt[i + 1];
            s->bin_w[2][b2] += (double)wt[i + 2];
            s->bin_w[3][b3] += (double)wt[i + 3];
        }
        for (size_t i = n4; i < n; i++) {
            uint32_t b = logit_key(l[i]) >> 21;
            s->bin_n[0][b]++;
            s->bin_w[0][b] += (double)wt[i];
        }
    } else {
        for (size_t i = 0; i < n4; i += RADIX_SUB) {
            s->bin_n[0][logit_key(l[i]) >> 21]++;
            s->bin_n[1][logit_key(l[i + 1]) >> 21]++;
            s->bin_n[2][logit_key(l[i + 2]) >> 21]++;
            s->bin_n[3][logit_key(l[i + 3]) >> 21]++;
        }
        for (size_t i = n4; i < n; i++)
            s->bin_n[0][logit_key(l[i]) >> 21]++;
    }
    for (uint32_t b = 0; b < RADIX_BINS; b++) {
        s->bin_n[0][b] += s->bin_n[1][b] + s->bin_n[2][b] + s->bin_n[3][b];
        if (wt)
            s->bin_w[0][b] = (s->bin_w[0][b] + s->bin_w[1][b]) + (s->bin_w[2][b] + s->bin_w[3][b]);
    }
}

/* Puts the tokens whose key's top 11 bits are `bucket` in cand, in id order; returns how
 * many. Usually few match, so blocks of 16 are first tested at once. */
TDM_CLONES static size_t radix_gather(tdm_sampler_t *s, uint32_t bucket)
{
    const float *l = s->logits;
    size_t n = s->n_vocab, m = 0;
    for (size_t lo = 0; lo < n; lo += 16) {
        size_t hi = n - lo < 16 ? n : lo + 16;
        uint32_t any = 0;
        TDM_SIMD_REDUCE(|, any)
        for (size_t i = lo; i < hi; i++)
            any |= (uint32_t)((logit_key(l[i]) >> 21) == bucket);
        if (!any)
            continue;
        for (size_t i = lo; i < hi; i++) {
            uint32_t key = logit_key(l[i]);
            if ((key >> 21) == bucket)
                s->cand[m++] = (cand_t){.id = (int32_t)i, .key = key};
        }
    }
    return m;
}

/* Finds the last token of the shortest rank prefix (logit descending, id ascending) that
 * reaches the target: k tokens when wt is NULL (top-k; needs 0 < k < n_vocab), or a fraction
 * top_p of the total of wt (top-p; needs the top-ranked token's weight > 0). */
static boundary_t radix_select(tdm_sampler_t *s, const float *wt, uint32_t k, float top_p)
{
    /* Level 1 over the whole vocabulary: the key's top 11 bits. */
    radix_hist_all(s, wt);
    double target = (double)k;
    if (wt) {
        /* The total in the scan's order, so the scan reaches it exactly. */
        double total = 0.0;
        for (uint32_t b = RADIX_BINS; b-- > 0;)
            total += s->bin_w[0][b];
        target = (double)top_p * total;
    }
    double above = 0.0;
    uint32_t pick = radix_pick(s, RADIX_BINS, wt != NULL, target, &above);
    size_t m = radix_gather(s, pick);

    /* Levels 2 and 3 over the boundary bucket: 11 then 10 more bits; then keys are equal. */
    m = radix_level(s, m, 10, RADIX_BINS, wt, target, &above);
    m = radix_level(s, m, 0, 1u << 10, wt, target, &above);

    /* Equal logits: by token id (cand is in id order). */
    for (size_t j = 0; j < m; j++) {
        above += wt ? (double)wt[s->cand[j].id] : 1.0;
        if (above >= target)
            return (boundary_t){.key = s->cand[j].key, .id = s->cand[j].id};
    }
    return (boundary_t){.key = s->cand[m - 1].key, .id = s->cand[m - 1].id};
}

/* Zeroes the weights of tokens ranked after the boundary. */
TDM_CLONES static void drop_after(float *restrict w, const float *restrict l, size_t n,
                                  boundary_t bd)
{
    TDM_SIMD
    for (size_t i = 0; i < n; i++) {
        uint32_t key = logit_key(l[i]);
        uint32_t kept = (uint32_t)(key > bd.key) |
                        ((uint32_t)(key == bd.key) & (uint32_t)((uint32_t)i <= (uint32_t)bd.id));
        w[i] = bits_float(float_bits(w[i]) & (0u - kept));
    }
}

/* Zeroes weights below min_p: the most likely token weighs exactly 1, so w < min_p is
 * p < min_p * p_max. Weights are >= 0, whose bit patterns order like their values. */
static void drop_below(float *w, size_t n, float min_p)
{
    uint32_t lim = float_bits(min_p);
    TDM_SIMD
    for (size_t i = 0; i < n; i++) {
        uint32_t wb = float_bits(w[i]);
        w[i] = bits_float(wb & (0u - (uint32_t)(wb >= lim)));
    }
}

/* ---- the sampler ---- */

tdm_sampler_t *tdm_sampler_new(uint32_t n_vocab, tdm_error_t *err)
{
    if (n_vocab == 0 || n_vocab > (uint32_t)INT32_MAX) {
        tdm_error_set(err, TDM_EINVALID, "n_vocab must be in [1, %d], got %u", INT32_MAX, n_vocab);
        return NULL;
    }
    tdm_sampler_t *s = calloc(1, sizeof *s);
    if (!s)
        goto out_oom;
    size_t n = n_vocab;
    s->n_vocab = n_vocab;
    s->logits = calloc(n, sizeof *s->logits);
    s->w = calloc(n, sizeof *s->w);
    s->block_sum = calloc((n + BLOCK - 1) / BLOCK, sizeof *s->block_sum);
    s->counts = calloc(n, sizeof *s->counts);
    s->uniq = calloc(n, sizeof *s->uniq);
    s->cand = calloc(n, sizeof *s->cand);
    if (!s->logits || !s->w || !s->block_sum || !s->counts || !s->uniq || !s->cand)
        goto out_destroy;
    return s;

out_destroy:
    tdm_sampler_destroy(&s);
out_oom:
    tdm_error_set(err, TDM_ERESOURCE, "out of memory for a sampler of %u tokens", n_vocab);
    return NULL;
}

void tdm_sampler_destroy(tdm_sampler_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_sampler_t *s = *self_p;
    free(s->cand);
    free(s->uniq);
    free(s->counts);
    free(s->block_sum);
    free(s->w);
    free(s->logits);
    free(s);
    *self_p = NULL;
}

uint32_t tdm_sampler_n_vocab(const tdm_sampler_t *s)
{
    return s->n_vocab;
}

const char *tdm_sampler_errmsg(const tdm_sampler_t *s)
{
    return s->err.msg;
}

/* Copies logits into s->logits with zeros made +0; TDM_EINVALID on NaN or +inf. */
static int load_logits(tdm_sampler_t *s, const float *restrict logits)
{
    float *restrict l = s->logits;
    size_t n = s->n_vocab;
    uint32_t bad = 0;
    TDM_SIMD_REDUCE(|, bad)
    for (size_t i = 0; i < n; i++) {
        float x = logits[i] + 0.0f;
        uint32_t b = float_bits(x);
        /* NaN: magnitude above inf's; +inf: exactly inf's pattern. */
        bad |= (uint32_t)((b & 0x7fffffffu) > 0x7f800000u) | (uint32_t)(b == 0x7f800000u);
        l[i] = x;
    }
    if (!bad)
        return TDM_OK;
    for (size_t i = 0; i < n; i++)
        if (isnan(logits[i]) || logits[i] == INFINITY)
            return tdm_error_set(&s->err, TDM_EINVALID, "logits[%zu] is %g", i, (double)logits[i]);
    return TDM_OK; /* not reached */
}

/* Applies repetition, frequency and presence penalties to the tokens of the window (the last
 * penalty_last_n of history) as llama.cpp's llama_sampler_penalties does: per distinct token
 * with count c, logit = logit > 0 ? logit / r : logit * r, then
 * logit -= c * frequency + presence. TDM_EINVALID for a window token outside the vocabulary. */
static int apply_penalties(tdm_sampler_t *s, const tdm_sampling_params_t *p, const int32_t *history,
                           size_t n_history)
{
    float rep = p->repetition_penalty, freq = p->frequency_penalty, pres = p->presence_penalty;
    if (p->penalty_last_n == 0 || (rep == 1.0f && freq == 0.0f && pres == 0.0f))
        return TDM_OK;
    size_t n_win = n_history;
    if (p->penalty_last_n > 0 && (size_t)p->penalty_last_n < n_history)
        n_win = (size_t)p->penalty_last_n;
    size_t first = n_history - n_win;
    for (size_t j = first; j < n_history; j++)
        if (history[j] < 0 || (uint32_t)history[j] >= s->n_vocab)
            return tdm_error_set(&s->err, TDM_EINVALID,
                                 "history[%zu] = %d is not a token id (n_vocab %u)", j, history[j],
                                 s->n_vocab);
    size_t n_uniq = 0;
    for (size_t j = first; j < n_history; j++)
        if (s->counts[history[j]]++ == 0)
            s->uniq[n_uniq++] = history[j];
    for (size_t u = 0; u < n_uniq; u++) {
        int32_t t = s->uniq[u];
        uint32_t c = s->counts[t];
        s->counts[t] = 0;
        float x = s->logits[t];
        if (rep != 1.0f)
            x = x <= 0.0f ? x * rep : x / rep;
        x -= (float)c * freq + pres;
        if (x > FLT_MAX) /* a tiny repetition penalty must not make +inf */
            x = FLT_MAX;
        s->logits[t] = x + 0.0f;
    }
    return TDM_OK;
}

/* The n most likely tokens (logit descending, id ascending) with logprob = logit - log_z. */
static void top_logprobs(const float *l, size_t n_vocab, uint32_t n, double log_z,
                         tdm_token_logprob_t *top)
{
    float best[TDM_SAMPLING_MAX_LOGPROBS];
    uint32_t have = 0;
    for (size_t i = 0; i < n_vocab && n > 0; i++) {
        float x = l[i];
        /* Strictly greater: an equal logit with a higher id ranks after. */
        if (have == n && !(x > best[n - 1]))
            continue;
        uint32_t pos = have < n ? have++ : n - 1;
        while (pos > 0 && x > best[pos - 1]) {
            best[pos] = best[pos - 1];
            top[pos] = top[pos - 1];
            pos--;
        }
        best[pos] = x;
        top[pos].token = (int32_t)i;
    }
    for (uint32_t j = 0; j < n; j++)
        top[j].logprob = (float)((double)best[j] - log_z);
}

/* Top-k, temperature, softmax, top-p, min-p and the draw, on s->logits whose maximum is max;
 * s->w holds the weights at temperature 1. Returns the token. */
static int32_t draw(tdm_sampler_t *s, const tdm_sampling_params_t *p, float max,
                    uint64_t output_index)
{
    size_t n = s->n_vocab;
    float inv_t = 1.0f / p->temperature;
    if (inv_t != 1.0f)
        fill_weights(s->logits, s->w, n, max, inv_t);
    if (p->top_k > 0 && (uint32_t)p->top_k < s->n_vocab)
        drop_after(s->w, s->logits, n, radix_select(s, NULL, (uint32_t)p->top_k, 0.0f));
    if (p->top_p < 1.0f)
        drop_after(s->w, s->logits, n, radix_select(s, s->w, 0, p->top_p));
    if (p->min_p > 0.0f)
        drop_below(s->w, n, p->min_p);
    double total = sum_blocks(s->w, n, s->block_sum);
    double u = tdm_sampling_uniform(p->seed, output_index);
    return walk_cdf(s->w, n, s->block_sum, u * total);
}

/* Excludes the tokens whose bit in mask is clear (their logits become -inf, so they get no
 * weight, no rank before an allowed token, and no share of the softmax). Returns how many
 * tokens are allowed. */
static uint32_t apply_mask(tdm_sampler_t *s, const uint32_t *mask)
{
    float *l = s->logits;
    uint32_t allowed = 0;
    for (size_t i = 0; i < s->n_vocab; i++) {
        bool on = (mask[i / 32] >> (i % 32)) & 1u;
        allowed += on;
        if (!on)
            l[i] = -INFINITY;
    }
    return allowed;
}

int tdm_sampler_sample(tdm_sampler_t *s, const tdm_sampling_params_t *p, const float *logits,
                       const int32_t *history, size_t n_history, uint64_t output_index,
                       tdm_sample_result_t *out)
{
    return tdm_sampler_sample_masked(s, p, logits, NULL, history, n_history, output_index, out);
}

int tdm_sampler_sample_masked(tdm_sampler_t *s, const tdm_sampling_params_t *p, const float *logits,
                              const uint32_t *mask, const int32_t *history, size_t n_history,
                              uint64_t output_index, tdm_sample_result_t *out)
{
    TDM_ASSERT(s && p && logits && out && (history || n_history == 0));
    tdm_error_clear(&s->err);
    int rc = tdm_sampling_params_validate(p, s->n_vocab, &s->err);
    if (rc != TDM_OK)
        return rc;
    rc = load_logits(s, logits);
    if (rc != TDM_OK)
        return rc;
    rc = apply_penalties(s, p, history, n_history);
    if (rc != TDM_OK)
        return rc;
    uint32_t allowed = mask ? apply_mask(s, mask) : s->n_vocab;
    if (allowed == 0)
        return tdm_error_set(&s->err, TDM_EINVALID, "the mask allows no token");

    const float *l = s->logits;
    size_t n = s->n_vocab;
    uint32_t kmax = 0; /* the maximum by key: integer lanes vectorize where floats do not */
    TDM_SIMD_REDUCE(max, kmax)
    for (size_t i = 0; i < n; i++) {
        uint32_t k = logit_key(l[i]);
        kmax = k > kmax ? k : kmax;
    }
    float lmax = key_logit(kmax);
    if (lmax == -INFINITY)
        return tdm_error_set(&s->err, TDM_EINVALID, "all %zu %slogits are -inf", n,
                             mask ? "allowed " : "");

    /* Log-softmax of the penalized (and masked) logits, for the reported logprobs. */
    fill_weights(l, s->w, n, lmax, 1.0f);
    double log_z = (double)lmax + log(sum_blocks(s->w, n, s->block_sum));
    out->n_top = (uint32_t)p->n_logprobs < allowed ? (uint32_t)p->n_logprobs : allowed;
    top_logprobs(l, n, out->n_top, log_z, out->top);

    int32_t token;
    if (p->temperature == 0.0f) {
        size_t argmax = 0; /* the first maximum: ties go to the lowest id */
        while (l[argmax] != lmax)
            argmax++;
        token = (int32_t)argmax;
    } else {
        token = draw(s, p, lmax, output_index);
    }
    out->token = token;
    out->logprob = (float)((double)l[token] - log_z);
    return TDM_OK;
}
