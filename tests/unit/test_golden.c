/* test_golden.c - the engine's logits and greedy continuations on the default model
 * (SmolLM2-135M-Instruct Q4_1) against llama.cpp's, recorded in tests/golden/smollm2_engine.json
 * by tests/golden/make_engine_golden.py.
 *
 * Teacher-forced: each case's prompt + llama.cpp's greedy continuation runs through our engine
 * (CPU, f16 KV, CHUNK rows per pass, logits for every row), and at every position we compare
 * our logits with llama.cpp's top-5: the argmax (>= 95% overall, >= 99% where llama.cpp's
 * top-1 leads its top-2 by >= 0.25, always where it leads by more than 1.0) and the five
 * logits (LOGIT_TOL*). The bounds and the data behind them are below.
 * Greedy: our own argmax continuation from the prompt, decoded one token per pass, must equal
 * llama.cpp's up to the first step where llama.cpp's margin for its token is below 1.0
 * (near-ties may flip), and pick what the teacher-forced pass picked. The greedy runs take
 * their prompts' full blocks from the prefix cache that the teacher-forced runs filled.
 *
 * The two implementations are not expected to be bitwise equal: both quantize activations to
 * 8 bits per 32-value block before the quantized dot products, but the rounding of the block
 * scales (f16 in ggml's q8_1), the order of the sums, attention, softmax, RoPE and the f16 KV
 * round trip differ; llama.cpp differs from itself about as much between its one-pass and
 * one-token-per-pass evaluations. The model is required (the test FAILS when it is missing and
 * says to run scripts/setup).
 */
#include "tdm_test.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/config.h"
#include "tandem/model.h"

#define GOLDEN_PATH TDM_SOURCE_DIR "/tests/golden/smollm2_engine.json"
#define GOLDEN_DIR TDM_SOURCE_DIR "/tests/golden/"
#define TOP_K 5
#define CHUNK 256  /* rows per forward pass, every one asking for logits */
#define N_CTX 2048 /* the golden cases are at most ~700 tokens */
#define BLOCK                                                                                      \
    16 /* tokens per KV block; the pool holds every case's KV, cached for the greedy               \
         test */

/* Bounds, set from the committed golden file: 16 cases, 2,953 positions, 14,765 top-5 logits
 * between -1 and 45. Beside Tandem's figures are llama.cpp's own against the same file,
 * evaluating one token per pass instead of one pass ("llama_cpp_self" in the file): the two
 * code paths of one implementation differ this much, so an independent implementation cannot
 * be held closer. Centered = each position's five differences minus their mean (a shift common
 * to all logits leaves the softmax unchanged; about half of the raw difference is such a shift).
 * Tandem's column spans four builds of the CPU kernels measured on 2026-11-30, while they were
 * being changed (AVX2+VNNI with f32 activation scales; AVX-512 VNNI at b47ccf3; two later
 * working-tree versions with f16-rounded activation scales):
 *                                           Tandem         llama.cpp self   bound
 *   argmax agreement, all positions          96.5-97.3%     97.4%            >= 95%
 *   argmax agreement where gap >= 0.25       99.6-99.96%    99.96%           >= 99%
 *   largest gap at a disagreement            0.28-0.50      0.27             1.0 (b)
 *   top-5 |diff|, max                        1.40-1.93      2.04             <= 2.5
 *   top-5 |diff|, mean                       0.163-0.168    0.144            <= 0.25
 *   centered |diff|, max                     0.74-0.86      1.03             <= 1.25
 * The largest raw differences (1.4-1.9) are at confident positions (gap 3-10) where all five
 * logits move together, e.g. chat_code_c position 49. The request was 99% argmax agreement
 * over all positions; llama.cpp does not reach it against itself (97.4%): about 3% of the
 * positions of a 135M model are near-ties (gap < 0.25) that rounding flips either way. The
 * 99% bound holds where the gap is >= 0.25. */
#define MIN_AGREEMENT 0.95
#define CLEAR_GAP 0.25f
#define MIN_AGREEMENT_CLEAR 0.99
/* Where llama.cpp's top-1 leads its top-2 by more than this, our argmax must be the same
 * (criterion b); twice the largest gap seen at a disagreement. */
#define CONFIDENT_GAP 1.0f
#define LOGIT_TOL 2.5           /* top-5 |ours - llama.cpp|, largest */
#define LOGIT_TOL_MEAN 0.25     /* top-5 |ours - llama.cpp|, mean over all */
#define LOGIT_TOL_CENTERED 1.25 /* centered, largest */
#define PRINT_DIFF 1.0          /* positions with a larger top-5 |diff| are listed */
/* Greedy continuations must match llama.cpp's up to the first step where llama.cpp's margin
 * for its token is below this. The request was 0.1, but llama.cpp's own one-token-per-pass
 * greedy run picked its one-pass runner-up at a gap of 0.22 (chat_spanish step 20) and
 * teacher-forced argmaxes differ at gaps up to 0.50, so the bound is that of (b): until the
 * first mismatch our greedy tokens are the reference's, so its logits there are the
 * teacher-forced ones. How many would fail at 0.1 is printed. */
