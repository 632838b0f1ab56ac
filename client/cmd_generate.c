/* cmd_generate.c - `tandem generate`: one generation, in this process (-m MODEL) or through
 * the router (no -m).
 *
 * With -m: tokenizes the prompt (or renders a chat message through the model's template) and
 * runs it through the continuous-batching worker the decode node uses (tandem/worker.h,
 * DECODE mode with local prefill): the prompt is prefilled in chunks, then one token is
 * decoded per step, and the text is streamed to stdout as it is produced. This is the reference the
 * cluster's output must equal for the same model, prompt and sampling parameters. Without -m: sends
 * the same request (same sampling defaults: greedy, seed 0, 256 tokens) to the router with
 * libtandem-client and streams the text deltas to stdout as they arrive. Either way usage figures
 * (prompt tokens, TTFT, TPOT, decode tokens/s, finish reason) go to stderr at the end, so stdout
 * carries only the generated text and scripts can compare it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/chat.h"
#include "tandem/client.h"
#include "tandem/constraint.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/prompt.h"
#include "tandem/sampling.h"
#include "tandem/tokenizer.h"
#include "tandem/worker.h"

static void usage(FILE *out)
{
    fprintf(out,
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
            "      --tools FILE          with --chat: the functions the model may call, a JSON\n"
            "                            array of OpenAI tools rendered by the template as given\n"
            "      --chat-template NAME|FILE  chatml, llama3, llama2, gemma or a Jinja template\n"
            "                            file (default: the model's own; -m only)\n"
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
            "      --logit-bias ID:BIAS  add BIAS in [-100, 100] to token ID's logit\n"
            "                            (-100 bans it, 100 forces it; repeatable, at most 300)\n"
            "      --min-tokens N        no end-of-generation token, stop token or stop string\n"
            "                            before N output tokens (vLLM's min_tokens)\n"
            "      --bad-word WORD       never generate WORD (vLLM's bad_words; repeatable, at\n"
            "                            most 128 of 1..256 bytes)\n"
            "      --allowed-token-ids ID,ID,...  sample only these token ids (repeatable,\n"
            "                            at most 1024 in all)\n"
            "structured output (at most one; docs/api.md \"Structured output\"):\n"
            "      --json-schema FILE    the output is JSON matching the JSON Schema in FILE\n"
            "      --json-object         the output is a JSON object\n"
            "      --grammar FILE        the output matches the GBNF grammar in FILE (rule root)\n"
            "      --regex RE            the output matches the regular expression RE\n"
            "      --choice A,B,...      the output is one of the comma-separated strings\n"
            "router (without -m):\n"
            "      --router EP[,EP...]   router client endpoint (default $TANDEM_ROUTER or\n"
            "                            " TDM_CLIENT_DEFAULT_ENDPOINT "); several: each request\n"
            "                            goes to the next in turn, and to the one after when its\n"
            "                            router fails before the first token\n"
            "      --api-key KEY         API key (default $TANDEM_API_KEY)\n"
            "      --served-model NAME   the served model (a name or alias; default: the\n"
            "                            router's first)\n"
            "      --timeout SECONDS     deadline of the request (default 600)\n"
            "      --stop STR            stop string (repeatable, at most 16)\n"
            "      --choices N           N choices of the prompt (OpenAI's n, 1..16; seeds S + i,\n"
            "                            one prefill), each printed whole under its label\n"
            "engine (with -m):\n"
            "  -t, --threads N           CPU threads (default: all)\n"
            "  -c, --ctx N               context length (default: min(4096, model's))\n"
            "      --batch N             prefill chunk, tokens per forward pass (default 512)\n"
            "      --kv-dtype T          f16 (default), f32 or q8\n"
            "      --device D            cpu (default), cuda or cuda:N (CUDA builds: the engine\n"
            "                            and its KV on GPU N, as a node's device: cuda:N)\n"
            "  -h, --help                this help\n");
}

typedef struct gen_opts {
    const char *model, *prompt, *file, *chat, *system, *chat_template, *tools;
    long max_tokens, threads, ctx, batch, choices;
    const char *kv_dtype, *device;
    tdm_cli_sampling_t sampling; /* the preset and the overrides applied after it */
    tdm_sampling_params_t bias;  /* --logit-bias and --allowed-token-ids entries (only its
                                    logit_bias and allowed are used) */
    long min_tokens;
    const char *bad_words[TDM_SAMPLING_MAX_BAD_WORDS]; /* --bad-word */
    size_t n_bad_words;
    /* router path */
    const char *router, *api_key;
    const char *served_model; /* --served-model: GenerateRequest.model (router only) */
    double timeout_s;
    const char *stop[TDM_MAX_STOP_STRINGS];
    size_t n_stop;
    const char *json_schema, *grammar, *regex, *choice; /* structured output sources */
    bool json_object;
    const char *local_only;  /* the first option given that needs -m, NULL if none */
    const char *router_only; /* the first option given that needs the router */
} gen_opts_t;

