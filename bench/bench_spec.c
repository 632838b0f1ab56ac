/* bench_spec.c - speculative decoding (prompt lookup) at batch 1: each prompt of a JSONL set
 * (bench/spec/prompts.jsonl: {"id", "class", "prompt"}) rendered with the model's chat
 * template, 128 greedy output tokens, with speculation off and on (two workers over one engine,
 * stepped in turn so a shared machine's load falls on both alike; best of --repeats), asserting
 * identical output; prints decode tokens/s per prompt, per class and
 * overall with the ratio and the acceptance rate, as a table and JSON (--json FILE). First, the
 * cost of a forward pass of 1..9 rows of one sequence (what a draft row costs on this machine).
 *
 * Decode time is the sum of the steps after the first output token's (the prefill's), so
 * prompt length and prefill speed do not enter the ratio. Greedy with ignore_eos, so both runs make
 * exactly
 * --tokens tokens. */
#include "tandem/chat.h"
#include "tandem/config.h"
#include "tandem/model.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"
#include "tandem/worker.h"

#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PROMPTS 256
#define MAX_CLASSES 8
#define MAX_TOKENS 1024
#define N_CTX 2048

typedef struct bench_cfg {
    char model_path[1024];
    const char *prompts_path, *json_path;
    int threads, repeats, tokens, max_draft, limit;
} bench_cfg_t;

/* One prompt's measurement. */
typedef struct prompt_result {
    char id[64], cls[32];
    uint32_t n_prompt;
    double t_off, t_on;             /* best decode seconds */
    uint64_t drafted, accepted;     /* in the best "on" run */
    uint64_t verify_steps, n_steps; /* steps with drafts, decode steps (best "on" run) */
    bool same;
} prompt_result_t;

typedef struct bench {
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *w_off, *w_on;
    tdm_chat_pick_t pick;
    uint32_t n_vocab;
} bench_t;

static int parse_args(int argc, char **argv, bench_cfg_t *c, bool *done)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},   {"prompts", required_argument, NULL, 'p'},
        {"threads", required_argument, NULL, 't'}, {"repeats", required_argument, NULL, 'r'},
        {"tokens", required_argument, NULL, 'n'},  {"max-draft", required_argument, NULL, 'k'},
        {"limit", required_argument, NULL, 'l'},   {"json", required_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0}};
    c->prompts_path = "bench/spec/prompts.jsonl";
    c->threads = 2;
    c->repeats = 3;
    c->tokens = 128;
    c->max_draft = 8;
    *done = true;
    int ch;
    while ((ch = getopt_long(argc, argv, "m:p:t:r:n:k:l:j:h", opts, NULL)) != -1) {
        switch (ch) {
        case 'm': snprintf(c->model_path, sizeof c->model_path, "%s", optarg); break;
        case 'p': c->prompts_path = optarg; break;
        case 't': c->threads = atoi(optarg); break;
        case 'r': c->repeats = atoi(optarg); break;
        case 'n': c->tokens = atoi(optarg); break;
        case 'k': c->max_draft = atoi(optarg); break;
        case 'l': c->limit = atoi(optarg); break;
        case 'j': c->json_path = optarg; break;
        case 'h':
            printf("usage: tandem-bench-spec [-m MODEL] [--prompts FILE] [-t THREADS] "
                   "[--repeats N]\n"
                   "                         [--tokens N] [--max-draft K] [--limit N] "
                   "[--json FILE]\n");
            return 0;
        default: return 2;
        }
    }
    if (!c->model_path[0])
        tdm_model_default_path(c->model_path, sizeof c->model_path);
    if (c->threads < 0 || c->repeats < 1 || c->tokens < 2 || c->tokens > MAX_TOKENS ||
        c->max_draft < 1 || c->max_draft > (int)TDM_WORKER_MAX_DRAFT) {
        fprintf(stderr, "bench: --repeats >= 1, --tokens in [2, %d], --max-draft in [1, %u]\n",
                MAX_TOKENS, TDM_WORKER_MAX_DRAFT);
        return 2;
    }
    *done = false;
    return 0;
}