#define NEAR_TIE_GAP CONFIDENT_GAP
#define NEAR_TIE_GAP_ASKED 0.1f

/* The bounds in force: the constants above for the default model's file; for another golden
 * file (argv), twice llama.cpp's own one-token-per-pass versus one-pass differences recorded in
 * it (fixed before Tandem is measured, as issue #21 asks): the top-5 logit differences (max,
 * mean, centered max) at most twice llama.cpp's, and where llama.cpp's gap is >= CLEAR_GAP at
 * most twice its own share of disagreeing positions. Gemma 3 270M (tests/golden/
 * gemma3_engine.json, 14 cases, 5,270 positions, 4,707 with gap >= 0.25), measured on the AMX
 * Xeon on 2026-12-05 against those bounds (Q5_0 on the integer kernels, GeGLU rounded as ggml,
 * activations quantized with ggml's x86 inverse scale 127 / amax; the 1 / d of 2026-12-04 in
 * brackets):
 *                                           Tandem           llama.cpp self   bound
 *   argmax agreement, all positions          96.98% (96.87)   97.17%           >= 95%
 *   argmax agreement where gap >= 0.25       99.64% (99.58)   99.66%           >= 99.32%
 *   largest gap at a disagreement            0.68 (0.53)      0.55             1.0
 *   top-5 |diff|, max                        8.37 (6.43)      5.06             <= 10.11
 *   top-5 |diff|, mean                       0.244 (0.242)    0.227            <= 0.453
 *   centered |diff|, max                     2.39 (2.21)      2.57             <= 5.13
 * Every position where llama.cpp leads by more than 1.0 (3,581) agrees. Gemma's logits run to
 * about 40, so its raw differences are larger than SmolLM2's; llama.cpp's own are too. */
typedef struct bounds {
    double min_agreement, min_agreement_clear;
    double logit_tol, logit_tol_mean, logit_tol_centered;
    double route_tol; /* models with experts: the file's max bound that all but MAX_ROUTED_OUT
                         of the positions must keep; 0 otherwise */
} bounds_t;

static bounds_t g_bounds = {MIN_AGREEMENT,  MIN_AGREEMENT_CLEAR, LOGIT_TOL,
                            LOGIT_TOL_MEAN, LOGIT_TOL_CENTERED,  0.0};

/* Models with experts (qwen3moe, Mixtral): a token's top-k experts are chosen by comparing
 * router probabilities, and where two of them are within an ulp the choice flips between any
 * two implementations, llama.cpp's own two passes included (qwen3moe_synth_f16 plain_math
 * position 70: 0.51 in llama.cpp against itself). Such a position moves by up to ~0.5 and its
 * neighbours barely. So for these files: every position keeps the fixed bounds above (LOGIT_TOL,
 * LOGIT_TOL_MEAN, LOGIT_TOL_CENTERED), at most MAX_ROUTED_OUT of the positions may exceed the
 * file's bound (twice llama.cpp's own largest difference), and at least MIN_CONFIDENT
 * positions must be confident (gap > CONFIDENT_GAP) and agree. Measured on the AVX-512 Xeon on
 * 2026-12-05 (scalar family): qwen3moe 0 of 1,870 positions over 1.02 (its file records a flip in
 * llama.cpp itself), mixtral 5 of 1,870 over 0.0052 (largest 0.50), 209 confident. */
#define MAX_ROUTED_OUT 0.01
#define MIN_CONFIDENT 200
static char g_golden_path[1024] = GOLDEN_PATH;
static const char *g_model_file; /* another model's file name, in the default model's folder,
                                     or an absolute path */
static bool g_bounds_from_file;  /* bounds from the file's llama_cpp_self */

/* One golden case, parsed from the JSON. */
typedef struct ref_case {
    const char *name; /* borrowed from the JSON document */
    int32_t *tokens;  /* [n] prompt then llama.cpp's continuation */
    uint32_t n;
    uint32_t n_prompt;
    int32_t (*top_tok)[TOP_K]; /* [n] llama.cpp's top-5 tokens after tokens[0..i] */
    float (*top_logit)[TOP_K]; /* [n] their logits, descending */
    int32_t *our_argmax;       /* [n] ours, teacher-forced (by test_teacher_forced) */
    bool have_argmax;          /* our_argmax is filled */
} ref_case_t;

typedef struct fixture {
    char model_path[1024];
    char problem[4096]; /* why the fixture is unusable; "" when it is fine */
    json_t *golden;
    ref_case_t *cases;
    uint32_t n_cases;
    int32_t eos;
    tdm_model_t *model;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    uint32_t n_vocab;
    float *logits; /* [CHUNK][n_vocab] */
} fixture_t;

/* ---- golden file ---- */

