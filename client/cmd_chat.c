/* cmd_chat.c - `tandem chat`: a multi-turn conversation through the router.
 *
 * Reads one user message per line from stdin, keeps the whole conversation as chat messages
 * (system, user, assistant, ...) and sends it with each turn, so the router renders it with the
 * model's chat template; streams each answer to stdout followed by a newline. EOF ends the
 * chat. On a terminal a "> " prompt goes to stderr and Ctrl-C cancels the answer being
 * written (the turn is dropped) or, at the prompt, ends the chat; with piped input every line
 * is one turn and Ctrl-C ends the chat (exit 130).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/client.h"

#define CMD "tandem chat"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem chat [options] < lines\n"
            "\n"
            "Chats with the served model through the router: each line read from stdin is a\n"
            "user message; each answer is streamed to stdout. The conversation is kept, so\n"
            "later turns see the earlier ones. EOF (Ctrl-D) ends the chat.\n"
            "\n"
            "      --system TEXT         system message (default: the model template's)\n"
            "  -n, --max-tokens N        tokens per answer at most (default 256)\n"
            "      --preset NAME         precise, chat or creative; options below override it\n"
            "      --temperature T       0 = greedy (default), up to 5\n"
            "      --top-k K, --top-p P, --min-p P, --repetition-penalty R,\n"
            "      --presence-penalty X, --frequency-penalty X, --seed S, --ignore-eos\n"
            "                            as for `tandem generate`\n"
            "      --stop STR            stop string (repeatable, at most 16)\n"
            "      --stats               print each answer's usage figures to stderr\n"
            "      --router EP[,EP...]   router client endpoint (default $TANDEM_ROUTER or\n"
            "                            " TDM_CLIENT_DEFAULT_ENDPOINT "); several: each request\n"
            "                            goes to the next in turn, and to the one after when its\n"
            "                            router fails before the first token\n"
            "      --api-key KEY         API key (default $TANDEM_API_KEY)\n"
            "      --served-model NAME   the served model to chat with (a name or alias;\n"
            "                            default: the router's first)\n"
            "      --timeout SECONDS     deadline of each answer (default 600)\n"
            "  -h, --help                this help\n");
}

/* The conversation: messages whose strings the chat owns. */
typedef struct transcript {
    tdm_chat_message_t *msgs;
    size_t n, cap;
} transcript_t;

static bool transcript_push(transcript_t *t, const char *role, const char *content, size_t len)
{
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        tdm_chat_message_t *m = realloc(t->msgs, cap * sizeof *m);
        if (!m)
            return false;
        t->msgs = m;
        t->cap = cap;
    }
    char *copy = malloc(len + 1);
    if (!copy)
        return false;
    memcpy(copy, content, len);
    copy[len] = '\0';
    t->msgs[t->n] = (tdm_chat_message_t){.role = role /* a string literal */, .content = copy};
    t->n++;
    return true;
}

static void transcript_pop(transcript_t *t)
{
    if (t->n == 0)
        return;
    t->n--;
    free((char *)(uintptr_t)t->msgs[t->n].content);
}

static void transcript_free(transcript_t *t)
{
    while (t->n > 0)
        transcript_pop(t);
    free(t->msgs);
}

static int chat_on_chunk(void *user, const tdm_client_chunk_t *ch)
{
    (void)user;
    if (ch->text_len) {
        fwrite(ch->text, 1, ch->text_len, stdout);
        fflush(stdout);
    }
    return *tdm_cli_interrupt_flag() != 0;
}

/* The command line of `tandem chat`. */
typedef struct chat_opts {
    const char *system, *router, *api_key;
    const char *served_model; /* --served-model: GenerateRequest.model */
    const char *stop[TDM_MAX_STOP_STRINGS];
    size_t n_stop;
    long max_tokens;
    double timeout_s;
    bool stats;
    tdm_cli_sampling_t sampling;
} chat_opts_t;

/* --stop: one more stop string into the chat_opts_t at target. */
static bool opt_stop(const char *cmd, const char *value, void *target)
{
    chat_opts_t *o = target;
    if (o->n_stop == TDM_MAX_STOP_STRINGS || !value[0] ||
        strlen(value) > TDM_MAX_STOP_STRING_BYTES) {
        fprintf(stderr, "%s: --stop: at most %d stop strings of 1..%d bytes\n", cmd,
                TDM_MAX_STOP_STRINGS, TDM_MAX_STOP_STRING_BYTES);
        return false;
    }
    o->stop[o->n_stop++] = value;
    return true;
}

/* Parses the options and builds the sampling parameters *sp. Returns 0 to go on, or the exit
 * status with *done set (0 after --help, 2 for bad usage, message printed). */
static int parse_args(int argc, char **argv, chat_opts_t *o, tdm_sampling_params_t *sp, bool *done)
{
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("system", 0, &o->system),
        TDM_CLI_OPT_LONG("max-tokens", 'n', &o->max_tokens, 1, 1 << 20),
        TDM_CLI_SAMPLING_OPTS(&o->sampling),
        TDM_CLI_OPT_FN("stop", 0, opt_stop, o),
        TDM_CLI_OPT_TRUE("stats", 0, &o->stats),
        TDM_CLI_OPT_STR("served-model", 0, &o->served_model),
        TDM_CLI_ROUTER_OPTS(&o->router, &o->api_key, &o->timeout_s),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {CMD, usage, NULL, opts};
    o->max_tokens = 256;
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (*done)
        return status;
    *done = true;
    if (optind != argc) {
        fprintf(stderr, CMD ": unexpected argument '%s' (messages are read from stdin)\n",
                argv[optind]);
        return 2;
    }
    if (!tdm_cli_sampling_build(CMD, &o->sampling, o->max_tokens, sp))
        return 2;
    tdm_error_t err = {0};
    if (tdm_sampling_params_validate(sp, 0, &err) != TDM_OK) {
        fprintf(stderr, CMD ": %s\n", err.msg);
        return 2;
    }
    *done = false;
    return 0;
}

