/* cmd_tokenize.c - `tandem tokenize`: the token ids (and pieces) a model's tokenizer makes of a
 * text, a file or a chat message rendered through the model's chat template (the last with
 * tdm_prompt_encode, as the router and `tandem generate -m` do).
 * Works on vocabulary-only GGUF files: only the tokenizer.* metadata is read.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
            "                          result as a prompt: special tokens matched, BOS added\n"
            "                          when the model's tokenizer adds one and the template\n"
            "                          does not write it\n"
            "      --system TEXT       with --chat: the system message (default: the template's\n"
            "                          own default, if any)\n"
            "      --chat-template NAME  with --chat: chatml, llama3 or llama2 (default: detected\n"
            "                          from the model's tokenizer.chat_template)\n"
            "  -h, --help              this help\n"
            "\n"
            "exit status: 0 success, 1 error (file, model, tokenizer), 2 bad usage\n",
            TDM_DEFAULT_MODEL_FILE);
}

/* Reads all of stdin into a NUL-terminated heap buffer; 0 or -1 (message printed). */
static int read_stdin(char **data, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        goto out_nomem;
    for (;;) {
        if (cap - n < 2) {
            if (cap >= TOKENIZE_MAX_INPUT) {
                fprintf(stderr, "tandem tokenize: stdin: more than %u bytes of input\n",
                        TOKENIZE_MAX_INPUT);
                free(buf);
                return -1;
            }
            char *p = realloc(buf, cap * 2);
            if (!p)
                goto out_nomem;
            buf = p;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, stdin);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(stdin)) {
        fprintf(stderr, "tandem tokenize: reading stdin failed\n");
        free(buf);
        return -1;
    }
    buf[n] = '\0';
    *data = buf;
    *len = n;
    return 0;

out_nomem:
    free(buf);
    fprintf(stderr, "tandem tokenize: out of memory reading stdin\n");
    return -1;
}

/* Length of the well-formed UTF-8 character at s[0..n), 0 when it is not one. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    size_t len;
    unsigned cp;
    if (s[0] < 0x80)
        return 1;
    if ((s[0] & 0xE0) == 0xC0)
        len = 2, cp = s[0] & 0x1Fu;
    else if ((s[0] & 0xF0) == 0xE0)
        len = 3, cp = s[0] & 0x0Fu;
    else if ((s[0] & 0xF8) == 0xF0)
        len = 4, cp = s[0] & 0x07u;
    else
        return 0;
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3Fu);
    }
    static const unsigned min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

/* Prints bytes in double quotes: \n \t \r \" \\ escaped, other control bytes and bytes that
 * are not part of a well-formed UTF-8 character as \xHH, the rest as they are. */