/* Parses one case into c; returns false with a message in problem when malformed. */
static bool parse_case(const json_t *jc, ref_case_t *c, char *problem, size_t cap)
{
    const json_t *toks = json_object_get(jc, "tokens");
    const json_t *pos = json_object_get(jc, "positions");
    c->name = json_string_value(json_object_get(jc, "name"));
    c->n = (uint32_t)json_array_size(toks);
    c->n_prompt = (uint32_t)json_integer_value(json_object_get(jc, "n_prompt"));
    if (!c->name || c->n == 0 || c->n_prompt == 0 || c->n_prompt > c->n ||
        json_array_size(pos) != c->n) {
        snprintf(problem, cap, "%s: malformed case %s", GOLDEN_PATH, c->name ? c->name : "?");
        return false;
    }
    c->tokens = calloc(c->n, sizeof *c->tokens);
    c->top_tok = calloc(c->n, sizeof *c->top_tok);
    c->top_logit = calloc(c->n, sizeof *c->top_logit);
    c->our_argmax = calloc(c->n, sizeof *c->our_argmax);
    if (!c->tokens || !c->top_tok || !c->top_logit || !c->our_argmax) {
        snprintf(problem, cap, "out of memory");
        return false;
    }
    for (uint32_t i = 0; i < c->n; i++) {
        c->tokens[i] = (int32_t)json_integer_value(json_array_get(toks, i));
        const json_t *row = json_array_get(pos, i);
        if (json_array_size(row) != TOP_K) {
            snprintf(problem, cap, "%s: case %s position %u has no top-%d", GOLDEN_PATH, c->name, i,
                     TOP_K);
            return false;
        }
        for (uint32_t k = 0; k < TOP_K; k++) {
            const json_t *pair = json_array_get(row, k);
            c->top_tok[i][k] = (int32_t)json_integer_value(json_array_get(pair, 0));
            c->top_logit[i][k] = (float)json_number_value(json_array_get(pair, 1));
        }
    }
    return true;
}

/* fx->model_path = file beside the default model (the cache scripts/setup fills), or file
 * itself when it is an absolute path (a synthetic model ctest made); false with fx->problem
 * when it is missing. */
static bool other_model_path(fixture_t *fx, const char *file)
{
    char *slash = strrchr(fx->model_path, '/');
    size_t dir = slash && file[0] != '/' ? (size_t)(slash - fx->model_path) + 1 : 0;
    char path[sizeof fx->model_path];
    snprintf(path, sizeof path, "%.*s%s", (int)dir, fx->model_path, file);
    snprintf(fx->model_path, sizeof fx->model_path, "%s", path);
    struct stat st;
    if (stat(fx->model_path, &st) == 0)
        return true;
    snprintf(fx->problem, sizeof fx->problem,
             file[0] == '/' ? "model file %s is missing: its ctest fixture "
                              "(tests/golden/synth_model.cmake) makes it"
                            : "model file %s is missing: run scripts/setup (it installs the "
                              "test models)",
             fx->model_path);
    return false;
}

/* With bounds from the file: twice llama.cpp's own differences (see bounds_t). */
static void bounds_from_file(const json_t *golden)
{
    const json_t *o = json_object_get(golden, "llama_cpp_self");
    g_bounds.logit_tol = 2 * json_number_value(json_object_get(o, "max_abs_diff"));
    g_bounds.logit_tol_mean = 2 * json_number_value(json_object_get(o, "mean_abs_diff"));
    g_bounds.logit_tol_centered = 2 * json_number_value(json_object_get(o, "max_centered_diff"));
    double self_clear = json_number_value(json_object_get(o, "argmax_agreement_gap_ge_0.25"));
    g_bounds.min_agreement_clear = 1.0 - 2.0 * (1.0 - self_clear);
}

/* Blocks for every case's tokens at once (the greedy test reuses the cached prompts). */
static uint32_t pool_blocks(const fixture_t *fx)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < fx->n_cases; i++)
        n += (fx->cases[i].n + BLOCK - 1) / BLOCK + 1;
    return n + 8;
}

