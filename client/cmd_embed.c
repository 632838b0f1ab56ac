/* cmd_embed.c - `tandem embed`: the embeddings of texts or token id lists, through the router
 * (EMBED, tdm_client_embed) or in this process (-m MODEL: a worker's embedding sequences over
 * the engine, as a node computes them), one JSON line per input. The texts are tokenized by the
 * one rule (tdm_prompt_encode of a raw prompt) either way, so both paths give the same bits
 * (the CPU engine is batch-invariant).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/client.h"
#include "tandem/model.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"
#include "tandem/worker.h"

#define EMBED_MAX_INPUTS 2048u

#define EMBED_SYNOPSIS "usage: tandem embed [-m MODEL] [options] (TEXT... | --tokens IDS...)\n"

static void usage_hint(void)
{
    fprintf(stderr, EMBED_SYNOPSIS "run 'tandem embed --help' for the options\n");
}

static void usage(FILE *out)
{
    fprintf(out, EMBED_SYNOPSIS
            "\n"
            "Prints the embedding of each input as one JSON line, in input order:\n"
            "  {\"index\": I, \"prompt_tokens\": N, \"embedding\": [...]}\n"
            "the final hidden state (after the output norm) pooled over the input's tokens\n"
            "and L2-normalised (docs/api.md \"Embeddings\"). Without -m it asks the router\n"
            "(EMBED); with -m it computes them in this process. A TEXT is tokenized as a raw\n"
            "prompt (the model's BOS rule).\n"
            "\n"
            "options:\n"
            "  -m, --model PATH        compute in this process with the GGUF model at PATH\n"
            "      --tokens IDS        an input given as token ids, comma-separated (repeat for\n"
            "                          several; not with TEXT)\n"
            "      --pooling last|mean last: the last token's state (default, as vLLM for\n"
            "                          decoder models); mean: the average over every token\n"
            "  -t, --threads N         with -m: CPU threads (default: all)\n"
            "      --batch N           with -m: rows per forward pass (default 512)\n"
            "      --served-model NAME without -m: the served model (default: the router's\n"
            "                          first)\n"
            "      --router ENDPOINT   without -m: the router's client endpoint (default\n"
            "                          $TANDEM_ROUTER or tcp://127.0.0.1:7600)\n"
            "      --api-key KEY       without -m: the API key (default $TANDEM_API_KEY)\n"
            "      --timeout S         without -m: seconds to wait (default 600)\n"
            "  -h, --help              this text\n");
}

typedef struct embed_opts {
    const char *model, *pooling, *served_model, *router, *api_key;
    long threads, batch;
    double timeout_s;
    const char *tokens[EMBED_MAX_INPUTS];
    size_t n_tokens;
} embed_opts_t;

static bool opt_tokens(const char *cmd, const char *value, void *target)
{
    embed_opts_t *o = target;
    if (o->n_tokens == EMBED_MAX_INPUTS) {
        fprintf(stderr, "%s: --tokens: at most %u inputs\n", cmd, EMBED_MAX_INPUTS);
        return false;
    }
    o->tokens[o->n_tokens++] = value;
    return true;
}

/* One --tokens value "1,2,3" into a heap array. false after printing why. */
static bool parse_ids(const char *s, int32_t **ids, size_t *n)
{
    size_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    *ids = malloc(cap * sizeof **ids);
    *n = 0;
    if (!*ids)
        return false;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < INT32_MIN || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "tandem embed: --tokens '%s': not a comma-separated list of ids\n", s);
            return false;
        }
        (*ids)[(*n)++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) {
        fprintf(stderr, "tandem embed: --tokens: an input needs at least one id\n");
        return false;
    }
    return true;
}

static void print_vector(size_t index, uint32_t n_tokens, const float *v, uint32_t n)
{
    printf("{\"index\": %zu, \"prompt_tokens\": %" PRIu32 ", \"embedding\": [", index, n_tokens);
    for (uint32_t i = 0; i < n; i++)
        printf(i ? ", %.9g" : "%.9g", (double)v[i]);
    printf("]}\n");
}

/* The inputs as token ids: --tokens lists or the texts tokenized with tok (NULL: the router
 * tokenizes). */
typedef struct inputs {
    int32_t **ids;
    size_t *n_ids;
    size_t n;
} inputs_t;

static void inputs_free(inputs_t *in)
{
    for (size_t i = 0; in->ids && i < in->n; i++)
        free(in->ids[i]);
    free(in->ids);
    free(in->n_ids);
}