static tdm_worker_t *open_worker(bench_t *b, uint32_t max_draft, tdm_error_t *err)
{
    tdm_worker_opts_t o = {.mode = TDM_WORKER_MODE_DECODE,
                           .max_batch_tokens = 512,
                           .max_running = 1,
                           .max_waiting = 1,
                           .n_ctx = N_CTX,
                           .max_draft = max_draft};
    return tdm_worker_new(b->engine, b->pool, b->tok, b->n_vocab, &o, err);
}

/* Loads the model, its tokenizer and template, a pool and engine for one sequence, and the two
 * workers. Returns 0 or 1 after printing why. */
static int bench_open(bench_t *b, const bench_cfg_t *c)
{
    tdm_error_t err = {0};
    if (!(b->model = tdm_model_load(c->model_path, &err)) ||
        !(b->tok = tdm_tokenizer_new(tdm_model_gguf(b->model), &err)) ||
        tdm_chat_template_pick(tdm_model_gguf(b->model), b->tok, NULL, &b->pick, &err) != TDM_OK)
        goto out_fail;
    const tdm_llama_hparams_t *hp = tdm_model_hparams(b->model);
    b->n_vocab = hp->n_vocab;
    tdm_kv_layout_t l = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, TDM_KV_F16};
    if (!(b->pool = tdm_kv_pool_new(&l, 2 * N_CTX / 16 + 8, &err)))
        goto out_fail;
    tdm_worker_opts_t on = {
        .mode = TDM_WORKER_MODE_DECODE, .max_running = 1, .max_draft = (uint32_t)c->max_draft};
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_threads = c->threads;
    ep.n_ctx = N_CTX;
    ep.max_batch_tokens = 512;
    ep.max_logits = tdm_worker_logit_rows(&on);
    if (!(b->engine = tdm_engine_new(b->model, b->pool, &ep, &err)) ||
        !(b->w_off = open_worker(b, 0, &err)) ||
        !(b->w_on = open_worker(b, (uint32_t)c->max_draft, &err)))
        goto out_fail;
    return 0;
out_fail:
    fprintf(stderr, "bench: %s\n", err.msg);
    return 1;
}

static void bench_close(bench_t *b)
{
    tdm_worker_destroy(&b->w_on);
    tdm_worker_destroy(&b->w_off);
    tdm_engine_destroy(&b->engine);
    tdm_kv_pool_destroy(&b->pool);
    tdm_chat_pick_release(&b->pick);
    tdm_tokenizer_destroy(&b->tok);
    tdm_model_destroy(&b->model);
}

/* Least seconds of a forward pass of `rows` rows of one sequence at positions
 * [ctx, ctx + rows), over `reps` passes (the least: on a shared machine the others carry the
 * neighbours' load). */
static double rows_time(bench_t *b, tdm_kv_seq_t *seq, uint32_t ctx, uint32_t rows, int reps)
{
    int32_t tokens[16];
    uint32_t pos[16], sidx[16];
    for (uint32_t i = 0; i < rows; i++) {
        tokens[i] = (int32_t)(100 + 37 * i);
        pos[i] = ctx + i;
        sidx[i] = 0;
    }
    tdm_batch_seq_t bs = {seq->blocks, seq->n_blocks, NULL};
    tdm_batch_t batch = {rows, tokens, pos, sidx, NULL, 1, &bs};
    static float logits[16 * 65536];
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = tdm_time_now();
        tdm_error_t err = {0};
        if (tdm_engine_forward(b->engine, &batch, logits, &err) != TDM_OK) {
            fprintf(stderr, "bench: %s\n", err.msg);
            return 0;
        }
        double t = tdm_time_now() - t0;
        best = t < best ? t : best;
    }
    return best;
}

/* The cost of draft rows: a pass of 1..9 rows of one sequence after 300 tokens of context
 * (its KV left as the pool holds it: the cost does not depend on the values), relative to 1 row.
 * */