static int group_setup(void **state)
{
    fixture_t *fx = calloc(1, sizeof *fx);
    if (!fx)
        return -1;
    *state = fx;
    if (!tdm_test_default_model(fx->model_path, sizeof fx->model_path, fx->problem,
                                sizeof fx->problem))
        return 0;
    struct stat st;
    if (g_model_file && !other_model_path(fx, g_model_file))
        return 0;
    if (stat(fx->model_path, &st) != 0)
        return 0;
    json_error_t jerr;
    /* a generated continuation's text may hold U+0000 (phi3_synth_f16.json's does) */
    fx->golden = json_load_file(g_golden_path, JSON_ALLOW_NUL, &jerr);
    if (!fx->golden) {
        snprintf(fx->problem, sizeof fx->problem,
                 "%s:%d: %s (regenerate it with tests/golden/make_engine_golden.py)", GOLDEN_PATH,
                 jerr.line, jerr.text);
        return 0;
    }
    /* the reference belongs to one file: another model would fail confusingly below */
    json_int_t want_bytes = json_integer_value(json_object_get(fx->golden, "model_bytes"));
    if ((json_int_t)st.st_size != want_bytes) {
        snprintf(fx->problem, sizeof fx->problem,
                 "%s has %lld bytes but the golden logits were made from a file of %lld bytes "
                 "(sha256 %s): run scripts/setup to fetch the default model",
                 fx->model_path, (long long)st.st_size, (long long)want_bytes,
                 json_string_value(json_object_get(fx->golden, "model_sha256")));
        return 0;
    }
    fx->eos = (int32_t)json_integer_value(json_object_get(fx->golden, "eos"));
    if (g_bounds_from_file)
        bounds_from_file(fx->golden);
    const json_t *jcases = json_object_get(fx->golden, "cases");
    fx->n_cases = (uint32_t)json_array_size(jcases);
    fx->cases = calloc(fx->n_cases ? fx->n_cases : 1, sizeof *fx->cases);
    if (!fx->cases)
        return -1;
    for (uint32_t i = 0; i < fx->n_cases; i++)
        if (!parse_case(json_array_get(jcases, i), &fx->cases[i], fx->problem, sizeof fx->problem))
            return 0;

    tdm_error_t err = {0};
    fx->model = tdm_model_load(fx->model_path, &err);
    if (!fx->model) {
        snprintf(fx->problem, sizeof fx->problem, "loading %s: %s", fx->model_path, err.msg);
        return 0;
    }
    const tdm_llama_hparams_t *hp = tdm_model_hparams(fx->model);
    if (g_bounds_from_file && hp->n_expert > 0) { /* see MAX_ROUTED_OUT */
        g_bounds.route_tol = g_bounds.logit_tol;
        g_bounds.logit_tol = LOGIT_TOL;
        g_bounds.logit_tol_mean = LOGIT_TOL_MEAN;
        g_bounds.logit_tol_centered = LOGIT_TOL_CENTERED;
    }
    fx->n_vocab = hp->n_vocab;
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, BLOCK, TDM_KV_F16};
    fx->pool = tdm_kv_pool_new(&kl, pool_blocks(fx), &err);
    if (!fx->pool) {
        snprintf(fx->problem, sizeof fx->problem, "KV pool: %s", err.msg);
        return 0;
    }
    tdm_engine_params_t p;
    tdm_engine_params_default(&p);
    p.max_batch_tokens = CHUNK;
    p.max_logits = CHUNK;
    p.n_ctx = N_CTX;
    fx->engine = tdm_engine_new(fx->model, fx->pool, &p, &err);
    if (!fx->engine) {
        snprintf(fx->problem, sizeof fx->problem, "engine: %s", err.msg);
        return 0;
    }
    fx->logits = malloc((size_t)CHUNK * fx->n_vocab * sizeof(float));
    if (!fx->logits)
        return -1;
    for (uint32_t i = 0; i < fx->n_cases; i++) {
        const ref_case_t *c = &fx->cases[i];
        for (uint32_t t = 0; t < c->n; t++)
            if (c->tokens[t] < 0 || (uint32_t)c->tokens[t] >= fx->n_vocab) {
                snprintf(fx->problem, sizeof fx->problem, "%s: case %s token %u out of range",
                         g_golden_path, c->name, t);
                return 0;
            }
        if (c->n > N_CTX) {
            snprintf(fx->problem, sizeof fx->problem, "case %s: %u tokens, more than %u", c->name,
                     c->n, N_CTX);
            return 0;
        }
    }
    return 0;
}

static int group_teardown(void **state)
{
    fixture_t *fx = *state;
    if (!fx)
        return 0;
    free(fx->logits);
    tdm_engine_destroy(&fx->engine);
    tdm_kv_pool_destroy(&fx->pool);
    tdm_model_destroy(&fx->model);
    for (uint32_t i = 0; fx->cases && i < fx->n_cases; i++) {
        free(fx->cases[i].tokens);
        free(fx->cases[i].top_tok);
        free(fx->cases[i].top_logit);
        free(fx->cases[i].our_argmax);
    }
    free(fx->cases);
    json_decref(fx->golden);
    free(fx);
    return 0;
}

static fixture_t *fixture_get(void **state)
{
    fixture_t *fx = *state;
    if (fx->problem[0])
        fail_msg("%s", fx->problem);
    return fx;
}

/* ---- engine ---- */

/* Runs tokens[start..start+n) (n <= CHUNK) of one sequence whose earlier KV is in kv; rows
 * with want[r] (NULL: all rows) write their logits to fx->logits in row order. */
static void forward(fixture_t *fx, tdm_kv_seq_t *kv, const int32_t *tokens, uint32_t start,
                    uint32_t n, const bool *want)
{
    static uint32_t pos[CHUNK], seq[CHUNK];
    assert_true(n >= 1 && n <= CHUNK);
    for (uint32_t r = 0; r < n; r++) {
        pos[r] = start + r;
        seq[r] = 0;
    }
    tdm_batch_seq_t bs = {kv->blocks, kv->n_blocks, NULL};
    tdm_batch_t b = {n, tokens + start, pos, seq, want, 1, &bs};
    tdm_error_t err = {0};
    if (tdm_engine_forward(fx->engine, &b, fx->logits, &err) != TDM_OK)
        fail_msg("forward at position %u: %s", start, err.msg);
}