/* A running chat: the options, the connection and the conversation so far. */
typedef struct chat {
    const chat_opts_t *o;
    const tdm_sampling_params_t *sp;
    tdm_client_t *client;
    transcript_t tr;
    bool interactive; /* stdin is a terminal */
} chat_t;

/* Reads the next non-empty line into *line (newline stripped). Returns its length, or -1 at
 * the end of the chat: EOF (*status unchanged), Ctrl-C (*status 130) or a read error (1). */
static ssize_t read_turn(const chat_t *ch, char **line, size_t *cap, int *status)
{
    for (;;) {
        if (ch->interactive) {
            fputs("> ", stderr);
            fflush(stderr);
        }
        errno = 0;
        ssize_t len = getline(line, cap, stdin);
        if (len < 0) {
            if (*tdm_cli_interrupt_flag()) {
                if (ch->interactive)
                    fputc('\n', stderr);
                *status = TDM_CLI_EXIT_INTERRUPTED;
            } else if (ferror(stdin) && errno != 0) {
                fprintf(stderr, CMD ": reading stdin: %s\n", strerror(errno));
                *status = 1;
            }
            return -1; /* EOF ends the chat */
        }
        while (len > 0 && ((*line)[len - 1] == '\n' || (*line)[len - 1] == '\r'))
            (*line)[--len] = '\0';
        if (len > 0)
            return len;
    }
}

/* Sends the conversation (the new user message last) and streams the answer. Returns true to
 * go on with the next turn; a failed turn sets *status (and ends a chat that is not
 * interactive). */
static bool chat_turn(chat_t *ch, int *status)
{
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.messages = ch->tr.msgs;
    req.n_messages = ch->tr.n;
    req.sampling = *ch->sp;
    req.sampling_set = TDM_CLIENT_SAMPLING_ALL;
    req.max_tokens = (int32_t)ch->o->max_tokens;
    req.model = ch->o->served_model;
    req.stop = ch->o->stop;
    req.n_stop = ch->o->n_stop;
    tdm_client_result_t res;
    int rc = tdm_client_generate(ch->client, &req, chat_on_chunk, NULL, &res);
    if (res.text_len > 0 || rc == TDM_OK)
        fputc('\n', stdout);
    fflush(stdout);
    if (rc == TDM_OK) {
        if (ch->o->stats)
            fprintf(stderr,
                    "[prompt tokens %" PRIu32 " (cached %" PRIu32 "), generated %" PRIu32
                    ", finish %s, TTFT %.1f ms, TPOT %.1f ms]\n",
                    res.usage.prompt_tokens, res.usage.cached_prompt_tokens,
                    res.usage.completion_tokens, tdm_client_finish_name(res.finish_reason),
                    res.timings.ttft_s * 1e3, res.timings.tpot_s * 1e3);
        bool ok = transcript_push(&ch->tr, "assistant", res.text, res.text_len);
        tdm_client_result_clear(&res);
        if (!ok) {
            fprintf(stderr, CMD ": out of memory\n");
            *status = 1;
            return false;
        }
        return true;
    }
    transcript_pop(&ch->tr); /* the turn failed: forget the question */
    bool interrupted = rc == TDM_ECANCELLED && *tdm_cli_interrupt_flag();
    if (interrupted)
        fprintf(stderr, "[cancelled]\n");
    else
        fprintf(stderr, CMD ": %s (%s)\n", res.message, tdm_status_name(rc));
    tdm_client_result_clear(&res);
    if (interrupted && ch->interactive) {
        tdm_cli_interrupt_reset();
        return true;
    }
    *status = interrupted ? TDM_CLI_EXIT_INTERRUPTED : tdm_cli_exit_status(rc);
    return !interrupted && ch->interactive;
}

/* One turn per line of stdin until EOF, Ctrl-C or a failure. Returns the exit status. */
static int chat_loop(chat_t *ch)
{
    char *line = NULL;
    size_t line_cap = 0;
    int status = 0;
    for (;;) {
        ssize_t len = read_turn(ch, &line, &line_cap, &status);
        if (len < 0)
            break;
        if (!transcript_push(&ch->tr, "user", line, (size_t)len)) {
            fprintf(stderr, CMD ": out of memory\n");
            status = 1;
            break;
        }
        if (!chat_turn(ch, &status))
            break;
    }
    free(line);
    return status;
}

int tdm_cmd_chat(int argc, char **argv)
{
    chat_opts_t o = {0};
    tdm_sampling_params_t sp;
    bool done;
    int status = parse_args(argc, argv, &o, &sp, &done);
    if (done)
        return status;
    chat_t ch = {.o = &o, .sp = &sp, .interactive = isatty(STDIN_FILENO)};
    tdm_cli_catch_interrupt(false);
    ch.client = tdm_cli_connect(CMD, tdm_cli_router_endpoint(o.router), tdm_cli_api_key(o.api_key),
                                o.timeout_s, &status);
    if (!ch.client)
        return status;
    if (o.system && !transcript_push(&ch.tr, "system", o.system, strlen(o.system))) {
        fprintf(stderr, CMD ": out of memory\n");
        status = 1;
    } else {
        status = chat_loop(&ch);
    }
    transcript_free(&ch.tr);
    tdm_client_destroy(&ch.client);
    return status;
}