/* --stop: one more stop string into the gen_opts_t at target. */
static bool opt_stop(const char *cmd, const char *value, void *target)
{
    gen_opts_t *o = target;
    if (o->n_stop == TDM_MAX_STOP_STRINGS) {
        fprintf(stderr, "%s: --stop: at most %d stop strings\n", cmd, TDM_MAX_STOP_STRINGS);
        return false;
    }
    if (!value[0] || strlen(value) > TDM_MAX_STOP_STRING_BYTES) {
        fprintf(stderr, "%s: --stop: a stop string has 1..%d bytes\n", cmd,
                TDM_MAX_STOP_STRING_BYTES);
        return false;
    }
    o->stop[o->n_stop++] = value;
    return true;
}

/* --logit-bias ID:BIAS: one more entry into the gen_opts_t at target. */
static bool opt_logit_bias(const char *cmd, const char *value, void *target)
{
    gen_opts_t *o = target;
    char *end;
    long id = strtol(value, &end, 10);
    const char *colon = end;
    float bias = *colon == ':' ? strtof(colon + 1, &end) : 0.0f;
    if (end == value || *colon != ':' || end == colon + 1 || *end || id < 0 || id > INT32_MAX) {
        fprintf(stderr, "%s: --logit-bias: expected ID:BIAS (e.g. 42:-100), got '%s'\n", cmd,
                value);
        return false;
    }
    tdm_error_t err = {0};
    if (tdm_sampling_logit_bias_add(&o->bias, (int32_t)id, bias, &err) != TDM_OK) {
        fprintf(stderr, "%s: --logit-bias: %s\n", cmd, err.msg);
        return false;
    }
    return true;
}

/* --bad-word WORD: one more word into the gen_opts_t at target (tokenized by the router, or
 * with -m by tdm_prompt_bad_word once the model is loaded). */
static bool opt_bad_word(const char *cmd, const char *value, void *target)
{
    gen_opts_t *o = target;
    if (o->n_bad_words == TDM_SAMPLING_MAX_BAD_WORDS) {
        fprintf(stderr, "%s: --bad-word: at most %d words\n", cmd, TDM_SAMPLING_MAX_BAD_WORDS);
        return false;
    }
    if (!value[0] || strlen(value) > TDM_SAMPLING_MAX_BAD_WORD_BYTES) {
        fprintf(stderr, "%s: --bad-word: a word has 1..%d bytes\n", cmd,
                TDM_SAMPLING_MAX_BAD_WORD_BYTES);
        return false;
    }
    o->bad_words[o->n_bad_words++] = value;
    return true;
}

/* --allowed-token-ids ID,ID,...: more allowed token ids into the gen_opts_t at target. */
static bool opt_allowed(const char *cmd, const char *value, void *target)
{
    gen_opts_t *o = target;
    const char *at = value;
    for (;;) {
        char *end;
        long id = strtol(at, &end, 10);
        if (end == at || (*end && *end != ',') || id < 0 || id > INT32_MAX) {
            fprintf(stderr, "%s: --allowed-token-ids: expected ID,ID,... (e.g. 28,29), got '%s'\n",
                    cmd, value);
            return false;
        }
        if (o->bias.n_allowed == TDM_SAMPLING_MAX_ALLOWED) {
            fprintf(stderr, "%s: --allowed-token-ids: at most %d ids\n", cmd,
                    TDM_SAMPLING_MAX_ALLOWED);
            return false;
        }
        o->bias.allowed[o->bias.n_allowed++] = (int32_t)id;
        if (!*end)
            return true;
        at = end + 1;
    }
}

/* The sampling parameters of o (tdm_cli_sampling_build, then the --logit-bias entries,
 * --min-tokens and --allowed-token-ids). Returns false after printing why. */