/* First index of the largest value (the tie rule of numpy.argmax, which made the golden). */
static int32_t argmax(const float *v, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return (int32_t)best;
}

static float ref_gap(const ref_case_t *c, uint32_t i)
{
    return c->top_logit[i][0] - c->top_logit[i][1];
}

/* How far llama.cpp's one-pass logits at position i prefer token t over the best other of its
 * top-5: the top-1/top-2 gap when t is the argmax, negative when it is not. llama.cpp's own
 * greedy run (one token per pass) sometimes picked its one-pass runner-up at a near-tie. */
static float ref_margin(const ref_case_t *c, uint32_t i, int32_t t)
{
    float mine = -INFINITY, other = -INFINITY;
    for (uint32_t k = 0; k < TOP_K; k++)
        if (c->top_tok[i][k] == t)
            mine = c->top_logit[i][k];
        else if (c->top_logit[i][k] > other)
            other = c->top_logit[i][k];
    return mine - other;
}

/* ---- teacher-forced comparison ---- */

typedef struct stats {
    uint64_t n_pos, n_agree;          /* positions; where our argmax is llama.cpp's */
    uint64_t n_clear, n_clear_agree;  /* positions with gap >= CLEAR_GAP; agreeing */
    uint64_t n_confident, n_conf_bad; /* positions with gap > CONFIDENT_GAP; disagreeing */
    float max_gap_bad;                /* largest llama.cpp gap where we disagree */
    uint64_t n_route_out;             /* positions whose worst diff exceeds route_tol */
    uint64_t n_logits;                /* logits compared (TOP_K per position) */
    double sum_abs, max_abs;          /* |ours - llama.cpp| */
    double sum_cen, max_cen;          /* the same, centered */
    const char *max_case;             /* where max_abs is */
    uint32_t max_pos;
} stats_t;

static void stats_add(stats_t *s, const ref_case_t *c, uint32_t i, bool agree, float gap,
                      const double *d)
{
    double mean = 0;
    for (uint32_t k = 0; k < TOP_K; k++)
        mean += d[k] / TOP_K;
    for (uint32_t k = 0; k < TOP_K; k++) {
        double a = fabs(d[k]), cen = fabs(d[k] - mean);
        s->n_logits++;
        s->sum_abs += a;
        s->sum_cen += cen;
        s->max_cen = cen > s->max_cen ? cen : s->max_cen;
        if (a > s->max_abs) {
            s->max_abs = a;
            s->max_case = c->name;
            s->max_pos = i;
        }
    }
    s->n_pos++;
    s->n_agree += agree;
    s->n_clear += gap >= CLEAR_GAP;
    s->n_clear_agree += gap >= CLEAR_GAP && agree;
    s->n_confident += gap > CONFIDENT_GAP;
    s->n_conf_bad += gap > CONFIDENT_GAP && !agree;
    if (!agree && gap > s->max_gap_bad)
        s->max_gap_bad = gap;
}

/* Compares our logits row (after c->tokens[0..i]) with the golden top-5 and prints the
 * positions where the argmax differs or a logit is off by more than PRINT_DIFF. */
static void compare_position(fixture_t *fx, ref_case_t *c, uint32_t i, const float *row,
                             stats_t *st, stats_t *cs)
{
    int32_t ours = argmax(row, fx->n_vocab);
    c->our_argmax[i] = ours;
    bool agree = ours == c->top_tok[i][0];
    float gap = ref_gap(c, i);
    double d[TOP_K], worst = 0;
    for (uint32_t k = 0; k < TOP_K; k++) {
        d[k] = (double)row[c->top_tok[i][k]] - (double)c->top_logit[i][k];
        worst = fabs(d[k]) > worst ? fabs(d[k]) : worst;
    }
    stats_add(st, c, i, agree, gap, d);
    stats_add(cs, c, i, agree, gap, d);
    if (g_bounds.route_tol > 0 && worst > g_bounds.route_tol) {
        st->n_route_out++;
        printf("    %s pos %u: worst top-%d diff %.4f exceeds %.4f (an expert choice at a "
               "near-tie)\n",
               c->name, i, TOP_K, worst, g_bounds.route_tol);
    }
    if (!agree || worst > PRINT_DIFF)
        printf("    %s pos %u%s: llama.cpp %d (%.4f) > %d (%.4f), gap %.4f; ours %d (%.4f), "
               "%.4f %.4f for llama.cpp's top-2, worst top-5 diff %.4f\n",
               c->name, i, i + 1 < c->n_prompt ? " (prompt)" : "", (int)c->top_tok[i][0],
               (double)c->top_logit[i][0], (int)c->top_tok[i][1], (double)c->top_logit[i][1],
               (double)gap, (int)ours, (double)row[ours], (double)row[c->top_tok[i][0]],
               (double)row[c->top_tok[i][1]], worst);
}

