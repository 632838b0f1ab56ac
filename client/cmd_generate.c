/* cmd_generate.c - `tandem generate`: one generation, in this process (-m MODEL) or through
 * the router (no -m).
 *
 * With -m: tokenizes the prompt (or renders a chat message through the model's template),
 * prefills it in chunks, then decodes one token per step, streaming the text to stdout as it
 * is produced. This is the reference the cluster's output must equal for the same model,
 * prompt and sampling parameters.
 * Without -m: sends the same request (same sampling defaults: greedy, seed 0, 256 tokens) to
 * the router with libtandem-client and streams the text deltas to stdout as they arrive.
 * Either way usage figures (prompt tokens, TTFT, TPOT, decode tokens/s, finish reason) go to
 * stderr at the end, so stdout carries only the generated text and scripts can compare it.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/chat.h"
#include "tandem/client.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/prompt.h"
#include "tandem/sampling.h"
#include "tandem/tokenizer.h"

static void usage(FILE *out)
{
    fprintf(
        out,
        "usage: tandem generate [-m MODEL] (-p PROMPT | -f FILE | --chat MESSAGE) [options]\n"
        "\n"
        "With -m, runs the model in this process; without it, sends the request to the\n"
        "router. Streams the generated text to stdout; prompt tokens, TTFT, TPOT and decode\n"
        "speed go to stderr at the end.\n"
        "\n"
        "input:\n"
        "  -m, --model FILE          GGUF model: run in this process (default: the router)\n"
        "  -p, --prompt TEXT         raw prompt (special tokens like <|im_start|> are parsed)\n"
        "  -f, --file FILE           read the raw prompt from FILE ('-' for stdin)\n"
        "      --chat MESSAGE        a user message rendered with the chat template\n"
        "      --system TEXT         system message for --chat (default: the template's)\n"
        "      --chat-template NAME  chatml, llama3 or llama2 (default: from the model; -m only)\n"
        "sampling (default: greedy):\n"
        "  -n, --max-tokens N        tokens to generate at most (default 256)\n"
        "      --preset NAME         precise, chat or creative; options below override it\n"
        "      --temperature T       0 = greedy, up to 5\n"
        "      --top-k K             0 = off\n"
        "      --top-p P             (0, 1], 1 = off\n"
        "      --min-p P             [0, 1), 0 = off\n"
        "      --repetition-penalty R   (0, 10], 1 = off\n"
        "      --presence-penalty X  [-2, 2]\n"
        "      --frequency-penalty X [-2, 2]\n"
        "      --seed S              random seed (default 0)\n"
        "      --ignore-eos          keep generating after end-of-generation tokens\n"
        "router (without -m):\n"
        "      --router ENDPOINT     router client endpoint (default $TANDEM_ROUTER or\n"
        "                            " TDM_CLIENT_DEFAULT_ENDPOINT ")\n"
        "      --api-key KEY         API key (default $TANDEM_API_KEY)\n"
        "      --timeout SECONDS     deadline of the request (default 600)\n"
        "      --stop STR            stop string (repeatable, at most 16)\n"
        "engine (with -m):\n"
        "  -t, --threads N           CPU threads (default: all)\n"
        "  -c, --ctx N               context length (default: min(4096, model's))\n"
        "      --batch N             prefill chunk, tokens per forward pass (default 512)\n"
        "      --kv-dtype T          f16 (default), f32 or q8\n"
        "  -h, --help                this help\n");
}

enum {
    OPT_CHAT = 256,
    OPT_SYSTEM,
    OPT_TEMPLATE,
    OPT_PRESET,
    OPT_TEMPERATURE,
    OPT_TOP_K,
    OPT_TOP_P,
    OPT_MIN_P,
    OPT_REP,
    OPT_PRESENCE,
    OPT_FREQUENCY,
    OPT_SEED,
    OPT_IGNORE_EOS,
    OPT_BATCH,
    OPT_KV_DTYPE,
    OPT_ROUTER,
    OPT_API_KEY,
    OPT_TIMEOUT,
    OPT_STOP,
};

/* Parses a whole-string number into *out; prints an error naming the option otherwise. */
static bool parse_long(const char *opt, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "tandem generate: %s must be an integer in %ld..%ld, got '%s'\n", opt, lo,
                hi, s);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_float(const char *opt, const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    /* ERANGE with a tiny result is an underflow (1e-40 parses as a subnormal): accept it */
    if ((errno && !(errno == ERANGE && fabsf(v) <= 1.0f)) || end == s || *end || !isfinite(v)) {
        fprintf(stderr, "tandem generate: %s must be a number, got '%s'\n", opt, s);
        return false;
    }
    *out = v;
    return true;
}