static bool build_sampling(const gen_opts_t *o, tdm_sampling_params_t *sp)
{
    if (!tdm_cli_sampling_build("tandem generate", &o->sampling, o->max_tokens, sp))
        return false;
    sp->n_logit_bias = o->bias.n_logit_bias;
    memcpy(sp->logit_bias, o->bias.logit_bias, sp->n_logit_bias * sizeof sp->logit_bias[0]);
    sp->min_tokens = (int32_t)o->min_tokens;
    sp->n_allowed = o->bias.n_allowed;
    memcpy(sp->allowed, o->bias.allowed, sp->n_allowed * sizeof sp->allowed[0]);
    return true;
}

/* The checks between options once all are read: -m against the router-only options and the
 * engine options against the router, exactly one input, --system/--chat-template with --chat.
 * Returns 0 or 2 after printing why. */
static int check_args(const gen_opts_t *o)
{
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
    if ((o->system || o->chat_template || o->tools) && !o->chat) {
        fprintf(stderr, "tandem generate: --system, --chat-template and --tools need --chat\n");
        return 2;
    }
    if ((o->json_schema != NULL) + o->json_object + (o->grammar != NULL) + (o->regex != NULL) +
            (o->choice != NULL) >
        1) {
        fprintf(stderr, "tandem generate: give at most one of --json-schema, --json-object, "
                        "--grammar, --regex, --choice\n");
        return 2;
    }
    return 0;
}

/* Returns 0 to go on, or the exit status (0 for --help, with *done set). */
static int parse_args(int argc, char **argv, gen_opts_t *o, bool *done)
{
    const char **local = &o->local_only, **routed = &o->router_only;
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("model", 'm', &o->model),
        TDM_CLI_OPT_STR("prompt", 'p', &o->prompt),
        TDM_CLI_OPT_STR("file", 'f', &o->file),
        TDM_CLI_OPT_STR("chat", 0, &o->chat),
        TDM_CLI_OPT_STR("system", 0, &o->system),
        TDM_CLI_OPT_STR("tools", 0, &o->tools),
        TDM_CLI_OPT_STR("chat-template", 0, &o->chat_template, .mark = local,
                        .label = "--chat-template"),
        TDM_CLI_OPT_LONG("max-tokens", 'n', &o->max_tokens, 1, 1 << 20),
        TDM_CLI_SAMPLING_OPTS(&o->sampling),
        TDM_CLI_OPT_FN("logit-bias", 0, opt_logit_bias, o),
        TDM_CLI_OPT_LONG("min-tokens", 0, &o->min_tokens, 0, 1 << 20),
        TDM_CLI_OPT_FN("bad-word", 0, opt_bad_word, o),
        TDM_CLI_OPT_FN("allowed-token-ids", 0, opt_allowed, o),
        TDM_CLI_OPT_LONG("threads", 't', &o->threads, 1, 1024, .mark = local,
                         .label = "-t/--threads"),
        TDM_CLI_OPT_LONG("ctx", 'c', &o->ctx, 16, 1 << 20, .mark = local, .label = "-c/--ctx"),
        TDM_CLI_OPT_LONG("batch", 0, &o->batch, 1, 65536, .mark = local, .label = "--batch"),
        TDM_CLI_OPT_STR("kv-dtype", 0, &o->kv_dtype, .mark = local, .label = "--kv-dtype"),
        TDM_CLI_OPT_STR("device", 0, &o->device, .mark = local, .label = "--device"),
        TDM_CLI_OPT_STR("router", 0, &o->router, .mark = routed, .label = "--router"),
        TDM_CLI_OPT_STR("api-key", 0, &o->api_key, .mark = routed, .label = "--api-key"),
        TDM_CLI_OPT_STR("served-model", 0, &o->served_model, .mark = routed,
                        .label = "--served-model"),
        TDM_CLI_OPT_DOUBLE("timeout", 0, &o->timeout_s, 0.001, 86400, .mark = routed,
                           .label = "--timeout"),
        TDM_CLI_OPT_FN("stop", 0, opt_stop, o, .mark = routed, .label = "--stop"),
        TDM_CLI_OPT_LONG("choices", 0, &o->choices, 1, 16, .mark = routed, .label = "--choices"),
        TDM_CLI_OPT_STR("json-schema", 0, &o->json_schema),
        TDM_CLI_OPT_TRUE("json-object", 0, &o->json_object),
        TDM_CLI_OPT_STR("grammar", 0, &o->grammar),
        TDM_CLI_OPT_STR("regex", 0, &o->regex),
        TDM_CLI_OPT_STR("choice", 0, &o->choice),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem generate", usage, NULL, opts};
    o->max_tokens = 256;
    o->batch = 512;
    o->kv_dtype = "f16";
    o->device = "cpu";
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (*done)
        return status;
    if (optind != argc) {
        fprintf(
            stderr,
            "tandem generate: unexpected argument '%s' (give the prompt with -p TEXT, --chat TEXT "
            "or -f FILE)\n",
            argv[optind]);
        return 2;
    }
    return check_args(o);
}