/* Prints llama.cpp's figures against itself, as the generator recorded them. */
static void print_llama_self(const fixture_t *fx)
{
    const json_t *o = json_object_get(fx->golden, "llama_cpp_self");
    if (!o)
        return;
#define SELF(key) json_number_value(json_object_get(o, key))
    printf("llama.cpp vs itself (one token per pass): argmax %.2f%%, where gap >= %.2f %.2f%%, "
           "largest gap at a disagreement %.4f; top-%d |diff| max %.4f mean %.5f, centered max "
           "%.4f mean %.5f\n",
           100 * SELF("argmax_agreement"), (double)CLEAR_GAP,
           100 * SELF("argmax_agreement_gap_ge_0.25"), SELF("max_gap_at_disagreement"), TOP_K,
           SELF("max_abs_diff"), SELF("mean_abs_diff"), SELF("max_centered_diff"),
           SELF("mean_centered_diff"));
#undef SELF
}

static void test_teacher_forced(void **state)
{
    fixture_t *fx = fixture_get(state);
    stats_t st = {0};
    printf("teacher-forced: our logits vs llama.cpp's top-%d at every position\n", TOP_K);
    for (uint32_t ci = 0; ci < fx->n_cases; ci++) {
        ref_case_t *c = &fx->cases[ci];
        stats_t cs = {0};
        tdm_kv_seq_t kv;
        tdm_kv_seq_init(&kv);
        assert_int_equal(tdm_kv_seq_reserve(fx->pool, &kv, c->n), TDM_OK);
        for (uint32_t start = 0; start < c->n; start += CHUNK) {
            uint32_t n = c->n - start < CHUNK ? c->n - start : CHUNK;
            forward(fx, &kv, c->tokens, start, n, NULL);
            for (uint32_t r = 0; r < n; r++)
                compare_position(fx, c, start + r, fx->logits + (size_t)r * fx->n_vocab, &st, &cs);
        }
        c->have_argmax = true;
        /* keep the blocks cached: the greedy test reuses the prompts' KV */
        tdm_kv_seq_commit(fx->pool, &kv, c->tokens, c->n);
        tdm_kv_seq_release(fx->pool, &kv);
        printf("  %-22s %4u positions: argmax %5.1f%%, top-%d |diff| max %.4f mean %.5f, "
               "centered max %.4f\n",
               c->name, c->n, 100.0 * (double)cs.n_agree / (double)cs.n_pos, TOP_K, cs.max_abs,
               cs.sum_abs / (double)cs.n_logits, cs.max_cen);
    }
    double rate = (double)st.n_agree / (double)st.n_pos;
    double rate_clear = st.n_clear ? (double)st.n_clear_agree / (double)st.n_clear : 1.0;
    double mean = st.sum_abs / (double)st.n_logits;
    printf("summary: argmax agreement %llu/%llu = %.2f%%; where gap >= %.2f %llu/%llu = %.2f%%; "
           "largest gap at a disagreement %.4f; gap > %.1f: %llu positions, %llu disagreeing\n",
           (unsigned long long)st.n_agree, (unsigned long long)st.n_pos, 100.0 * rate,
           (double)CLEAR_GAP, (unsigned long long)st.n_clear_agree, (unsigned long long)st.n_clear,
           100.0 * rate_clear, (double)st.max_gap_bad, (double)CONFIDENT_GAP,
           (unsigned long long)st.n_confident, (unsigned long long)st.n_conf_bad);
    printf("summary: top-%d logits (%llu): max |diff| %.4f (%s pos %u), mean |diff| %.5f; "
           "centered max %.4f, mean %.5f\n",
           TOP_K, (unsigned long long)st.n_logits, st.max_abs, st.max_case ? st.max_case : "-",
           st.max_pos, mean, st.max_cen, st.sum_cen / (double)st.n_logits);
    print_llama_self(fx);
    fflush(stdout);
    assert_true(st.n_pos > 0);
    const bounds_t *bd = &g_bounds;
    printf("bounds: argmax >= %.2f%%, >= %.2f%% where gap >= %.2f; top-%d |diff| max %.4f, "
           "mean %.5f, centered max %.4f\n",
           100 * bd->min_agreement, 100 * bd->min_agreement_clear, (double)CLEAR_GAP, TOP_K,
           bd->logit_tol, bd->logit_tol_mean, bd->logit_tol_centered);
    fflush(stdout);
    if (rate < bd->min_agreement)
        fail_msg("argmax agrees with llama.cpp at %.2f%% of positions, below %.2f%%", 100.0 * rate,
                 100.0 * bd->min_agreement);
    if (rate_clear < bd->min_agreement_clear)
        fail_msg("argmax agrees with llama.cpp at %.2f%% of positions with gap >= %.2f, below "
                 "%.2f%%",
                 100.0 * rate_clear, (double)CLEAR_GAP, 100.0 * bd->min_agreement_clear);
    if (st.n_conf_bad)
        fail_msg("%llu positions where llama.cpp leads by more than %.1f have another argmax",
                 (unsigned long long)st.n_conf_bad, (double)CONFIDENT_GAP);
    if (bd->route_tol > 0) {
        printf("experts: %llu positions over %.4f (at most %.0f%% may be), %llu confident (at "
               "least %d)\n",
               (unsigned long long)st.n_route_out, bd->route_tol, 100 * MAX_ROUTED_OUT,
               (unsigned long long)st.n_confident, MIN_CONFIDENT);
        if ((double)st.n_route_out > MAX_ROUTED_OUT * (double)st.n_pos)
            fail_msg("%llu of %llu positions exceed %.4f", (unsigned long long)st.n_route_out,
                     (unsigned long long)st.n_pos, bd->route_tol);
        if (st.n_confident < MIN_CONFIDENT)
            fail_msg("only %llu confident positions, fewer than %d",
                     (unsigned long long)st.n_confident, MIN_CONFIDENT);
    }
    if (st.max_abs > bd->logit_tol)
        fail_msg("logit difference %.4f at %s position %u exceeds %.4f", st.max_abs, st.max_case,
                 st.max_pos, bd->logit_tol);
    if (mean > bd->logit_tol_mean)
        fail_msg("mean logit difference %.5f exceeds %.5f", mean, bd->logit_tol_mean);
    if (st.max_cen > bd->logit_tol_centered)
        fail_msg("centered logit difference %.4f exceeds %.4f", st.max_cen, bd->logit_tol_centered);
}