static void rows_curve(bench_t *b, json_t *out)
{
    tdm_kv_seq_t seq;
    tdm_kv_seq_init(&seq);
    if (tdm_kv_seq_reserve(b->pool, &seq, 320) != TDM_OK || b->n_vocab > 65536)
        return;
    rows_time(b, &seq, 0, 9, 1); /* warm up */
    double t1 = rows_time(b, &seq, 300, 1, 20);
    printf("forward pass of one sequence after 300 tokens: rows, ms, x 1 row\n");
    json_t *a = json_array();
    for (uint32_t r = 1; r <= 9; r++) {
        double t = r == 1 ? t1 : rows_time(b, &seq, 300, r, 20);
        printf("  %u  %7.2f  %5.2f\n", r, t * 1e3, t / t1);
        json_array_append_new(a, json_pack("{s:i,s:f}", "rows", (int)r, "ms", t * 1e3));
    }
    json_object_set_new(out, "rows_curve", a);
    tdm_kv_seq_release(b->pool, &seq);
}

/* One run of a prompt on one worker, stepped in turn with the other. */
typedef struct run {
    tdm_worker_t *w;
    int32_t *out; /* [tokens] the output */
    double t;     /* seconds of the steps after the first token's */
    bool started; /* the first token came */
    tdm_worker_stats_t s0, st;
} run_t;

/* One step of r; false on error. */
static bool run_step(run_t *r, int tokens)
{
    const tdm_worker_event_t *ev;
    uint32_t n_ev;
    tdm_error_t err = {0};
    double t0 = tdm_time_now();
    if (tdm_worker_step(r->w, &ev, &n_ev, &err) != TDM_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return false;
    }
    double dt = tdm_time_now() - t0;
    bool started = r->started;
    for (uint32_t i = 0; i < n_ev; i++)
        if (ev[i].kind == TDM_WORKER_EVENT_TOKEN && ev[i].index < (uint32_t)tokens) {
            r->out[ev[i].index] = ev[i].sample.token;
            if (ev[i].index == 0) {
                r->started = true;
                tdm_worker_stats(r->w, &r->s0);
            }
        }
    if (started)
        r->t += dt;
    return true;
}

/* Runs prompt ids[n] with speculation off and on together, stepping the two workers in turn
 * so the machine's load falls on both alike: the outputs in off->out and on->out, decode
 * seconds (the steps after the first token's) in ->t, the "on" worker's counters of those
 * steps in on->st. false on error. */
static bool run_pair(bench_t *b, const int32_t *ids, uint32_t n, int tokens, run_t *off, run_t *on)
{
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = tokens;
    sp.ignore_eos = true;
    tdm_worker_req_t req = {.seq_id = 1, .prompt = ids, .n_prompt = n, .sampling = &sp};
    tdm_error_t err = {0};
    off->w = b->w_off;
    on->w = b->w_on;
    if (tdm_worker_add(off->w, &req, &err) != TDM_OK ||
        tdm_worker_add(on->w, &req, &err) != TDM_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return false;
    }
    while (tdm_worker_busy(off->w) || tdm_worker_busy(on->w))
        if ((tdm_worker_busy(off->w) && !run_step(off, tokens)) ||
            (tdm_worker_busy(on->w) && !run_step(on, tokens)))
            return false;
    tdm_worker_stats(on->w, &on->st);
    on->st.steps -= on->s0.steps;
    on->st.spec_drafts -= on->s0.spec_drafts;
    on->st.spec_draft_tokens -= on->s0.spec_draft_tokens;
    on->st.spec_accepted_tokens -= on->s0.spec_accepted_tokens;
    return true;
}

/* The prompt's ids with the chat template applied (heap, caller frees), NULL on error. */
static int32_t *encode(const bench_t *b, const char *text, uint32_t *n)
{
    tdm_chat_message_t user = {.role = "user", .content = text};
    tdm_prompt_input_t in = {.messages = &user, .n_messages = 1};
    int32_t *ids = NULL;
    size_t n_ids = 0;
    tdm_error_t err = {0};
    if (tdm_prompt_encode(b->tok, &b->pick, &in, &ids, &n_ids, NULL, &err) != TDM_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return NULL;
    }
    *n = (uint32_t)n_ids;
    return ids;
}