/* Tokenizes the input of o (the raw prompt, the file, or the chat message) into *ids (heap,
 * *n_ids tokens) with tdm_chat_template_pick and tdm_prompt_encode, as the router does. */
static int encode_prompt(const gen_opts_t *o, const tdm_gguf_t *g, const tdm_tokenizer_t *tok,
                         int32_t **ids, size_t *n_ids, tdm_error_t *err)
{
    char *file_text = NULL;
    tdm_prompt_input_t in = {0};
    tdm_chat_pick_t pick = {0};
    tdm_chat_message_t user = {.role = "user", .content = o->chat};
    int rc = TDM_OK;
    if (o->prompt) {
        in.text = o->prompt;
        in.text_len = strlen(o->prompt);
    } else if (o->file) {
        if (strcmp(o->file, "-") != 0)
            rc = tdm_read_file(o->file, (size_t)1 << 30, &file_text, &in.text_len, err);
        else if ((rc = tdm_cli_read_stream(stdin, 0, &file_text, &in.text_len)) != TDM_OK)
            tdm_error_set(err, rc, "reading stdin: %s", tdm_strerror(rc));
        if (rc != TDM_OK)
            return rc;
        in.text = file_text;
    } else {
        rc = tdm_chat_template_pick(g, tok, o->chat_template, &pick, err);
        if (rc != TDM_OK)
            return rc;
        in.messages = &user;
        in.n_messages = 1;
        in.system = o->system;
        size_t tools_len;
        if (o->tools && (rc = tdm_read_file(o->tools, (size_t)1 << 24, &file_text, &tools_len,
                                            err)) != TDM_OK) {
            tdm_chat_pick_release(&pick);
            return rc;
        }
        in.tools = file_text;
    }
    rc = tdm_prompt_encode(tok, o->chat ? &pick : NULL, &in, ids, n_ids, NULL, err);
    tdm_chat_pick_release(&pick);
    free(file_text);
    return rc;
}

/* ---- structured output ---- */

/* The comma-separated choices as a JSON array of strings (heap; caller frees), or NULL on out
 * of memory. */
static char *choice_json(const char *list)
{
    json_t *a = json_array();
    for (const char *p = list; a;) {
        size_t n = strcspn(p, ",");
        if (json_array_append_new(a, json_stringn(p, n)) != 0) {
            json_decref(a);
            return NULL;
        }
        if (!p[n])
            break;
        p += n + 1;
    }
    char *text = a ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    return text;
}

/* The constraint the options ask for: *kind and its source text in *text (heap, caller frees;
 * NULL for none and json_object). Returns 0 or the exit status 1 after printing why. */