/* ---- chunking ---- */

/* The last position's logits of tokens[0..n) into out: the first n - tail rows in passes of
 * `chunk` rows, then the tail one row per pass, logits asked for the last row only. */
static void last_logits(fixture_t *fx, const int32_t *tokens, uint32_t n, uint32_t chunk,
                        uint32_t tail, float *out)
{
    static bool want[CHUNK];
    tdm_kv_seq_t kv;
    tdm_kv_seq_init(&kv);
    assert_int_equal(tdm_kv_seq_reserve(fx->pool, &kv, n), TDM_OK);
    for (uint32_t start = 0; start < n;) {
        uint32_t len = start < n - tail ? (n - tail - start < chunk ? n - tail - start : chunk) : 1;
        for (uint32_t r = 0; r < len; r++)
            want[r] = start + r + 1 == n;
        forward(fx, &kv, tokens, start, len, want);
        start += len;
    }
    memcpy(out, fx->logits, (size_t)fx->n_vocab * sizeof *out);
    tdm_kv_seq_release(fx->pool, &kv);
}

/* The longest case's last logits are bitwise the same however its prompt is split into
 * passes: CHUNK rows, 97 rows (passes that start mid-block, and for a sliding-window model
 * windows that start mid-block), and the last 40 positions one per pass. */
static void test_chunking_bitwise(void **state)
{
    fixture_t *fx = fixture_get(state);
    const ref_case_t *c = &fx->cases[0];
    for (uint32_t i = 1; i < fx->n_cases; i++)
        if (fx->cases[i].n > c->n)
            c = &fx->cases[i];
    float *a = malloc((size_t)3 * fx->n_vocab * sizeof *a);
    assert_non_null(a);
    last_logits(fx, c->tokens, c->n, CHUNK, 0, a);
    last_logits(fx, c->tokens, c->n, 97, 0, a + fx->n_vocab);
    last_logits(fx, c->tokens, c->n, CHUNK, 40, a + 2 * (size_t)fx->n_vocab);
    printf("%s (%u tokens): last logits in passes of %d, of 97, and the last 40 one by one\n",
           c->name, c->n, CHUNK);
    assert_memory_equal(a, a + fx->n_vocab, fx->n_vocab * sizeof *a);
    assert_memory_equal(a, a + 2 * (size_t)fx->n_vocab, fx->n_vocab * sizeof *a);
    free(a);
}

/* ---- greedy generation ---- */

/* Our greedy continuation of c's prompt, one token per pass, compared with llama.cpp's as it
 * goes; returns how many leading tokens match (it stops at the first difference, with our
 * token there in *first_diff). */
static uint32_t greedy_match(fixture_t *fx, const ref_case_t *c, int32_t *first_diff)
{
    static bool want[CHUNK];
    tdm_kv_seq_t kv;
    tdm_kv_seq_init(&kv);
    /* the prompt's full blocks from the prefix cache when test_teacher_forced left them there
     * (bitwise the same KV as computing them again: test_model checks that), the rest computed
     * asking logits for the prompt's last row only */
    uint32_t cached = tdm_kv_seq_match_prefix(fx->pool, &kv, c->tokens, c->n_prompt);
    assert_int_equal(tdm_kv_seq_reserve(fx->pool, &kv, c->n), TDM_OK);
    for (uint32_t start = cached; start < c->n_prompt; start += CHUNK) {
        uint32_t n = c->n_prompt - start < CHUNK ? c->n_prompt - start : CHUNK;
        for (uint32_t r = 0; r < n; r++)
            want[r] = start + r + 1 == c->n_prompt;
        forward(fx, &kv, c->tokens, start, n, want);
    }
    uint32_t n_cont = c->n - c->n_prompt, m = 0;
    while (m < n_cont) {
        int32_t next = argmax(fx->logits, fx->n_vocab);
        if (next != c->tokens[c->n_prompt + m]) {
            *first_diff = next;
            break;
        }
        m++;
        if (next == fx->eos || m == n_cont)
            break;
        /* ours equals llama.cpp's so far, so its token list is our sequence */
        forward(fx, &kv, c->tokens, c->n_prompt + m - 1, 1, NULL);
    }
    tdm_kv_seq_release(fx->pool, &kv);
    return m;
}

