/* cmd_tokenize.c - `tandem tokenize`: the token ids (and pieces) a model's tokenizer makes of a
 * text, a file or a chat message rendered through the model's chat template (the last with
 * tdm_prompt_encode, as the router and `tandem generate -m` do).
 * Works on vocabulary-only GGUF files: only the tokenizer.* metadata is read.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/chat.h"
#include "tandem/config.h"
#include "tandem/gguf.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"

/* Largest input read from a file or stdin, in bytes. */
#define TOKENIZE_MAX_INPUT (256u << 20)

#define TOKENIZE_SYNOPSIS                                                                          \
    "usage: tandem tokenize [-m MODEL] [options] (TEXT | -f FILE | --chat MESSAGE)\n"

/* After a usage error: the synopsis and where the options are described. */
static void usage_hint(void)
{
    fprintf(stderr, TOKENIZE_SYNOPSIS "run 'tandem tokenize --help' for the options\n");
}

static void usage(FILE *out)
{
    fprintf(out,
            TOKENIZE_SYNOPSIS
            "\n"
            "Prints the token ids the model's tokenizer makes of TEXT, space-separated on one\n"
            "line. No BOS is added to TEXT or FILE unless --bos is given; --chat gives the\n"
            "ids the router and 'tandem generate -m' make of the same message.\n"
            "\n"
            "options:\n"
            "  -m, --model PATH        GGUF model or vocabulary-only GGUF (default: $TANDEM_MODEL\n"
            "                          or the cached %s)\n"
            "  -f, --file FILE         tokenize the contents of FILE ('-' reads stdin), bytes\n"
            "                          as they are (a final newline is part of the text)\n"
            "      --special           match special tokens' texts (<|im_end|>, <s>) in the text;\n"
            "                          otherwise they are tokenized as plain text\n"
            "      --pieces            print one token per line: ID<TAB>\"decoded bytes\" with C\n"
            "                          escapes for control bytes and invalid UTF-8\n"
            "      --bos               prepend the BOS token (with --chat: unless the rendered\n"
            "                          prompt already starts with it)\n"
            "      --chat MESSAGE      render MESSAGE as a user turn through the chat template,\n"
            "                          with the assistant prompt after it, and tokenize the\n"
            "                          result as a prompt: special tokens matched, one BOS\n"
            "                          when the model's tokenizer adds one (docs/models.md)\n"
            "      --system TEXT       with --chat: the system message (default: the template's\n"
            "                          own default, if any)\n"
            "      --tools FILE        with --chat: tools (a JSON array of OpenAI tool objects)\n"
            "                          the template renders into the system message\n"
            "      --chat-template NAME|FILE  with --chat: a built-in template (chatml, llama3,\n"
            "                          llama2 or gemma) or a Jinja template file (default: the\n"
            "                          model's tokenizer.chat_template, or gemma for a Gemma\n"
            "                          model without one)\n"
            "  -h, --help              this help\n"
            "\n"
            "exit status: 0 success, 1 error (file, model, tokenizer), 2 bad usage\n",
            TDM_DEFAULT_MODEL_FILE);
}

/* Reads all of stdin into a NUL-terminated heap buffer; 0 or -1 (message printed). */
static int read_stdin(char **data, size_t *len)
{
    int rc = tdm_cli_read_stream(stdin, TOKENIZE_MAX_INPUT, data, len);
    if (rc == TDM_EINVALID)
        fprintf(stderr, "tandem tokenize: stdin: more than %u bytes of input\n",
                TOKENIZE_MAX_INPUT);
    else if (rc == TDM_ERESOURCE)
        fprintf(stderr, "tandem tokenize: out of memory reading stdin\n");
    else if (rc != TDM_OK)
        fprintf(stderr, "tandem tokenize: reading stdin failed\n");
    return rc == TDM_OK ? 0 : -1;
}

/* Prints bytes in double quotes: \n \t \r \" \\ escaped, other control bytes and bytes that
 * are not part of a well-formed UTF-8 character as \xHH, the rest as they are. */
static void print_quoted(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    putchar('"');
    for (size_t i = 0; i < n;) {
        unsigned char c = u[i];
        uint32_t cp;
        size_t len = tdm_utf8_decode(u + i, n - i, &cp);
        if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '\t')
            fputs("\\t", stdout);
        else if (c == '\r')
            fputs("\\r", stdout);
        else if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (len == 0 || c < 0x20 || c == 0x7F)
            printf("\\x%02x", c);
        else {
            fwrite(s + i, 1, len, stdout);
            i += len;
            continue;
        }
        i++;
    }
    putchar('"');
}

/* Tokenizes the --chat message as the router and `tandem generate -m` do
 * (tdm_chat_template_pick, tdm_prompt_encode) with the template override (a built-in name
 * or a template file; NULL: the model's tokenizer.chat_template) and the tools of the file tools
 * (NULL: none). Returns 0 with a heap array in *ids, or 1 (message printed). */