static int constraint_source(const gen_opts_t *o, int *kind, char **text)
{
    const char *cmd = "tandem generate";
    const char *file = o->json_schema ? o->json_schema : o->grammar;
    *text = NULL;
    *kind = o->json_schema   ? TDM_CONSTRAINT_JSON_SCHEMA
            : o->grammar     ? TDM_CONSTRAINT_GRAMMAR
            : o->json_object ? TDM_CONSTRAINT_JSON_OBJECT
            : o->regex       ? TDM_CONSTRAINT_REGEX
            : o->choice      ? TDM_CONSTRAINT_CHOICE
                             : TDM_CONSTRAINT_NONE;
    if (file) {
        tdm_error_t err = {0};
        size_t len;
        if (tdm_read_file(file, TDM_GRAMMAR_MAX_TEXT_BYTES, text, &len, &err) != TDM_OK) {
            fprintf(stderr, "%s: %s: %s\n", cmd, file, err.msg);
            return 1;
        }
    } else if (o->regex) {
        *text = tdm_strdup(o->regex);
    } else if (o->choice) {
        *text = choice_json(o->choice);
    }
    if ((o->regex || o->choice) && !*text) {
        fprintf(stderr, "%s: out of memory\n", cmd);
        return 1;
    }
    return 0;
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

/* --choices N: each choice's whole answer (stream=false), under a label naming it. */
static int router_on_choice(void *user, const tdm_client_chunk_t *ch)
{
    (void)user;
    printf("--- choice %" PRIu32 " (finish: %s) ---\n", ch->choice,
           tdm_client_finish_name(ch->finish_reason));
    fwrite(ch->text, 1, ch->text_len, stdout);
    fputc('\n', stdout);
    fflush(stdout);
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

/* Reads -f FILE ('-': stdin) into *text (heap; caller frees). Returns 0 or 1 after printing
 * why. */
static int read_prompt_file(const char *cmd, const char *file, char **text)
{
    tdm_error_t err = {0};
    size_t len;
    int rc = strcmp(file, "-") == 0 ? tdm_cli_read_stream(stdin, 0, text, &len)
                                    : tdm_read_file(file, (size_t)1 << 30, text, &len, &err);
    if (rc != TDM_OK) {
        fprintf(stderr, "%s: %s: %s\n", cmd, file, err.msg[0] ? err.msg : tdm_strerror(rc));
        return 1;
    }
    return 0;
}

/* Streams req through the router and prints the usage figures (or why it failed). Returns
 * the exit status. */
static int router_run(const gen_opts_t *o, const tdm_client_request_t *req)
{
    const char *cmd = "tandem generate";
    int status;
    tdm_cli_catch_interrupt(false);
    const char *endpoint = tdm_cli_router_endpoint(o->router);
    tdm_client_t *c =
        tdm_cli_connect(cmd, endpoint, tdm_cli_api_key(o->api_key), o->timeout_s, &status);
    if (!c)
        return status;
    tdm_client_result_t res;
    int rc =
        tdm_client_generate(c, req, req->n > 1 ? router_on_choice : router_on_chunk, NULL, &res);
    if (req->n <= 1 && (res.text_len > 0 || rc == TDM_OK))
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
    return status;
}

/* `generate` without -m: the same request through the router. Returns the exit status. */
static int generate_router(const gen_opts_t *o)
{
    const char *cmd = "tandem generate";
    tdm_sampling_params_t sp;
    if (!build_sampling(o, &sp))
        return 2;
    tdm_error_t err = {0};
    if (tdm_sampling_params_validate(&sp, 0, &err) != TDM_OK) {
        fprintf(stderr, "%s: %s\n", cmd, err.msg);
        return 2;
    }
    char *file_text = NULL;
    if ((o->file && read_prompt_file(cmd, o->file, &file_text) != 0) ||
        (o->tools && read_prompt_file(cmd, o->tools, &file_text) != 0))
        return 1;
    tdm_chat_message_t msgs[2];
    size_t n_msgs = 0;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    if (o->chat) {
        if (o->system)
            msgs[n_msgs++] = (tdm_chat_message_t){.role = "system", .content = o->system};
        msgs[n_msgs++] = (tdm_chat_message_t){.role = "user", .content = o->chat};
        req.messages = msgs;
        req.n_messages = n_msgs;
        req.tools = file_text; /* --tools (--chat has no -f) */
    } else {
        req.prompt = o->prompt ? o->prompt : file_text;
    }
    req.sampling = sp;
    req.sampling_set = TDM_CLIENT_SAMPLING_ALL; /* the same parameters as -m would use */
    req.max_tokens = (int32_t)o->max_tokens;
    req.model = o->served_model;
    req.stop = o->stop;
    req.n_stop = o->n_stop;
    req.bad_words = o->bad_words;
    req.n_bad_words = o->n_bad_words;
    req.stream = o->choices <= 1; /* several: each choice whole, labelled */
    req.n = o->choices > 1 ? (uint32_t)o->choices : 1;
    int kind;
    char *constraint = NULL;
    int status = constraint_source(o, &kind, &constraint);
    req.constraint_kind = (tdm_client_constraint_t)kind; /* the router compiles it */
    req.constraint = constraint;
    if (status == 0)
        status = router_run(o, &req);
    free(constraint);
    free(file_text);
    return status;
}

/* ---- in this process ---- */

/* What an in-process generation holds; local_close releases it in reverse order. */
typedef struct local_gen {
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    int32_t *prompt; /* [n_prompt] token ids, heap */
    size_t n_prompt;
    uint32_t n_ctx; /* context length, tokens */
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *worker;               /* DECODE mode, one sequence */
    tdm_grammar_vocab_t *grammar_vocab; /* structured output: NULL without a constraint */
    tdm_grammar_t *grammar;
} local_gen_t;

static void local_close(local_gen_t *g)
{
    tdm_worker_destroy(&g->worker);
    tdm_grammar_destroy(&g->grammar);
    tdm_grammar_vocab_destroy(&g->grammar_vocab);
    tdm_engine_destroy(&g->engine);
    tdm_kv_pool_destroy(&g->pool);
    free(g->prompt);
    g->prompt = NULL;
    tdm_tokenizer_destroy(&g->tok);
    tdm_model_destroy(&g->model);
}

/* Fills *sp from o: greedy by default, then the preset, then the options given. Returns 0 or
 * the exit status 2 after printing why. The vocabulary check comes once the model is loaded. */
static int local_sampling(const gen_opts_t *o, tdm_sampling_params_t *sp)
{
    return build_sampling(o, sp) ? 0 : 2;
}

/* Sets g->n_ctx from --ctx (default min(4096, the model's)) and checks the prompt fits it.
 * Returns 0 or the exit status 2 after printing why. */
static int local_context(const gen_opts_t *o, local_gen_t *g)
{
    const tdm_llama_hparams_t *hp = tdm_model_hparams(g->model);
    g->n_ctx = o->ctx ? (uint32_t)o->ctx : 4096;
    if (g->n_ctx > hp->n_ctx_train) {
        if (o->ctx) {
            fprintf(stderr,
                    "tandem generate: --ctx %ld exceeds the model's context length %" PRIu32 "\n",
                    o->ctx, hp->n_ctx_train);
            return 2;
        }
        g->n_ctx = hp->n_ctx_train;
    }
    if (g->n_prompt == 0) {
        fprintf(stderr, "tandem generate: the prompt is empty (it must have at least 1 token)\n");
        return 2;
    }
    if (g->n_prompt >= g->n_ctx) {
        fprintf(stderr,
                "tandem generate: the prompt has %zu tokens; it must have 1..%" PRIu32
                " (the context is %" PRIu32 " tokens, raise it with --ctx)\n",
                g->n_prompt, g->n_ctx - 1, g->n_ctx);
        return 2;
    }
    return 0;
}

/* Loads the model and tokenizer, validates *sp against the vocabulary, adds the --bad-word
 * sequences to *sp (tdm_prompt_bad_word, as the router does) and encodes the prompt.
 * Returns 0 or the exit status (2 for bad input, 1 otherwise) after printing why; the caller
 * releases g with local_close either way. */
static int local_open_model(const gen_opts_t *o, tdm_sampling_params_t *sp, local_gen_t *g)
{
    tdm_error_t err = {0};
    g->model = tdm_model_load(o->model, &err);
    if (!g->model) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 1;
    }
    if (tdm_sampling_params_validate(sp, tdm_model_hparams(g->model)->n_vocab, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 2;
    }
    g->tok = tdm_tokenizer_new(tdm_model_gguf(g->model), &err);
    if (!g->tok) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 1;
    }
    for (size_t i = 0; i < o->n_bad_words; i++) { /* the router's rule (tandem/prompt.h) */
        int rc = tdm_prompt_bad_word(g->tok, o->bad_words[i], i, sp, &err);
        if (rc != TDM_OK) {
            fprintf(stderr, "tandem generate: --bad-word: %s\n", err.msg);
            return rc == TDM_EINVALID ? 2 : 1;
        }
    }
    if (encode_prompt(o, tdm_model_gguf(g->model), g->tok, &g->prompt, &g->n_prompt, &err) !=
        TDM_OK) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return err.code == TDM_EINVALID ? 2 : 1; /* 2: a bad --chat-template, --chat, --system */
    }
    return local_context(o, g);
}