/* Steps of c's continuation before the first one where llama.cpp's margin for its own token
 * is below min_margin. */
static uint32_t steps_before_near_tie(const ref_case_t *c, float min_margin)
{
    uint32_t n_cont = c->n - c->n_prompt, k = 0;
    while (k < n_cont &&
           ref_margin(c, c->n_prompt - 1 + k, c->tokens[c->n_prompt + k]) >= min_margin)
        k++;
    return k;
}

static void test_greedy(void **state)
{
    fixture_t *fx = fixture_get(state);
    uint32_t n_full = 0, n_bad = 0, n_bad_asked = 0, n_inconsistent = 0;
    printf("greedy: our continuation vs llama.cpp's (required: up to its first margin < %.1f; "
           "in brackets: < %.1f)\n",
           (double)NEAR_TIE_GAP, (double)NEAR_TIE_GAP_ASKED);
    for (uint32_t ci = 0; ci < fx->n_cases; ci++) {
        const ref_case_t *c = &fx->cases[ci];
        uint32_t n_cont = c->n - c->n_prompt;
        uint32_t need = steps_before_near_tie(c, NEAR_TIE_GAP);
        uint32_t need_asked = steps_before_near_tie(c, NEAR_TIE_GAP_ASKED);
        int32_t diff = -1;
        uint32_t m = greedy_match(fx, c, &diff);
        n_full += m == n_cont;
        n_bad += m < need;
        n_bad_asked += m < need_asked;
        printf("  %-22s %2u/%2u tokens match (required %2u [%2u])", c->name, m, n_cont, need,
               need_asked);
        if (m < n_cont) {
            uint32_t i = c->n_prompt - 1 + m;
            printf(": step %u ours %d, llama.cpp %d (its margin there %.4f)", m, (int)diff,
                   (int)c->tokens[i + 1], (double)ref_margin(c, i, c->tokens[i + 1]));
        }
        printf("%s\n", m < need ? "  <-- FAIL" : "");
        /* decoding one token per pass must pick what the teacher-forced pass picked */
        for (uint32_t k = 0; c->have_argmax && k <= m && k < n_cont; k++) {
            int32_t greedy = k < m ? c->tokens[c->n_prompt + k] : diff;
            if (c->our_argmax[c->n_prompt - 1 + k] != greedy) {
                printf("    %s step %u: greedy picked %d, the teacher-forced pass %d\n", c->name, k,
                       (int)greedy, (int)c->our_argmax[c->n_prompt - 1 + k]);
                n_inconsistent++;
            }
        }
    }
    printf("summary: %u of %u greedy continuations match llama.cpp fully; %u stop matching "
           "before a margin < %.1f, %u before a margin < %.1f\n",
           n_full, fx->n_cases, n_bad, (double)NEAR_TIE_GAP, n_bad_asked,
           (double)NEAR_TIE_GAP_ASKED);
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(fx->pool, &ks);
    assert_int_equal(ks.n_used, 0); /* every sequence released */
    tdm_error_t err = {0};
    if (tdm_kv_pool_check(fx->pool, &err) != TDM_OK)
        fail_msg("KV pool: %s", err.msg);
    fflush(stdout);
    if (n_bad)
        fail_msg("%u continuations differ from llama.cpp before its first margin < %.1f", n_bad,
                 (double)NEAR_TIE_GAP);
    if (n_inconsistent)
        fail_msg("%u greedy steps differ from the engine's own teacher-forced argmax",
                 n_inconsistent);
}

/* usage: test_golden                         the default model against smollm2_engine.json
 *        test_golden GOLDEN MODEL_FILE [FAMILY]
 * GOLDEN: a file in tests/golden/; MODEL_FILE: the model's file name in the model cache, or an
 * absolute path (the synthetic Gemma 3 files tests/golden/synth_model.cmake makes);
 * FAMILY: the CPU kernel family to run (TANDEM_CPU_KERNELS: scalar, avx2, vnni, avx512, amx);
 * a family this CPU lacks exits 77 (skipped) naming it. */
int main(int argc, char **argv)
{
    if (argc >= 3) {
        snprintf(g_golden_path, sizeof g_golden_path, "%s%s", GOLDEN_DIR, argv[1]);
        g_model_file = argv[2];
        g_bounds_from_file = true;
    }
    if (argc >= 4) {
        const char *why = tdm_test_cpu_family_missing(argv[3]);
        if (why) {
            printf("SKIP: kernel family %s: %s\n", argv[3], why);
            return 77;
        }
        setenv("TANDEM_CPU_KERNELS", argv[3], 1);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_teacher_forced),
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_chunking_bitwise),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