static int encode_chat(const tdm_gguf_t *g, const tdm_tokenizer_t *tok, const char *override,
                       const char *system, const char *message, const char *tools,
                       tdm_token_t **ids, size_t *n_ids)
{
    tdm_error_t err = {0};
    tdm_chat_pick_t pick = {0};
    char *tools_text = NULL;
    size_t tools_len;
    if (tdm_chat_template_pick(g, tok, override, &pick, &err) != TDM_OK ||
        (tools && tdm_read_file(tools, (size_t)1 << 24, &tools_text, &tools_len, &err) != TDM_OK)) {
        fprintf(stderr, "tandem tokenize: %s\n", err.msg);
        tdm_chat_pick_release(&pick);
        return 1;
    }
    tdm_chat_message_t user = {.role = "user", .content = message};
    tdm_prompt_input_t in = {
        .messages = &user, .n_messages = 1, .system = system, .tools = tools_text};
    int rc = tdm_prompt_encode(tok, &pick, &in, ids, n_ids, NULL, &err);
    free(tools_text);
    if (rc != TDM_OK)
        fprintf(stderr, "tandem tokenize: chat template %s: %s\n", pick.origin, err.msg);
    tdm_chat_pick_release(&pick);
    return rc != TDM_OK;
    return 0;
}

/* The command line of `tandem tokenize`. */
typedef struct tok_opts {
    const char *model, *file, *chat, *system, *template_name, *tools;
    const char *text; /* the TEXT operand, or NULL */
    bool special, pieces, bos;
} tok_opts_t;

/* Parses the command line into *o. Returns 0 to go on, or the exit status with *done set (0
 * after --help, 2 for bad usage, message and hint printed). */
static int parse_args(int argc, char **argv, tok_opts_t *o, bool *done)
{
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("model", 'm', &o->model),
        TDM_CLI_OPT_STR("file", 'f', &o->file),
        TDM_CLI_OPT_TRUE("special", 0, &o->special),
        TDM_CLI_OPT_TRUE("pieces", 0, &o->pieces),
        TDM_CLI_OPT_TRUE("bos", 0, &o->bos),
        TDM_CLI_OPT_STR("chat", 0, &o->chat),
        TDM_CLI_OPT_STR("system", 0, &o->system),
        TDM_CLI_OPT_STR("tools", 0, &o->tools),
        TDM_CLI_OPT_STR("chat-template", 0, &o->template_name),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem tokenize", usage, usage_hint, opts};
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (*done)
        return status;
    *done = true;
    int n_text = argc - optind;
    const char *usage_error = NULL;
    if (n_text > 1)
        usage_error = "give the text as one argument (quote it)";
    else if ((n_text == 1) + (o->file != NULL) + (o->chat != NULL) > 1)
        usage_error = "give only one of TEXT, -f FILE and --chat MESSAGE";
    else if (n_text == 0 && !o->file && !o->chat)
        usage_error = "nothing to tokenize: give TEXT, -f FILE or --chat MESSAGE";
    else if (!o->chat && (o->system || o->template_name || o->tools))
        usage_error = "--system, --chat-template and --tools only go with --chat";
    if (usage_error) {
        fprintf(stderr, "tandem tokenize: %s\n", usage_error);
        usage_hint();
        return 2;
    }
    o->text = n_text == 1 ? argv[optind] : NULL;
    tdm_error_t err = {0};
    if (o->template_name && tdm_chat_template_check(o->template_name, &err) != TDM_OK) {
        fprintf(stderr, "tandem tokenize: --chat-template: %s\n", err.msg);
        return 2;
    }
    *done = false;
    return 0;
}

/* Opens the model (-m, else the default) and its tokenizer. Returns 0, or 1 after printing
 * why; the caller destroys *g and *tok either way. */
static int open_tokenizer(const tok_opts_t *o, tdm_gguf_t **g, tdm_tokenizer_t **tok)
{
    char default_model[1024];
    const char *model = o->model;
    if (!model) {
        if (tdm_model_default_path(default_model, sizeof default_model) != TDM_OK) {
            fprintf(stderr, "tandem tokenize: no default model path (set HOME or TANDEM_MODEL, "
                            "or pass -m MODEL)\n");
            return 1;
        }
        model = default_model;
    }
    tdm_error_t err = {0};
    *g = tdm_gguf_open(model, &err);
    if (!*g) {
        fprintf(stderr, "tandem tokenize: %s\n", err.msg);
        if (err.code == TDM_ENOTFOUND && model == default_model)
            fprintf(stderr, "tandem tokenize: run scripts/setup to download the default model, "
                            "or pass -m MODEL\n");
        return 1;
    }
    *tok = tdm_tokenizer_new(*g, &err);
    if (!*tok) {
        fprintf(stderr, "tandem tokenize: %s: %s\n", model, err.msg);
        return 1;
    }
    if (o->bos && tdm_tokenizer_bos(*tok) < 0) {
        fprintf(stderr, "tandem tokenize: --bos: %s has no BOS token\n", model);
        return 1;
    }
    return 0;
}