/* The constraint the options ask for, compiled as the router compiles it
 * (tdm_constraint_compile) into g->grammar, with the vocabulary the worker masks over; nothing
 * without one. Returns 0 or the exit status (2 for a bad constraint, 1 otherwise) after
 * printing why. */
static int local_open_grammar(const gen_opts_t *o, local_gen_t *g)
{
    int kind;
    char *text = NULL;
    int status = constraint_source(o, &kind, &text);
    if (status != 0 || kind == TDM_CONSTRAINT_NONE)
        return status;
    tdm_error_t err = {0};
    tdm_buf_t gbnf = {0};
    uint64_t hash;
    int rc = tdm_constraint_compile(kind, text, text ? strlen(text) : 0, &gbnf, &hash, &err);
    free(text);
    if (rc == TDM_OK && !(g->grammar = tdm_grammar_parse(gbnf.data, gbnf.len, NULL, &err)))
        rc = err.code;
    tdm_buf_free(&gbnf);
    if (rc == TDM_OK && !(g->grammar_vocab = tdm_grammar_vocab_new(g->tok, &err)))
        rc = err.code;
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem generate: constraint (%s): %s\n", tdm_constraint_kind_name(kind),
                err.msg);
        return rc == TDM_EINVALID ? 2 : 1;
    }
    return 0;
}