/* Measures one prompt: off and on stepped in turn, best of c->repeats each. false on
 * error. */
static bool measure(bench_t *b, const bench_cfg_t *c, const char *text, prompt_result_t *r)
{
    int32_t *ids = encode(b, text, &r->n_prompt);
    if (!ids)
        return false;
    static int32_t out_off[MAX_TOKENS], out_on[MAX_TOKENS];
    r->t_off = r->t_on = 1e30;
    r->same = true;
    for (int k = 0; k < c->repeats; k++) {
        run_t off = {.out = out_off}, on = {.out = out_on};
        if (!run_pair(b, ids, r->n_prompt, c->tokens, &off, &on))
            break;
        r->t_off = off.t < r->t_off ? off.t : r->t_off;
        if (on.t < r->t_on) {
            r->t_on = on.t;
            r->drafted = on.st.spec_draft_tokens;
            r->accepted = on.st.spec_accepted_tokens;
            r->verify_steps = on.st.spec_drafts;
            r->n_steps = on.st.steps;
        }
        r->same = r->same && memcmp(out_off, out_on, (size_t)c->tokens * sizeof *out_on) == 0;
    }
    free(ids);
    return r->t_off < 1e29 && r->t_on < 1e29;
}

/* Prints a summary row over results[n] whose class is cls (NULL: all); adds it to out. */
static void summary(const prompt_result_t *res, int n, const char *cls, int tokens, json_t *out)
{
    double t_off = 0, t_on = 0, min_ratio = 1e30;
    uint64_t drafted = 0, accepted = 0;
    int count = 0;
    for (int i = 0; i < n; i++) {
        if (cls && strcmp(res[i].cls, cls) != 0)
            continue;
        t_off += res[i].t_off;
        t_on += res[i].t_on;
        drafted += res[i].drafted;
        accepted += res[i].accepted;
        double ratio = res[i].t_off / res[i].t_on;
        min_ratio = ratio < min_ratio ? ratio : min_ratio;
        count++;
    }
    if (count == 0)
        return;
    double toks = (double)count * (tokens - 1);
    double acc = drafted ? (double)accepted / (double)drafted : 0;
    printf("%-14s %3d prompts  off %6.1f tok/s  on %6.1f tok/s  ratio %5.2f  (min %4.2f)  "
           "acceptance %4.2f\n",
           cls ? cls : "overall", count, toks / t_off, toks / t_on, t_off / t_on, min_ratio, acc);
    json_object_set_new(out, cls ? cls : "overall",
                        json_pack("{s:i,s:f,s:f,s:f,s:f,s:f}", "prompts", count, "off_tok_s",
                                  toks / t_off, "on_tok_s", toks / t_on, "ratio", t_off / t_on,
                                  "min_ratio", min_ratio, "acceptance", acc));
}

static void print_row(const prompt_result_t *r, int tokens, json_t *rows)
{
    double off = (tokens - 1) / r->t_off, on = (tokens - 1) / r->t_on;
    double acc = r->drafted ? (double)r->accepted / (double)r->drafted : 0;
    printf("%-14s %-11s %5u  %6.1f  %6.1f  %5.2f  %4llu/%-4llu %4.2f  %3llu/%-3llu %s\n", r->id,
           r->cls, r->n_prompt, off, on, on / off, (unsigned long long)r->accepted,
           (unsigned long long)r->drafted, acc, (unsigned long long)r->verify_steps,
           (unsigned long long)r->n_steps, r->same ? "same" : "DIFFERENT");
    json_array_append_new(
        rows, json_pack("{s:s,s:s,s:i,s:f,s:f,s:f,s:I,s:I,s:I,s:I,s:b}", "id", r->id, "class",
                        r->cls, "prompt_tokens", (int)r->n_prompt, "off_tok_s", off, "on_tok_s", on,
                        "ratio", on / off, "drafted", (json_int_t)r->drafted, "accepted",
                        (json_int_t)r->accepted, "verify_steps", (json_int_t)r->verify_steps,
                        "decode_steps", (json_int_t)r->n_steps, "identical", r->same));
}