static void print_quoted(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    putchar('"');
    for (size_t i = 0; i < n;) {
        unsigned char c = u[i];
        size_t len = utf8_len(u + i, n - i);
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
 * (tdm_chat_template_pick, tdm_prompt_encode) with the named template (NULL: the one the
 * model's tokenizer.chat_template names). Returns 0 with a heap array in *ids, or 1 (message
 * printed). */
static int encode_chat(const tdm_gguf_t *g, const tdm_tokenizer_t *tok,
                       const tdm_chat_template_t *named, const char *system, const char *message,
                       tdm_token_t **ids, size_t *n_ids)
{
    tdm_error_t err = {0};
    tdm_chat_pick_t pick;
    if (tdm_chat_template_pick(g, named, &pick, &err) != TDM_OK) {
        fprintf(stderr, "tandem tokenize: %s\n", err.msg);
        return 1;
    }
    tdm_chat_message_t user = {"user", message};
    tdm_prompt_input_t in = {.messages = &user, .n_messages = 1, .system = system};
    if (tdm_prompt_encode(tok, &pick, &in, ids, n_ids, NULL, &err) != TDM_OK) {
        fprintf(stderr, "tandem tokenize: chat template %s: %s\n",
                tdm_chat_template_name(pick.tmpl), err.msg);
        return 1;
    }
    return 0;
}

int tdm_cmd_tokenize(int argc, char **argv)
{
    enum { OPT_SPECIAL = 256, OPT_PIECES, OPT_BOS, OPT_CHAT, OPT_SYSTEM, OPT_TEMPLATE };
    static const struct option opts[] = {{"model", required_argument, NULL, 'm'},
                                         {"file", required_argument, NULL, 'f'},
                                         {"special", no_argument, NULL, OPT_SPECIAL},
                                         {"pieces", no_argument, NULL, OPT_PIECES},
                                         {"bos", no_argument, NULL, OPT_BOS},
                                         {"chat", required_argument, NULL, OPT_CHAT},
                                         {"system", required_argument, NULL, OPT_SYSTEM},
                                         {"chat-template", required_argument, NULL, OPT_TEMPLATE},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *model = NULL, *file = NULL, *chat = NULL, *system = NULL, *template_name = NULL;
    bool special = false, pieces = false, bos = false;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":m:f:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'f': file = optarg; break;
        case OPT_SPECIAL: special = true; break;
        case OPT_PIECES: pieces = true; break;
        case OPT_BOS: bos = true; break;
        case OPT_CHAT: chat = optarg; break;
        case OPT_SYSTEM: system = optarg; break;
        case OPT_TEMPLATE: template_name = optarg; break;
        case 'h': usage(stdout); return 0;
        case ':':
            fprintf(stderr, "tandem tokenize: option '%s' needs a value\n", argv[optind - 1]);
            usage_hint();
            return 2;
        default:
            if (optopt)
                fprintf(stderr, "tandem tokenize: unknown option '-%c'\n", optopt);
            else
                fprintf(stderr, "tandem tokenize: unknown option '%s'\n", argv[optind - 1]);
            usage_hint();
            return 2;
        }
    }
    int n_text = argc - optind;
    const char *usage_error = NULL;
    if (n_text > 1)
        usage_error = "give the text as one argument (quote it)";
    else if ((n_text == 1) + (file != NULL) + (chat != NULL) > 1)
        usage_error = "give only one of TEXT, -f FILE and --chat MESSAGE";
    else if (n_text == 0 && !file && !chat)
        usage_error = "nothing to tokenize: give TEXT, -f FILE or --chat MESSAGE";
    else if (!chat && (system || template_name))
        usage_error = "--system and --chat-template only go with --chat";
    if (usage_error) {
        fprintf(stderr, "tandem tokenize: %s\n", usage_error);
        usage_hint();
        return 2;
    }
    tdm_chat_template_t named;
    if (template_name) {
        tdm_error_t name_err = {0};
        if (tdm_chat_template_from_name(template_name, &named, &name_err) != TDM_OK) {
            fprintf(stderr, "tandem tokenize: --chat-template: %s\n", name_err.msg);
            return 2;
        }
    }

    char default_model[1024];
    if (!model) {
        if (tdm_model_default_path(default_model, sizeof default_model) != TDM_OK) {
            fprintf(stderr, "tandem tokenize: no default model path (set HOME or TANDEM_MODEL, "
                            "or pass -m MODEL)\n");
            return 1;
        }
        model = default_model;
    }

    int status = 1;
    tdm_error_t err = {0};
    char *text = NULL;
    size_t len = 0;
    tdm_token_t *ids = NULL;
    size_t n_ids = 0;
    tdm_tokenizer_t *tok = NULL;
    tdm_gguf_t *g = tdm_gguf_open(model, &err);
    if (!g) {
        fprintf(stderr, "tandem tokenize: %s\n", err.msg);
        if (err.code == TDM_ENOTFOUND && model == default_model)
            fprintf(stderr, "tandem tokenize: run scripts/setup to download the default model, "
                            "or pass -m MODEL\n");
        return 1;
    }
    tok = tdm_tokenizer_new(g, &err);
    if (!tok) {
        fprintf(stderr, "tandem tokenize: %s: %s\n", model, err.msg);
        goto out_close_model;
    }
    if (bos && tdm_tokenizer_bos(tok) < 0) {
        fprintf(stderr, "tandem tokenize: --bos: %s has no BOS token\n", model);
        goto out_destroy_tokenizer;
    }

    if (chat) {
        if (encode_chat(g, tok, template_name ? &named : NULL, system, chat, &ids, &n_ids) != 0)
            goto out_destroy_tokenizer;
    } else {
        if (file && strcmp(file, "-") == 0) {
            if (read_stdin(&text, &len) != 0)
                goto out_destroy_tokenizer;
        } else if (file) {
            if (tdm_read_file(file, TOKENIZE_MAX_INPUT, &text, &len, &err) != TDM_OK) {
                fprintf(stderr, "tandem tokenize: %s\n", err.msg);
                goto out_destroy_tokenizer;
            }
        } else {
            text = tdm_strdup(argv[optind]);
            if (!text) {
                fprintf(stderr, "tandem tokenize: out of memory\n");
                goto out_destroy_tokenizer;
            }
            len = strlen(text);
        }
        /* TEXT and FILE are the tokenizer's view of plain text, not a prompt: no BOS and no
         * special tokens unless asked for (--bos, --special). */
        if (tdm_tokenizer_encode(tok, text, len, bos, special, &ids, &n_ids, &err) != TDM_OK) {
            fprintf(stderr, "tandem tokenize: %s\n", err.msg);
            goto out_free_text;
        }
    }
    tdm_token_t bos_id = tdm_tokenizer_bos(tok);
    bool prepend = chat && bos && (n_ids == 0 || ids[0] != bos_id);

    if (pieces) {
        char small[256];
        size_t n_print = n_ids + (prepend ? 1 : 0);
        for (size_t i = 0; i < n_print; i++) {
            tdm_token_t id = prepend ? (i == 0 ? bos_id : ids[i - 1]) : ids[i];
            int blen = tdm_tokenizer_token_bytes(tok, id, true, small, sizeof small);
            char *piece = small;
            if (blen < 0) {
                fprintf(stderr, "tandem tokenize: token %d: %s\n", (int)id, tdm_strerror(blen));
                goto out_free_ids;
            }
            if ((size_t)blen >= sizeof small) {
                piece = malloc((size_t)blen + 1);
                if (!piece) {
                    fprintf(stderr, "tandem tokenize: out of memory\n");
                    goto out_free_ids;
                }
                tdm_tokenizer_token_bytes(tok, id, true, piece, (size_t)blen + 1);
            }
            printf("%d\t", (int)id);
            print_quoted(piece, (size_t)blen);
            putchar('\n');
            if (piece != small)
                free(piece);
        }
    } else {
        if (prepend)
            printf("%d%s", (int)bos_id, n_ids ? " " : "");
        for (size_t i = 0; i < n_ids; i++)
            printf("%s%d", i ? " " : "", (int)ids[i]);
        putchar('\n');
    }
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "tandem tokenize: writing the output failed\n");
        goto out_free_ids;
    }
    status = 0;

out_free_ids:
    free(ids);
out_free_text:
    free(text);
out_destroy_tokenizer:
    tdm_tokenizer_destroy(&tok);
out_close_model:
    tdm_gguf_destroy(&g);
    return status;
}