/* Makes a KV pool holding one sequence of the whole context, the engine over it, and a
 * DECODE-mode worker for one sequence, as a decode node does with local prefill. Returns 0
 * or 1 after printing why. */
static int local_open_engine(const gen_opts_t *o, tdm_kv_dtype_t kv_dtype, local_gen_t *g)
{
    const tdm_llama_hparams_t *hp = tdm_model_hparams(g->model);
    tdm_error_t err = {0};
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, kv_dtype};
    g->pool = tdm_kv_pool_new(&kl, (uint32_t)tdm_kv_blocks_for_tokens(&kl, g->n_ctx), &err);
    if (!g->pool) {
        fprintf(stderr, "tandem generate: KV pool: %s\n", err.msg);
        return 1;
    }
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.backend = o->device;
    ep.n_threads = (int)o->threads;
    ep.n_ctx = g->n_ctx;
    ep.max_batch_tokens = (uint32_t)o->batch;
    ep.max_logits = 1;
    g->engine = tdm_engine_new(g->model, g->pool, &ep, &err);
    if (!g->engine) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 1;
    }
    /* one sequence, nothing queued behind it; whole --batch chunks, no prefix cache */
    tdm_worker_opts_t wo = {.mode = TDM_WORKER_MODE_DECODE,
                            .max_batch_tokens = (uint32_t)o->batch,
                            .max_running = 1,
                            .n_ctx = g->n_ctx,
                            .grammar_vocab = g->grammar_vocab};
    g->worker = tdm_worker_new(g->engine, g->pool, g->tok, hp->n_vocab, &wo, &err);
    if (!g->worker) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 1;
    }
    return 0;
}

/* The state of the one sequence's stream while the worker runs it. */
typedef struct local_stream {
    const tdm_tokenizer_t *tok;
    const tdm_sampling_params_t *sp;
    tdm_detok_t detok;
    double t_first;             /* when token 0 was sampled, tdm_time_now seconds */
    uint32_t completion_tokens; /* the stop token included, as the worker counts */
    tdm_worker_finish_t finish;
    bool done;
    bool failed;
} local_stream_t;

/* Writes the text token completes (none while a UTF-8 sequence is still open) to stdout. */
static void local_write_token(local_stream_t *st, int32_t token)
{
    char piece[512];
    size_t plen = 0;
    if (tdm_detok_push(&st->detok, token, piece, sizeof piece, &plen) == TDM_OK && plen) {
        fwrite(piece, 1, plen, stdout);
        fflush(stdout);
    }
}

/* Handles one step's events: writes each token's text to stdout and records the end. The
 * token that ended the sequence (EOS or a stop token: the FINISHED event right after it in
 * the same step says STOP) is counted but not written; a token that completed a grammar (also
 * STOP) is output and written. */
static void local_on_events(local_stream_t *st, const tdm_worker_event_t *ev, uint32_t n)
{
    for (uint32_t k = 0; k < n; k++) {
        if (ev[k].kind == TDM_WORKER_EVENT_TOKEN) {
            if (ev[k].index == 0)
                st->t_first = tdm_time_now();
            int32_t t = ev[k].sample.token;
            bool stop = k + 1 < n && ev[k + 1].kind == TDM_WORKER_EVENT_FINISHED &&
                        ev[k + 1].finish == TDM_WORKER_FINISH_STOP &&
                        (tdm_tokenizer_is_eog(st->tok, t) || tdm_sampling_is_stop(st->sp, t));
            if (!stop)
                local_write_token(st, ev[k].sample.token);
        } else if (ev[k].kind == TDM_WORKER_EVENT_FINISHED) {
            st->completion_tokens = ev[k].completion_tokens;
            st->finish = ev[k].finish;
            st->done = true;
        } else if (ev[k].kind == TDM_WORKER_EVENT_FAILED) {
            fprintf(stderr, "tandem generate: %s\n", ev[k].message);
            st->done = st->failed = true;
        }
    }
}