/* Measures every prompt of the set; the number measured, or -1 on error. */
static int run_set(bench_t *b, const bench_cfg_t *c, prompt_result_t *res, json_t *rows)
{
    json_error_t je;
    FILE *f = fopen(c->prompts_path, "r");
    if (!f) {
        fprintf(stderr, "bench: cannot open %s\n", c->prompts_path);
        return -1;
    }
    printf("\n%-14s %-11s %5s  %6s  %6s  %5s  %-9s %4s  %-7s\n", "prompt", "class", "ptok", "off/s",
           "on/s", "ratio", "acc/draft", "rate", "ver/steps");
    int n = 0;
    char line[16384];
    while (n < MAX_PROMPTS && (c->limit == 0 || n < c->limit) && fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, 0, &je);
        const char *id = NULL, *cls = NULL, *text = NULL;
        if (!j || json_unpack(j, "{s:s,s:s,s:s}", "id", &id, "class", &cls, "prompt", &text)) {
            json_decref(j);
            continue;
        }
        prompt_result_t *r = &res[n];
        memset(r, 0, sizeof *r);
        snprintf(r->id, sizeof r->id, "%s", id);
        snprintf(r->cls, sizeof r->cls, "%s", cls);
        bool ok = measure(b, c, text, r);
        json_decref(j);
        if (!ok) {
            fclose(f);
            return -1;
        }
        print_row(r, c->tokens, rows);
        fflush(stdout);
        n++;
    }
    fclose(f);
    return n;
}

int main(int argc, char **argv)
{
    bench_cfg_t c = {0};
    bool done;
    int rc = parse_args(argc, argv, &c, &done);
    if (done)
        return rc;
    bench_t b = {0};
    static prompt_result_t res[MAX_PROMPTS];
    json_t *out = json_object(), *rows = json_array(), *sum = json_object();
    if (bench_open(&b, &c) != 0) {
        rc = 1;
        goto out_close;
    }
    printf("model %s, backend %s, %d threads, %d tokens, max_draft %d, best of %d (off and on "
           "stepped in turn)\n",
           c.model_path, tdm_engine_backend_name(b.engine), c.threads, c.tokens, c.max_draft,
           c.repeats);
    rows_curve(&b, out);
    int n = run_set(&b, &c, res, rows);
    if (n <= 0) {
        rc = 1;
        goto out_close;
    }
    printf("\n");
    const char *classes[MAX_CLASSES];
    int n_classes = 0;
    for (int i = 0; i < n; i++) {
        int k = 0;
        while (k < n_classes && strcmp(classes[k], res[i].cls) != 0)
            k++;
        if (k == n_classes && n_classes < MAX_CLASSES)
            classes[n_classes++] = res[i].cls;
    }
    for (int k = 0; k < n_classes; k++)
        summary(res, n, classes[k], c.tokens, sum);
    summary(res, n, NULL, c.tokens, sum);
    for (int i = 0; i < n; i++)
        if (!res[i].same) {
            fprintf(stderr, "bench: %s: output differs with speculation on\n", res[i].id);
            rc = 1;
        }
    json_object_set_new(out, "backend", json_string(tdm_engine_backend_name(b.engine)));
    json_object_set_new(out, "max_draft", json_integer(c.max_draft));
    json_object_set_new(out, "tokens", json_integer(c.tokens));
    json_object_set_new(out, "prompts", rows);
    json_object_set_new(out, "summary", sum);
    rows = sum = NULL;
    if (c.json_path && json_dump_file(out, c.json_path, JSON_INDENT(1)) != 0) {
        fprintf(stderr, "bench: cannot write %s\n", c.json_path);
        rc = 1;
    }
out_close:
    json_decref(rows);
    json_decref(sum);
    json_decref(out);
    bench_close(&b);
    return rc;
}
