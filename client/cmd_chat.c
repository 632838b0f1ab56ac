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
#include <getopt.h>
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
            "      --router ENDPOINT     router client endpoint (default $TANDEM_ROUTER or\n"
            "                            " TDM_CLIENT_DEFAULT_ENDPOINT ")\n"
            "      --api-key KEY         API key (default $TANDEM_API_KEY)\n"
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
    t->msgs[t->n].role = role; /* a string literal */
    t->msgs[t->n].content = copy;
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

int tdm_cmd_chat(int argc, char **argv)
{
    enum { OPT_SYSTEM = 256, OPT_STATS };
    static const struct option opts[] = {
        {"system", required_argument, NULL, OPT_SYSTEM},
        {"max-tokens", required_argument, NULL, 'n'},
        TDM_CLI_SAMPLING_LONG_OPTIONS,
        {"stop", required_argument, NULL, TDM_CLI_OPT_STOP},
        {"stats", no_argument, NULL, OPT_STATS},
        {"router", required_argument, NULL, TDM_CLI_OPT_ROUTER},
        {"api-key", required_argument, NULL, TDM_CLI_OPT_API_KEY},
        {"timeout", required_argument, NULL, TDM_CLI_OPT_TIMEOUT},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *system = NULL, *router = NULL, *api_key = NULL;
    const char *stop[TDM_MAX_STOP_STRINGS];
    size_t n_stop = 0;
    long max_tokens = 256;
    double timeout_s = 0;
    bool stats = false;
    tdm_cli_sampling_t cs = {0};
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "n:h", opts, NULL)) != -1) {
        int r = tdm_cli_sampling_option(CMD, c, optarg, &cs);
        if (r < 0)
            return 2;
        if (r > 0)
            continue;
        switch (c) {
        case OPT_SYSTEM: system = optarg; break;
        case 'n':
            if (!tdm_cli_parse_long(CMD, "--max-tokens", optarg, 1, 1 << 20, &max_tokens))
                return 2;
            break;
        case TDM_CLI_OPT_STOP:
            if (n_stop == TDM_MAX_STOP_STRINGS || !optarg[0] ||
                strlen(optarg) > TDM_MAX_STOP_STRING_BYTES) {
                fprintf(stderr, CMD ": --stop: at most %d stop strings of 1..%d bytes\n",
                        TDM_MAX_STOP_STRINGS, TDM_MAX_STOP_STRING_BYTES);
                return 2;
            }
            stop[n_stop++] = optarg;
            break;
        case OPT_STATS: stats = true; break;
        case TDM_CLI_OPT_ROUTER: router = optarg; break;
        case TDM_CLI_OPT_API_KEY: api_key = optarg; break;
        case TDM_CLI_OPT_TIMEOUT:
            if (!tdm_cli_parse_double(CMD, "--timeout", optarg, 0.001, 86400, &timeout_s))
                return 2;
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, CMD ": unexpected argument '%s' (messages are read from stdin)\n",
                argv[optind]);
        return 2;
    }
    tdm_sampling_params_t sp;
    if (!tdm_cli_sampling_build(CMD, &cs, max_tokens, &sp))
        return 2;
    tdm_error_t err = {0};
    if (tdm_sampling_params_validate(&sp, 0, &err) != TDM_OK) {
        fprintf(stderr, CMD ": %s\n", err.msg);
        return 2;
    }

    bool interactive = isatty(STDIN_FILENO);
    tdm_cli_catch_interrupt(false);
    int status;
    tdm_client_t *client = tdm_cli_connect(CMD, tdm_cli_router_endpoint(router),
                                           tdm_cli_api_key(api_key), timeout_s, &status);
    if (!client)
        return status;
    status = 0;
    transcript_t tr = {0};
    if (system && !transcript_push(&tr, "system", system, strlen(system))) {
        fprintf(stderr, CMD ": out of memory\n");
        status = 1;
        goto out_client;
    }
    char *line = NULL;
    size_t line_cap = 0;
    for (;;) {
        if (interactive) {
            fputs("> ", stderr);
            fflush(stderr);
        }
        errno = 0;
        ssize_t len = getline(&line, &line_cap, stdin);
        if (len < 0) {
            if (*tdm_cli_interrupt_flag()) {
                if (interactive)
                    fputc('\n', stderr);
                status = TDM_CLI_EXIT_INTERRUPTED;
            } else if (ferror(stdin) && errno != 0) {
                fprintf(stderr, CMD ": reading stdin: %s\n", strerror(errno));
                status = 1;
            }
            break; /* EOF ends the chat */
        }
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = '\0';
        if (len == 0)
            continue;
        if (!transcript_push(&tr, "user", line, (size_t)len)) {
            fprintf(stderr, CMD ": out of memory\n");
            status = 1;
            break;
        }
        tdm_client_request_t req;
        tdm_client_request_init(&req);
        req.messages = tr.msgs;
        req.n_messages = tr.n;
        req.sampling = sp;
        req.sampling_set = TDM_CLIENT_SAMPLING_ALL;
        req.max_tokens = (int32_t)max_tokens;
        req.stop = stop;
        req.n_stop = n_stop;
        tdm_client_result_t res;
        int rc = tdm_client_generate(client, &req, chat_on_chunk, NULL, &res);
        if (res.text_len > 0 || rc == TDM_OK)
            fputc('\n', stdout);
        fflush(stdout);
        if (rc == TDM_OK) {
            if (stats)
                fprintf(stderr,
                        "[prompt tokens %" PRIu32 " (cached %" PRIu32 "), generated %" PRIu32
                        ", finish %s, TTFT %.1f ms, TPOT %.1f ms]\n",
                        res.usage.prompt_tokens, res.usage.cached_prompt_tokens,
                        res.usage.completion_tokens, tdm_client_finish_name(res.finish_reason),
                        res.timings.ttft_s * 1e3, res.timings.tpot_s * 1e3);
            bool ok = transcript_push(&tr, "assistant", res.text, res.text_len);
            tdm_client_result_clear(&res);
            if (!ok) {
                fprintf(stderr, CMD ": out of memory\n");
                status = 1;
                break;
            }
            continue;
        }
        transcript_pop(&tr); /* the turn failed: forget the question */
        bool interrupted = rc == TDM_ECANCELLED && *tdm_cli_interrupt_flag();
        if (interrupted)
            fprintf(stderr, "[cancelled]\n");
        else
            fprintf(stderr, CMD ": %s (%s)\n", res.message, tdm_status_name(rc));
        tdm_client_result_clear(&res);
        if (interrupted && interactive) {
            tdm_cli_interrupt_reset();
            continue;
        }
        status = interrupted ? TDM_CLI_EXIT_INTERRUPTED : tdm_cli_exit_status(rc);
        if (interrupted || !interactive)
            break;
    }
    free(line);
    transcript_free(&tr);
out_client:
    tdm_client_destroy(&client);
    return status;
}