/* Runs the prompt through the worker (chunked prefill, then one decode row per step) to its
 * end, streaming the text to stdout, then prints the usage figures to stderr. Returns the
 * exit status: 0, 2 (the worker refused the sequence) or 1 (a failed step). */
static int local_run(const local_gen_t *g, const tdm_sampling_params_t *sp)
{
    tdm_error_t err = {0};
    tdm_worker_req_t req = {.seq_id = 1,
                            .prompt = g->prompt,
                            .n_prompt = (uint32_t)g->n_prompt,
                            .sampling = sp,
                            .grammar = g->grammar};
    double t_start = tdm_time_now();
    if (tdm_worker_add(g->worker, &req, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: %s\n", err.msg);
        return 2;
    }
    local_stream_t st = {0};
    st.tok = g->tok;
    st.sp = sp;
    tdm_detok_init(&st.detok, g->tok, false);
    while (!st.done) {
        const tdm_worker_event_t *ev;
        uint32_t n = 0;
        int rc = tdm_worker_step(g->worker, &ev, &n, &err);
        local_on_events(&st, ev, n);
        if (rc != TDM_OK && !st.done) {
            fprintf(stderr, "tandem generate: %s\n", err.msg);
            return 1;
        }
    }
    if (st.failed)
        return 1;
    char tail[64];
    size_t tlen = 0;
    if (tdm_detok_flush(&st.detok, tail, sizeof tail, &tlen) == TDM_OK && tlen)
        fwrite(tail, 1, tlen, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    double t_end = tdm_time_now();
    double ttft = st.t_first - t_start, decode_s = t_end - st.t_first;
    uint32_t n_gen = st.completion_tokens;
    /* LENGTH before max_tokens: the context limit cut it */
    const char *finish = st.finish == TDM_WORKER_FINISH_STOP ? "stop"
                         : n_gen < (uint32_t)sp->max_tokens  ? "length (the context is full)"
                                                             : "length";
    fprintf(stderr,
            "\nprompt tokens: %zu, generated tokens: %" PRIu32 ", finish: %s\n"
            "TTFT: %.1f ms (prefill %.1f tokens/s)\n"
            "decode: %.2f tokens/s (TPOT %.1f ms), backend %s\n",
            g->n_prompt, n_gen, finish, ttft * 1e3, (double)g->n_prompt / ttft,
            n_gen > 1 ? (double)(n_gen - 1) / decode_s : 0.0,
            n_gen > 1 ? decode_s * 1e3 / (double)(n_gen - 1) : 0.0,
            tdm_engine_backend_name(g->engine));
    return 0;
}

/* `generate -m`: the same worker the nodes run, over one sequence. Returns the exit status. */
static int generate_local(const gen_opts_t *o)
{
    tdm_sampling_params_t sp;
    int status = local_sampling(o, &sp);
    if (status != 0)
        return status;
    tdm_error_t err = {0};
    tdm_kv_dtype_t kv_dtype;
    if (tdm_kv_dtype_parse(o->kv_dtype, &kv_dtype, &err) != TDM_OK) {
        fprintf(stderr, "tandem generate: --kv-dtype: %s\n", err.msg);
        return 2;
    }
    local_gen_t g = {0};
    status = local_open_model(o, &sp, &g);
    if (status == 0)
        status = local_open_grammar(o, &g);
    if (status == 0)
        status = local_open_engine(o, kv_dtype, &g);
    if (status == 0)
        status = local_run(&g, &sp);
    local_close(&g);
    return status;
}

int tdm_cmd_generate(int argc, char **argv)
{
    gen_opts_t o = {0};
    tdm_sampling_params_default(&o.bias);
    bool done;
    int status = parse_args(argc, argv, &o, &done);
    if (status != 0 || done)
        return status;
    return o.model ? generate_local(&o) : generate_router(&o);
}