typedef struct gen_opts {
    const char *model, *prompt, *file, *chat, *system, *chat_template, *preset;
    long max_tokens, threads, ctx, batch;
    const char *kv_dtype;
    /* sampling overrides, applied after the preset; has_* tells which were given */
    float temperature, top_p, min_p, rep, presence, frequency;
    long top_k;
    uint64_t seed;
    bool has_temperature, has_top_p, has_min_p, has_rep, has_presence, has_frequency, has_top_k;
    bool ignore_eos;
    /* router path */
    const char *router, *api_key;
    double timeout_s;
    const char *stop[TDM_CLIENT_MAX_STOP];
    size_t n_stop;
    const char *local_only;  /* the first option given that needs -m, NULL if none */
    const char *router_only; /* the first option given that needs the router */
} gen_opts_t;

/* Returns 0 to go on, or the exit status (0 for --help). */
static int parse_args(int argc, char **argv, gen_opts_t *o, bool *done)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"prompt", required_argument, NULL, 'p'},
        {"file", required_argument, NULL, 'f'},
        {"chat", required_argument, NULL, OPT_CHAT},
        {"system", required_argument, NULL, OPT_SYSTEM},
        {"chat-template", required_argument, NULL, OPT_TEMPLATE},
        {"max-tokens", required_argument, NULL, 'n'},
        {"preset", required_argument, NULL, OPT_PRESET},
        {"temperature", required_argument, NULL, OPT_TEMPERATURE},
        {"top-k", required_argument, NULL, OPT_TOP_K},
        {"top-p", required_argument, NULL, OPT_TOP_P},
        {"min-p", required_argument, NULL, OPT_MIN_P},
        {"repetition-penalty", required_argument, NULL, OPT_REP},
        {"presence-penalty", required_argument, NULL, OPT_PRESENCE},
        {"frequency-penalty", required_argument, NULL, OPT_FREQUENCY},
        {"seed", required_argument, NULL, OPT_SEED},
        {"ignore-eos", no_argument, NULL, OPT_IGNORE_EOS},
        {"threads", required_argument, NULL, 't'},
        {"ctx", required_argument, NULL, 'c'},
        {"batch", required_argument, NULL, OPT_BATCH},
        {"kv-dtype", required_argument, NULL, OPT_KV_DTYPE},
        {"router", required_argument, NULL, OPT_ROUTER},
        {"api-key", required_argument, NULL, OPT_API_KEY},
        {"timeout", required_argument, NULL, OPT_TIMEOUT},
        {"stop", required_argument, NULL, OPT_STOP},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    *done = false;
    o->max_tokens = 256;
    o->batch = 512;
    o->kv_dtype = "f16";
    optind = 1;
    int c;
    long v;
    while ((c = getopt_long(argc, argv, "m:p:f:n:t:c:h", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': o->prompt = optarg; break;
        case 'f': o->file = optarg; break;
        case OPT_CHAT: o->chat = optarg; break;
        case OPT_SYSTEM: o->system = optarg; break;
        case OPT_TEMPLATE:
            o->chat_template = optarg;
            o->local_only = o->local_only ? o->local_only : "--chat-template";
            break;
        case OPT_PRESET: o->preset = optarg; break;
        case 'n': ok = parse_long("--max-tokens", optarg, 1, 1 << 20, &o->max_tokens); break;
        case 't':
            ok = parse_long("--threads", optarg, 1, 1024, &o->threads);
            o->local_only = o->local_only ? o->local_only : "-t/--threads";
            break;
        case 'c':
            ok = parse_long("--ctx", optarg, 16, 1 << 20, &o->ctx);
            o->local_only = o->local_only ? o->local_only : "-c/--ctx";
            break;
        case OPT_BATCH:
            ok = parse_long("--batch", optarg, 1, 65536, &o->batch);
            o->local_only = o->local_only ? o->local_only : "--batch";
            break;
        case OPT_KV_DTYPE:
            o->kv_dtype = optarg;
            o->local_only = o->local_only ? o->local_only : "--kv-dtype";
            break;
        case OPT_ROUTER:
            o->router = optarg;
            o->router_only = o->router_only ? o->router_only : "--router";
            break;
        case OPT_API_KEY:
            o->api_key = optarg;
            o->router_only = o->router_only ? o->router_only : "--api-key";
            break;
        case OPT_TIMEOUT:
            ok = tdm_cli_parse_double("tandem generate", "--timeout", optarg, 0.001, 86400,
                                      &o->timeout_s);
            o->router_only = o->router_only ? o->router_only : "--timeout";
            break;
        case OPT_STOP:
            if (o->n_stop == TDM_CLIENT_MAX_STOP) {
                fprintf(stderr, "tandem generate: --stop: at most %d stop strings\n",
                        TDM_CLIENT_MAX_STOP);
                ok = false;
            } else if (!optarg[0] || strlen(optarg) > TDM_CLIENT_MAX_STOP_BYTES) {
                fprintf(stderr, "tandem generate: --stop: a stop string has 1..%d bytes\n",
                        TDM_CLIENT_MAX_STOP_BYTES);
                ok = false;
            } else {
                o->stop[o->n_stop++] = optarg;
            }
            o->router_only = o->router_only ? o->router_only : "--stop";
            break;
        case OPT_TEMPERATURE:
            ok = o->has_temperature = parse_float("--temperature", optarg, &o->temperature);
            break;
        case OPT_TOP_P: ok = o->has_top_p = parse_float("--top-p", optarg, &o->top_p); break;
        case OPT_MIN_P: ok = o->has_min_p = parse_float("--min-p", optarg, &o->min_p); break;
        case OPT_REP: ok = o->has_rep = parse_float("--repetition-penalty", optarg, &o->rep); break;
        case OPT_PRESENCE:
            ok = o->has_presence = parse_float("--presence-penalty", optarg, &o->presence);
            break;
        case OPT_FREQUENCY:
            ok = o->has_frequency = parse_float("--frequency-penalty", optarg, &o->frequency);
            break;
        case OPT_TOP_K:
            ok = o->has_top_k = parse_long("--top-k", optarg, 0, INT32_MAX, &o->top_k);
            break;
        case OPT_SEED: {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(optarg, &end, 10);
            if (errno || end == optarg || *end || optarg[0] == '-') {
                fprintf(stderr, "tandem generate: --seed must be an unsigned integer, got '%s'\n",
                        optarg);
                ok = false;
            }
            o->seed = s;
            break;
        }
        case OPT_IGNORE_EOS: o->ignore_eos = true; break;
        case 'h':
            usage(stdout);
            *done = true;
            return 0;
        default: usage(stderr); return 2;
        }
        if (!ok)
            return 2;
    }
    (void)v;
    if (optind != argc) {
        fprintf(stderr, "tandem generate: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!o->model && o->local_only) {
        fprintf(stderr,
                "tandem generate: %s only applies with -m MODEL (in-process generation); "
                "without -m the request goes to the router, whose nodes have their own "
                "settings\n",
                o->local_only);
        return 2;
    }
    if (o->model && o->router_only) {
        fprintf(stderr,
                "tandem generate: %s only applies without -m (generation through the "
                "router)\n",
                o->router_only);
        return 2;
    }
    int inputs = (o->prompt != NULL) + (o->file != NULL) + (o->chat != NULL);
    if (inputs != 1) {
        fprintf(stderr,
                "tandem generate: give exactly one of -p PROMPT, -f FILE, --chat MESSAGE\n");
        return 2;
    }
    if ((o->system || o->chat_template) && !o->chat) {
        fprintf(stderr, "tandem generate: --system and --chat-template need --chat\n");
        return 2;
    }
    return 0;
}

/* Tokenizes the input of o (the raw prompt, the file, or the chat message) into *ids (heap,
 * *n_ids tokens) with tdm_chat_template_pick and tdm_prompt_encode, as the router does. */
static int encode_prompt(const gen_opts_t *o, const tdm_gguf_t *g, const tdm_tokenizer_t *tok,
                         int32_t **ids, size_t *n_ids, tdm_error_t *err)
{
    char *file_text = NULL;
    tdm_prompt_input_t in = {0};
    tdm_chat_pick_t pick;
    tdm_chat_message_t user = {"user", o->chat};
    int rc = TDM_OK;
    if (o->prompt) {
        in.text = o->prompt;
        in.text_len = strlen(o->prompt);
    } else if (o->file) {
        if (strcmp(o->file, "-") != 0)
            rc = tdm_read_file(o->file, (size_t)1 << 30, &file_text, &in.text_len, err);
        else if ((rc = tdm_cli_read_stream(stdin, &file_text, &in.text_len)) != TDM_OK)
            tdm_error_set(err, rc, "reading stdin: %s", tdm_strerror(rc));
        if (rc != TDM_OK)
            return rc;
        in.text = file_text;
    } else {
        tdm_chat_template_t named;
        if (o->chat_template) {
            rc = tdm_chat_template_from_name(o->chat_template, &named, err);
            if (rc != TDM_OK)
                return rc;
        }
        rc = tdm_chat_template_pick(g, o->chat_template ? &named : NULL, &pick, err);
        if (rc != TDM_OK)
            return rc;
        in.messages = &user;
        in.n_messages = 1;
        in.system = o->system;
    }
    rc = tdm_prompt_encode(tok, o->chat ? &pick : NULL, &in, ids, n_ids, NULL, err);
    free(file_text);
    return rc;
}

/* ---- through the router ---- */

/* Writes each text delta to stdout as it arrives; returning nonzero after Ctrl-C cancels. */
static int router_on_chunk(void *user, const tdm_client_chunk_t *ch)
{
    (void)user;
    if (ch->text_len) {
        fwrite(ch->text, 1, ch->text_len, stdout);
        fflush(stdout);
    }
    return *tdm_cli_interrupt_flag() != 0;
}

/* Prints the usage figures of a finished request to stderr. */
static void print_router_usage(const tdm_client_result_t *r)
{
    /* the router's timings; the client's own where the router sent none */
    tdm_client_timings_t t0 = r->timings;
    const tdm_client_timings_t *t = &t0;
    if (t0.ttft_s <= 0 && t0.e2e_s <= 0) {
        t0.ttft_s = r->client_timings.ttft_s;
        t0.decode_s = r->client_timings.decode_s;
        t0.e2e_s = r->client_timings.e2e_s;
    }
    uint32_t n = r->usage.completion_tokens ? r->usage.completion_tokens : (uint32_t)r->n_tokens;
    double tpot = t->tpot_s > 0              ? t->tpot_s
                  : n > 1 && t->decode_s > 0 ? t->decode_s / (double)(n - 1)
                                             : 0.0;
    fprintf(stderr,
            "\nprompt tokens: %" PRIu32 " (cached %" PRIu32 "), generated tokens: %" PRIu32
            ", finish: %s\n"
            "TTFT: %.1f ms (queue %.1f ms, prefill %.1f ms, KV transfer %.1f ms)\n"
            "decode: %.2f tokens/s (TPOT %.1f ms), end-to-end %.1f ms, request %s\n",
            r->usage.prompt_tokens, r->usage.cached_prompt_tokens, n,
            tdm_client_finish_name(r->finish_reason), t->ttft_s * 1e3, t->queue_s * 1e3,
            t->prefill_s * 1e3, t->kv_transfer_s * 1e3, tpot > 0 ? 1.0 / tpot : 0.0, tpot * 1e3,
            t->e2e_s * 1e3, r->request_id);
}

static int generate_router(const gen_opts_t *o)
{
    const char *cmd = "tandem generate";
    tdm_cli_sampling_t cs = {0};
    cs.preset = o->preset;
    cs.temperature = o->temperature;
    cs.top_p = o->top_p;
    cs.min_p = o->min_p;
    cs.rep = o->rep;
    cs.presence = o->presence;
    cs.frequency = o->frequency;
    cs.top_k = o->top_k;
    cs.seed = o->seed;
    cs.has_temperature = o->has_temperature;
    cs.has_top_p = o->has_top_p;
    cs.has_min_p = o->has_min_p;
    cs.has_rep = o->has_rep;
    cs.has_presence = o->has_presence;
    cs.has_frequency = o->has_frequency;
    cs.has_top_k = o->has_top_k;
    cs.ignore_eos = o->ignore_eos;
    tdm_sampling_params_t sp;
    if (!tdm_cli_sampling_build(cmd, &cs, o->max_tokens, &sp))
        return 2;
    tdm_error_t err = {0};
    if (tdm_sampling_params_validate(&sp, 0, &err) != TDM_OK) {
        fprintf(stderr, "%s: %s\n", cmd, err.msg);
        return 2;
    }

    char *file_text = NULL;
    if (o->file) {
        size_t len;
        int rc = strcmp(o->file, "-") == 0
                     ? tdm_cli_read_stream(stdin, &file_text, &len)
                     : tdm_read_file(o->file, (size_t)1 << 30, &file_text, &len, &err);
        if (rc != TDM_OK) {
            fprintf(stderr, "%s: %s: %s\n", cmd, o->file, err.msg[0] ? err.msg : tdm_strerror(rc));
            return 1;
        }
    }
    tdm_chat_message_t msgs[2];
    size_t n_msgs = 0;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    if (o->chat) {
        if (o->system)
            msgs[n_msgs++] = (tdm_chat_message_t){"system", o->system};
        msgs[n_msgs++] = (tdm_chat_message_t){"user", o->chat};
        req.messages = msgs;
        req.n_messages = n_msgs;
    } else {
        req.prompt = o->prompt ? o->prompt : file_text;
    }
    req.sampling = sp;
    req.sampling_set = TDM_CLIENT_SAMPLING_ALL; /* the same parameters as -m would use */
    req.max_tokens = (int32_t)o->max_tokens;
    req.stop = o->stop;
    req.n_stop = o->n_stop;
    req.stream = true;

    int status;
    tdm_cli_catch_interrupt(false);
    const char *endpoint = tdm_cli_router_endpoint(o->router);
    tdm_client_t *c =
        tdm_cli_connect(cmd, endpoint, tdm_cli_api_key(o->api_key), o->timeout_s, &status);
    if (!c)
        goto out_text;
    tdm_client_result_t res;
    int rc = tdm_client_generate(c, &req, router_on_chunk, NULL, &res);
    if (res.text_len > 0 || rc == TDM_OK)
        fputc('\n', stdout);
    fflush(stdout);
    if (rc == TDM_OK) {
        print_router_usage(&res);
        status = 0;
    } else if (rc == TDM_ECANCELLED && *tdm_cli_interrupt_flag()) {
        fprintf(stderr, "%s: interrupted; the request was cancelled\n", cmd);
        status = TDM_CLI_EXIT_INTERRUPTED;
    } else {
        fprintf(stderr, "%s: %s (%s)\n", cmd, res.message, tdm_status_name(rc));
        status = tdm_cli_exit_status(rc);
    }
    tdm_client_result_clear(&res);
    tdm_client_destroy(&c);
out_text:
    free(file_text);
    return status;
}

int tdm_cmd_generate(int argc, char **argv)
{
    gen_opts_t o = {0};
    bool done;
    int status = parse_args(argc, argv, &o, &done);
    if (status != 0 || done)
        return status;
    if (!o.model)
        return generate_router(&o);

    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0.0f; /* greedy unless asked otherwise */
    tdm_error_t err = {0};
    if (o.preset && tdm_sampling_preset(o.preset, &sp, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: --preset: %s\n", err.msg);
        return 2;
    }
    if (o.has_temperature)
        sp.temperature = o.temperature;
    if (o.has_top_k)
        sp.top_k = (int32_t)o.top_k;
    if (o.has_top_p)
        sp.top_p = o.top_p;
    if (o.has_min_p)
        sp.min_p = o.min_p;
    if (o.has_rep)
        sp.repetition_penalty = o.rep;
    if (o.has_presence)
        sp.presence_penalty = o.presence;
    if (o.has_frequency)
        sp.frequency_penalty = o.frequency;
    sp.seed = o.seed;
    sp.ignore_eos = o.ignore_eos;
    sp.max_tokens = (int32_t)o.max_tokens;
    tdm_kv_dtype_t kv_dtype;
    if (tdm_kv_dtype_parse(o.kv_dtype, &kv_dtype, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: --kv-dtype: %s\n", err.msg);
        return 2;
    }

    status = 1;
    tdm_model_t *model = tdm_model_load(o.model, &err);
    if (!model) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 1;
    }
    const tdm_llama_hparams_t *hp = tdm_model_hparams(model);
    if (tdm_sampling_params_validate(&sp, hp->n_vocab, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        status = 2;
        goto out_model;
    }
    tdm_tokenizer_t *tok = tdm_tokenizer_new(tdm_model_gguf(model), &err);
    if (!tok) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        goto out_model;
    }
    int32_t *prompt = NULL;
    size_t n_prompt = 0;
    if (encode_prompt(&o, tdm_model_gguf(model), tok, &prompt, &n_prompt, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        if (err.code == TDM_EINVALID)
            status = 2; /* a bad --chat-template, --chat or --system */
        goto out_tok;
    }
    uint32_t n_ctx = o.ctx ? (uint32_t)o.ctx : 4096;
    if (n_ctx > hp->n_ctx_train) {
        if (o.ctx) {
            fprintf(stderr,
                    "tandem generate: --ctx %ld exceeds the model's context length %" PRIu32 "\n",
                    o.ctx, hp->n_ctx_train);
            status = 2;
            goto out_prompt;
        }
        n_ctx = hp->n_ctx_train;
    }
    if (n_prompt == 0) {
        fprintf(stderr, "tandem generate: the prompt is empty (it must have at least 1 token)\n");
        status = 2;
        goto out_prompt;
    }
    if (n_prompt >= n_ctx) {
        fprintf(stderr,
                "tandem generate: the prompt has %zu tokens; it must have 1..%" PRIu32
                " (the context is %" PRIu32 " tokens, raise it with --ctx)\n",
                n_prompt, n_ctx - 1, n_ctx);
        status = 2;
        goto out_prompt;
    }

    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, kv_dtype};
    uint64_t n_blocks = tdm_kv_blocks_for_tokens(&kl, n_ctx);
    tdm_kv_pool_t *pool = tdm_kv_pool_new(&kl, (uint32_t)n_blocks, &err);
    if (!pool) {
        fprintf(stderr, "tandem generate: KV pool: %s\n", err.msg);
        goto out_prompt;
    }
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_threads = (int)o.threads;
    ep.n_ctx = n_ctx;
    ep.max_batch_tokens = (uint32_t)o.batch;
    ep.max_logits = 1;
    tdm_engine_t *engine = tdm_engine_new(model, pool, &ep, &err);
    tdm_sampler_t *sampler = tdm_sampler_new(hp->n_vocab, &err);
    float *logits = malloc((size_t)hp->n_vocab * sizeof(float));
    size_t max_total = n_ctx;
    int32_t *history = malloc(max_total * sizeof(int32_t));
    uint32_t *pos = malloc((size_t)o.batch * sizeof(uint32_t));
    uint32_t *seq_idx = calloc((size_t)o.batch, sizeof(uint32_t));
    bool *want = calloc((size_t)o.batch, sizeof(bool));
    if (!engine || !sampler || !logits || !history || !pos || !seq_idx || !want) {
        fprintf(stderr, "tandem generate: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto out_engine;
    }

    tdm_kv_seq_t kv;
    tdm_kv_seq_init(&kv);
    uint32_t max_new = (uint32_t)o.max_tokens;
    if (n_prompt + max_new > n_ctx)
        max_new = n_ctx - (uint32_t)n_prompt;
    if (tdm_kv_seq_reserve(pool, &kv, (uint32_t)n_prompt + max_new) != TDM_OK) {
        fprintf(stderr, "tandem generate: KV pool too small\n");
        goto out_engine;
    }
    memcpy(history, prompt, n_prompt * sizeof(int32_t));
    size_t n_hist = n_prompt;

    /* prefill in chunks; logits only for the prompt's last token */
    double t_start = tdm_time_now();
    for (size_t done_tok = 0; done_tok < n_prompt;) {
        uint32_t n = (uint32_t)((n_prompt - done_tok) < (size_t)o.batch ? n_prompt - done_tok
                                                                        : (size_t)o.batch);
        for (uint32_t i = 0; i < n; i++) {
            pos[i] = (uint32_t)(done_tok + i);
            want[i] = done_tok + i == n_prompt - 1;
        }
        tdm_batch_seq_t bs = {kv.blocks, kv.n_blocks};
        tdm_batch_t b = {n, prompt + done_tok, pos, seq_idx, want, 1, &bs};
        if (tdm_engine_forward(engine, &b, logits, &err) != TDM_OK) {
            fprintf(stderr, "tandem generate: prefill: %s\n", err.msg);
            goto out_seq;
        }
        done_tok += n;
    }

    tdm_detok_t detok;
    tdm_detok_init(&detok, tok, false);
    const char *finish =
        max_new < (uint32_t)o.max_tokens ? "length (the context is full)" : "length";
    double t_first = 0;
    uint32_t n_gen = 0;
    for (uint32_t i = 0; i < max_new; i++) {
        tdm_sample_result_t r;
        if (tdm_sampler_sample(sampler, &sp, logits, history, n_hist, i, &r) != TDM_OK) {
            fprintf(stderr, "tandem generate: sampling: %s\n", tdm_sampler_errmsg(sampler));
            goto out_seq;
        }
        if (i == 0)
            t_first = tdm_time_now();
        n_gen++;
        history[n_hist++] = r.token;
        if (tdm_sampling_is_stop(&sp, r.token) ||
            (!sp.ignore_eos && tdm_tokenizer_is_eog(tok, r.token))) {
            finish = "stop";
            break;
        }
        char piece[512];
        size_t plen = 0;
        if (tdm_detok_push(&detok, r.token, piece, sizeof piece, &plen) == TDM_OK && plen) {
            fwrite(piece, 1, plen, stdout);
            fflush(stdout);
        }
        if (i + 1 == max_new)
            break;
        uint32_t p = (uint32_t)n_hist - 1;
        bool w = true;
        tdm_batch_seq_t bs = {kv.blocks, kv.n_blocks};
        tdm_batch_t b = {1, &r.token, &p, seq_idx, &w, 1, &bs};
        if (tdm_engine_forward(engine, &b, logits, &err) != TDM_OK) {
            fprintf(stderr, "tandem generate: decode: %s\n", err.msg);
            goto out_seq;
        }
    }
    char tail[64];
    size_t tlen = 0;
    if (tdm_detok_flush(&detok, tail, sizeof tail, &tlen) == TDM_OK && tlen)
        fwrite(tail, 1, tlen, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    double t_end = tdm_time_now();
    double ttft = t_first - t_start, decode_s = t_end - t_first;
    fprintf(stderr,
            "\nprompt tokens: %zu, generated tokens: %" PRIu32 ", finish: %s\n"
            "TTFT: %.1f ms (prefill %.1f tokens/s)\n"
            "decode: %.2f tokens/s (TPOT %.1f ms), backend %s\n",
            n_prompt, n_gen, finish, ttft * 1e3, (double)n_prompt / ttft,
            n_gen > 1 ? (double)(n_gen - 1) / decode_s : 0.0,
            n_gen > 1 ? decode_s * 1e3 / (double)(n_gen - 1) : 0.0,
            tdm_engine_backend_name(engine));
    status = 0;

out_seq:
    tdm_kv_seq_release(pool, &kv);
out_engine:
    free(want);
    free(seq_idx);
    free(pos);
    free(history);
    free(logits);
    tdm_sampler_destroy(&sampler);
    tdm_engine_destroy(&engine);
    tdm_kv_pool_destroy(&pool);
out_prompt:
    free(prompt);
out_tok:
    tdm_tokenizer_destroy(&tok);
out_model:
    tdm_model_destroy(&model);
    return status;
}