/* Tokenizes TEXT or FILE as plain text, not a prompt: no BOS and no special tokens unless
 * asked for (--bos, --special). Returns 0 with a heap array in *ids, or 1 (message printed). */
static int encode_text(const tok_opts_t *o, const tdm_tokenizer_t *tok, tdm_token_t **ids,
                       size_t *n_ids)
{
    tdm_error_t err = {0};
    char *text = NULL;
    size_t len = 0;
    if (o->file && strcmp(o->file, "-") == 0) {
        if (read_stdin(&text, &len) != 0)
            return 1;
    } else if (o->file) {
        if (tdm_read_file(o->file, TOKENIZE_MAX_INPUT, &text, &len, &err) != TDM_OK) {
            fprintf(stderr, "tandem tokenize: %s\n", err.msg);
            return 1;
        }
    } else if (!(text = tdm_strdup(o->text))) {
        fprintf(stderr, "tandem tokenize: out of memory\n");
        return 1;
    } else {
        len = strlen(text);
    }
    int rc = tdm_tokenizer_encode(tok, text, len, o->bos, o->special, ids, n_ids, &err);
    if (rc != TDM_OK)
        fprintf(stderr, "tandem tokenize: %s\n", err.msg);
    free(text);
    return rc == TDM_OK ? 0 : 1;
}

/* --pieces: one "ID<TAB>"bytes"" line per token. Returns 0, or 1 after printing why. */
static int print_pieces(const tdm_tokenizer_t *tok, const tdm_token_t *ids, size_t n_ids)
{
    char small[256];
    for (size_t i = 0; i < n_ids; i++) {
        tdm_token_t id = ids[i];
        int blen = tdm_tokenizer_token_bytes(tok, id, true, small, sizeof small);
        char *piece = small;
        if (blen < 0) {
            fprintf(stderr, "tandem tokenize: token %d: %s\n", (int)id, tdm_strerror(blen));
            return 1;
        }
        if ((size_t)blen >= sizeof small) {
            piece = malloc((size_t)blen + 1);
            if (!piece) {
                fprintf(stderr, "tandem tokenize: out of memory\n");
                return 1;
            }
            tdm_tokenizer_token_bytes(tok, id, true, piece, (size_t)blen + 1);
        }
        printf("%d\t", (int)id);
        print_quoted(piece, (size_t)blen);
        putchar('\n');
        if (piece != small)
            free(piece);
    }
    return 0;
}

/* Prints the ids (space-separated on one line, or --pieces), then flushes stdout. Returns 0,
 * or 1 after printing why. */
static int print_ids(const tok_opts_t *o, const tdm_tokenizer_t *tok, const tdm_token_t *ids,
                     size_t n_ids)
{
    if (o->pieces) {
        if (print_pieces(tok, ids, n_ids) != 0)
            return 1;
    } else {
        for (size_t i = 0; i < n_ids; i++)
            printf("%s%d", i ? " " : "", (int)ids[i]);
        putchar('\n');
    }
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "tandem tokenize: writing the output failed\n");
        return 1;
    }
    return 0;
}

/* With --chat --bos: BOS in front of ids unless the rendered prompt starts with it already.
 * Returns 0, or 1 on out of memory (message printed). */
static int chat_prepend_bos(const tdm_tokenizer_t *tok, tdm_token_t **ids, size_t *n_ids)
{
    tdm_token_t bos_id = tdm_tokenizer_bos(tok);
    if (*n_ids > 0 && (*ids)[0] == bos_id)
        return 0;
    tdm_token_t *v = realloc(*ids, (*n_ids + 1) * sizeof *v);
    if (!v) {
        fprintf(stderr, "tandem tokenize: out of memory\n");
        return 1;
    }
    memmove(v + 1, v, *n_ids * sizeof *v);
    v[0] = bos_id;
    *ids = v;
    (*n_ids)++;
    return 0;
}

int tdm_cmd_tokenize(int argc, char **argv)
{
    tok_opts_t o = {0};
    bool done;
    int status = parse_args(argc, argv, &o, &done);
    if (done)
        return status;
    tdm_gguf_t *g = NULL;
    tdm_tokenizer_t *tok = NULL;
    tdm_token_t *ids = NULL;
    size_t n_ids = 0;
    status = open_tokenizer(&o, &g, &tok);
    if (status == 0 && o.chat)
        status = encode_chat(g, tok, o.template_name, o.system, o.chat, o.tools, &ids, &n_ids);
    else if (status == 0)
        status = encode_text(&o, tok, &ids, &n_ids);
    if (status == 0 && o.chat && o.bos)
        status = chat_prepend_bos(tok, &ids, &n_ids);
    if (status == 0)
        status = print_ids(&o, tok, ids, n_ids);
    free(ids);
    tdm_tokenizer_destroy(&tok);
    tdm_gguf_destroy(&g);
    return status;
}