static int inputs_make(const embed_opts_t *o, char **texts, size_t n_texts,
                       const tdm_tokenizer_t *tok, inputs_t *in)
{
    in->n = o->n_tokens ? o->n_tokens : (tok ? n_texts : 0);
    in->ids = calloc(in->n ? in->n : 1, sizeof *in->ids);
    in->n_ids = calloc(in->n ? in->n : 1, sizeof *in->n_ids);
    if (!in->ids || !in->n_ids)
        return 1;
    for (size_t i = 0; i < in->n; i++) {
        if (o->n_tokens) {
            if (!parse_ids(o->tokens[i], &in->ids[i], &in->n_ids[i]))
                return 2;
            continue;
        }
        tdm_prompt_input_t pi = {.text = texts[i], .text_len = strlen(texts[i])};
        tdm_error_t err = {0};
        if (tdm_prompt_encode(tok, NULL, &pi, &in->ids[i], &in->n_ids[i], NULL, &err) != TDM_OK) {
            fprintf(stderr, "tandem embed: input %zu: %s\n", i, err.msg);
            return 1;
        }
    }
    return 0;
}

/* ---- through the router ---- */

static int embed_routed(const embed_opts_t *o, char **texts, size_t n_texts)
{
    inputs_t in = {0};
    int status = inputs_make(o, texts, n_texts, NULL, &in);
    if (status != 0) {
        inputs_free(&in);
        return status;
    }
    tdm_client_t *c = tdm_cli_connect("tandem embed", tdm_cli_router_endpoint(o->router),
                                      tdm_cli_api_key(o->api_key), o->timeout_s, &status);
    if (!c) {
        inputs_free(&in);
        return status;
    }
    tdm_client_embed_req_t req = {.model = o->served_model,
                                  .texts = (const char *const *)texts,
                                  .n_texts = o->n_tokens ? 0 : n_texts,
                                  .token_ids = (const int32_t *const *)in.ids,
                                  .n_token_ids = in.n_ids,
                                  .n_token_inputs = in.n,
                                  .mean = o->pooling && strcmp(o->pooling, "mean") == 0};
    tdm_client_embeddings_t out;
    int rc = tdm_client_embed(c, &req, o->timeout_s, &out);
    if (rc != TDM_OK) {
        const char *field = tdm_client_errfield(c);
        fprintf(stderr, "tandem embed: %s%s%s%s\n", tdm_client_errmsg(c),
                field[0] ? " (field: " : "", field, field[0] ? ")" : "");
        status = tdm_cli_exit_status(rc);
    } else {
        for (size_t i = 0; i < out.n; i++)
            print_vector(i, out.prompt_tokens[i], out.values + i * out.n_embd, out.n_embd);
        tdm_client_embeddings_clear(&out);
    }
    tdm_client_destroy(&c);
    inputs_free(&in);
    return status;
}

/* ---- in this process ---- */

typedef struct local_embed {
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *worker;
    uint32_t n_ctx;
} local_embed_t;

static void local_close(local_embed_t *g)
{
    tdm_worker_destroy(&g->worker);
    tdm_engine_destroy(&g->engine);
    tdm_kv_pool_destroy(&g->pool);
    tdm_tokenizer_destroy(&g->tok);
    tdm_model_destroy(&g->model);
}

/* Model, tokenizer, a pool for one whole context, the engine and a PREFILL-mode worker (as a
 * prefill node has). Returns 0 or 1 after printing why. */
static int local_open(const embed_opts_t *o, local_embed_t *g)
{
    tdm_error_t err = {0};
    if (!(g->model = tdm_model_load(o->model, &err)) ||
        !(g->tok = tdm_tokenizer_new(tdm_model_gguf(g->model), &err))) {
        fprintf(stderr, "tandem embed: %s\n", err.msg);
        return 1;
    }
    const tdm_llama_hparams_t *hp = tdm_model_hparams(g->model);
    g->n_ctx = tdm_model_serve_n_ctx(hp, 0);
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, TDM_KV_F16};
    g->pool = tdm_kv_pool_new(&kl, (uint32_t)tdm_kv_blocks_for_tokens(&kl, g->n_ctx), &err);
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_threads = (int)o->threads;
    ep.n_ctx = g->n_ctx;
    ep.max_batch_tokens = (uint32_t)o->batch;
    ep.max_logits = 1;
    if (!g->pool || !(g->engine = tdm_engine_new(g->model, g->pool, &ep, &err))) {
        fprintf(stderr, "tandem embed: %s\n", err.msg);
        return 1;
    }
    tdm_worker_opts_t wo = {.mode = TDM_WORKER_MODE_PREFILL,
                            .max_batch_tokens = (uint32_t)o->batch,
                            .max_running = 1,
                            .max_waiting = EMBED_MAX_INPUTS,
                            .n_ctx = g->n_ctx};
    if (!(g->worker = tdm_worker_new(g->engine, g->pool, g->tok, hp->n_vocab, &wo, &err))) {
        fprintf(stderr, "tandem embed: %s\n", err.msg);
        return 1;
    }
    return 0;
}

/* Runs every input through the worker, one at a time (a pool of one context), and prints the
 * vectors in order. Returns the exit status. */
static int local_run(const embed_opts_t *o, local_embed_t *g, const inputs_t *in)
{
    tdm_pooling_t pooling = TDM_POOLING_LAST;
    if (o->pooling)
        tdm_pooling_parse(o->pooling, &pooling); /* checked by the caller */
    for (size_t i = 0; i < in->n; i++) {
        tdm_error_t err = {0};
        tdm_worker_req_t r = {.seq_id = i + 1,
                              .prompt = in->ids[i],
                              .n_prompt = (uint32_t)in->n_ids[i],
                              .embed = true,
                              .pooling = pooling};
        if (in->n_ids[i] > g->n_ctx || tdm_worker_add(g->worker, &r, &err) != TDM_OK) {
            fprintf(stderr, "tandem embed: input %zu: %s\n", i,
                    err.msg[0] ? err.msg : "longer than the context");
            return 2;
        }
        bool done = false;
        while (!done) {
            const tdm_worker_event_t *ev;
            uint32_t n_ev;
            if (tdm_worker_step(g->worker, &ev, &n_ev, &err) != TDM_OK) {
                fprintf(stderr, "tandem embed: %s\n", err.msg);
                return 1;
            }
            for (uint32_t e = 0; e < n_ev; e++) {
                if (ev[e].kind == TDM_WORKER_EVENT_FAILED) {
                    fprintf(stderr, "tandem embed: input %zu: %s\n", i, ev[e].message);
                    return 1;
                }
                if (ev[e].kind == TDM_WORKER_EVENT_EMBEDDING) {
                    print_vector(i, ev[e].n_tokens, ev[e].embedding, ev[e].n_embd);
                    done = true;
                }
            }
        }
    }
    return 0;
}

static int embed_local(const embed_opts_t *o, char **texts, size_t n_texts)
{
    local_embed_t g = {0};
    inputs_t in = {0};
    int status = local_open(o, &g);
    if (status == 0)
        status = inputs_make(o, texts, n_texts, g.tok, &in);
    if (status == 0)
        status = local_run(o, &g, &in);
    inputs_free(&in);
    local_close(&g);
    return status;
}

int tdm_cmd_embed(int argc, char **argv)
{
    embed_opts_t o = {.batch = 512, .timeout_s = 600.0};
    const char *local = NULL, *routed = NULL;
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("model", 'm', &o.model),
        TDM_CLI_OPT_FN("tokens", 0, opt_tokens, &o),
        TDM_CLI_OPT_STR("pooling", 0, &o.pooling),
        TDM_CLI_OPT_LONG("threads", 't', &o.threads, 1, 1024, .mark = &local,
                         .label = "-t/--threads"),
        TDM_CLI_OPT_LONG("batch", 0, &o.batch, 1, 65536, .mark = &local, .label = "--batch"),
        TDM_CLI_OPT_STR("served-model", 0, &o.served_model, .mark = &routed,
                        .label = "--served-model"),
        TDM_CLI_OPT_STR("router", 0, &o.router, .mark = &routed, .label = "--router"),
        TDM_CLI_OPT_STR("api-key", 0, &o.api_key, .mark = &routed, .label = "--api-key"),
        TDM_CLI_OPT_DOUBLE("timeout", 0, &o.timeout_s, 0.001, 86400, .mark = &routed,
                           .label = "--timeout"),
        TDM_CLI_OPT_END,
    };
    tdm_cli_spec_t spec = {"tandem embed", usage, usage_hint, opts};
    bool done = false;
    int status = tdm_cli_parse(&spec, argc, argv, &done);
    if (done)
        return status;
    char **texts = argv + optind;
    size_t n_texts = (size_t)(argc - optind);
    tdm_pooling_t p;
    if (o.pooling && tdm_pooling_parse(o.pooling, &p) != TDM_OK) {
        fprintf(stderr, "tandem embed: --pooling '%s': use last or mean\n", o.pooling);
        return 2;
    }
    if ((n_texts == 0) == (o.n_tokens == 0) || n_texts > EMBED_MAX_INPUTS) {
        fprintf(stderr, "tandem embed: give 1..%u TEXT arguments or --tokens lists (not both)\n",
                EMBED_MAX_INPUTS);
        usage_hint();
        return 2;
    }
    if (o.model && routed) {
        fprintf(stderr, "tandem embed: %s goes to the router; -m computes in this process\n",
                routed);
        return 2;
    }
    if (!o.model && local) {
        fprintf(stderr, "tandem embed: %s needs -m MODEL (this process)\n", local);
        return 2;
    }
    return o.model ? embed_local(&o, texts, n_texts) : embed_routed(&o, texts, n_texts);
}
