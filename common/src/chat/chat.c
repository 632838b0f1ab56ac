/* chat.c - the built-in chat templates (ChatML, Llama-3, Llama-2, Gemma) and their detection
 * from a model's tokenizer.chat_template (or, for Gemma files without one, its architecture).
 *
 * The renderings reproduce what Hugging Face's apply_chat_template makes of each family's
 * reference Jinja template (SmolLM2-Instruct's ChatML template, Meta-Llama-3-8B-Instruct's,
 * Llama-2-7b-chat-hf's, gemma-3-*-it's); tests/golden/smollm2_tokenizer.json and
 * gemma3_tokenizer.json hold renderings made by Jinja that tests/unit/test_tokenizer_smollm2.c
 * and test_chat.c compare byte for byte. Whitespace trimming follows
 * Python's str.strip(), which the templates' `| trim` and `.strip()` call.
 */
#include "tandem/chat.h"

#include "chat_tools.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The renderers append with tdm_buf_* and ignore the result: the buffer's oom flag is
 * sticky, so tdm_chat_apply checks once at the end. */
static void sb_append(tdm_buf_t *sb, const char *s, size_t n)
{
    (void)tdm_buf_append(sb, s, n);
}

static void sb_puts(tdm_buf_t *sb, const char *s)
{
    (void)tdm_buf_puts(sb, s);
}

/* Python's str.isspace(): the characters whose bidirectional type is WS, B or S or whose
 * category is Zs (Objects/unicodetype_db.h, _PyUnicode_IsWhitespace). */
static bool py_isspace(uint32_t cp)
{
    switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000: return true;
    default: return cp >= 0x2000 && cp <= 0x200A;
    }
}

/* Trims s[0..n) as Python's str.strip() with no argument does: sets *start and returns the
 * length of what is left. Invalid UTF-8 bytes are never whitespace. */
static size_t py_strip(const char *s, size_t n, size_t *start)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t b = 0, e = n;
    uint32_t cp;
    while (b < e) {
        size_t len = tdm_utf8_decode(u + b, e - b, &cp);
        if (len == 0 || !py_isspace(cp))
            break;
        b += len;
    }
    while (e > b) {
        /* step back to the first byte of the last character (at most 4 bytes back) */
        size_t k = e - 1;
        while (k > b && e - k < 4 && (u[k] & 0xC0) == 0x80)
            k--;
        size_t len = tdm_utf8_decode(u + k, e - k, &cp);
        if (len != e - k || !py_isspace(cp))
            break;
        e = k;
    }
    *start = b;
    return e - b;
}

static void sb_append_stripped(tdm_buf_t *sb, const char *s, size_t n)
{
    size_t start;
    size_t len = py_strip(s, n, &start);
    sb_append(sb, s + start, len);
}

const char *tdm_chat_template_name(tdm_chat_template_t t)
{
    switch (t) {
    case TDM_CHAT_TEMPLATE_CHATML: return "chatml";
    case TDM_CHAT_TEMPLATE_LLAMA3: return "llama3";
    case TDM_CHAT_TEMPLATE_LLAMA2: return "llama2";
    case TDM_CHAT_TEMPLATE_GEMMA: return "gemma";
    }
    return "?";
}

int tdm_chat_template_from_name(const char *name, tdm_chat_template_t *out, tdm_error_t *err)
{
    static const tdm_chat_template_t all[] = {TDM_CHAT_TEMPLATE_CHATML, TDM_CHAT_TEMPLATE_LLAMA3,
                                              TDM_CHAT_TEMPLATE_LLAMA2, TDM_CHAT_TEMPLATE_GEMMA};
    if (!name)
        return tdm_error_set(err, TDM_EINVALID,
                             "no chat template name given (expected " TDM_CHAT_TEMPLATE_NAMES ")");
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (strcmp(name, tdm_chat_template_name(all[i])) == 0) {
            *out = all[i];
            return TDM_OK;
        }
    }
    return tdm_error_set(err, TDM_EINVALID,
                         "unknown chat template '%.64s' (expected " TDM_CHAT_TEMPLATE_NAMES ")",
                         name);
}

bool tdm_chat_template_writes_bos(tdm_chat_template_t t)
{
    return t == TDM_CHAT_TEMPLATE_LLAMA3 || t == TDM_CHAT_TEMPLATE_LLAMA2 ||
           t == TDM_CHAT_TEMPLATE_GEMMA;
}

/* ---- detection ---- */

static const char *find_bytes(const char *hay, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    if (m == 0 || m > n)
        return m == 0 ? hay : NULL;
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, m) == 0)
            return hay + i;
    return NULL;
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Appends code point cp as UTF-8 (cp <= 0x10FFFF). */
static void sb_append_utf8(tdm_buf_t *sb, uint32_t cp)
{
    char b[4];
    size_t n;
    if (cp < 0x80) {
        b[0] = (char)cp, n = 1;
    } else if (cp < 0x800) {
        b[0] = (char)(0xC0 | (cp >> 6)), b[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
    } else if (cp < 0x10000) {
        b[0] = (char)(0xE0 | (cp >> 12)), b[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
    } else {
        b[0] = (char)(0xF0 | (cp >> 18)), b[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        b[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), b[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
    }
    sb_append(sb, b, n);
}

/* Decodes the Jinja string literal text s[0..n) (between its quotes) into sb, with the escapes
 * Jinja's lexer accepts (Python's unicode-escape) and its newline normalisation (\r\n and \r
 * become \n). An escape this code does not know is copied as is. */
static void unescape_literal(tdm_buf_t *sb, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '\r') {
            if (i + 1 < n && s[i + 1] == '\n')
                i++;
            sb_append(sb, "\n", 1);
            continue;
        }
        if (c != '\\' || i + 1 >= n) {
            sb_append(sb, &c, 1);
            continue;
        }
        char e = s[++i];
        const char *simple = NULL;
        switch (e) {
        case 'n': simple = "\n"; break;
        case 't': simple = "\t"; break;
        case 'r': simple = "\r"; break;
        case '\\': simple = "\\"; break;
        case '\'': simple = "'"; break;
        case '"': simple = "\""; break;
        default: break;
        }
        if (simple) {
            sb_append(sb, simple, 1);
            continue;
        }
        size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        uint32_t cp = 0;
        bool good = digits > 0 && i + digits < n;
        for (size_t k = 1; good && k <= digits; k++) {
            int d = hex_digit(s[i + k]);
            if (d < 0)
                good = false;
            else
                cp = cp * 16 + (uint32_t)d;
        }
        if (good && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF)) {
            sb_append_utf8(sb, cp);
            i += digits;
        } else {
            sb_append(sb, s + i - 1, 2);
        }
    }
}

/* Finds ChatML's default system message: a string literal of the template whose text is
 * "<|im_start|>system" NEWLINE TEXT "<|im_end|>" (NEWLINE a real newline or the escape \n).
 * Literals that end before <|im_end|> (like '<|im_start|>system\n' + messages[0]['content'])
 * are not defaults. Appends TEXT, decoded, to sb; appends nothing when there is none. */
static void find_chatml_default(const char *tpl, size_t n, tdm_buf_t *sb)
{
    static const char marker[] = "<|im_start|>system";
    const char *end = tpl + n;
    const char *p = tpl;
    while ((p = find_bytes(p, (size_t)(end - p), marker)) != NULL) {
        const char *q = p + sizeof marker - 1;
        p = q;
        /* the quote that opens the literal: the nearest quote before the marker */
        const char *open = q - (sizeof marker - 1);
        while (open > tpl && open[-1] != '\'' && open[-1] != '"')
            open--;
        if (open == tpl)
            continue;
        char quote = open[-1];
        if (q < end && *q == '\n')
            q++;
        else if (end - q >= 2 && q[0] == '\\' && q[1] == 'n')
            q += 2;
        else
            continue;
        const char *text = q;
        while (q < end && *q != quote) {
            if (*q == '<' && (size_t)(end - q) >= 10 && memcmp(q, "<|im_end|>", 10) == 0)
                break;
            q += (*q == '\\' && q + 1 < end) ? 2 : 1;
        }
        if (q >= end || *q == quote)
            continue;
        unescape_literal(sb, text, (size_t)(q - text));
        return;
    }
}

/* Whether g's general.architecture is a Gemma one (gemma, gemma2, gemma3): llama.cpp's
 * converter writes no chat template for some of them (gemma-3-270m), whose prompts are then
 * Gemma's turn format all the same. */
static bool gemma_architecture(const tdm_gguf_t *g)
{
    static const char *const names[] = {"gemma", "gemma2", "gemma3"};
    tdm_gguf_str_t a;
    if (tdm_gguf_get_str(g, "general.architecture", &a, NULL) != TDM_OK)
        return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((size_t)a.len == strlen(names[i]) && memcmp(a.data, names[i], (size_t)a.len) == 0)
            return true;
    return false;
}

/* The family of template text tpl[0..n) by its markers; false when none matches. */
static bool family_of(const char *tpl, size_t n, tdm_chat_template_t *t)
{
    if (find_bytes(tpl, n, "<|im_start|>"))
        *t = TDM_CHAT_TEMPLATE_CHATML;
    else if (find_bytes(tpl, n, "<|start_header_id|>"))
        *t = TDM_CHAT_TEMPLATE_LLAMA3;
    else if (find_bytes(tpl, n, "[INST]") && find_bytes(tpl, n, "<<SYS>>"))
        *t = TDM_CHAT_TEMPLATE_LLAMA2;
    else if (find_bytes(tpl, n, "<start_of_turn>"))
        *t = TDM_CHAT_TEMPLATE_GEMMA;
    else
        return false;
    return true;
}

int tdm_chat_template_detect(const tdm_gguf_t *g, tdm_chat_template_t *out, char *default_system,
                             size_t cap, tdm_error_t *err)
{
    static const char hint[] =
        "set model.chat_template: " TDM_CHAT_TEMPLATE_NAMES_BAR
        " in the config or pass --chat-template " TDM_CHAT_TEMPLATE_NAMES_BAR;
    tdm_gguf_str_t s;
    tdm_error_t kv_err = {0};
    int rc = tdm_gguf_get_str(g, "tokenizer.chat_template", &s, &kv_err);
    if (rc == TDM_ENOTFOUND && gemma_architecture(g)) {
        *out = TDM_CHAT_TEMPLATE_GEMMA;
        if (default_system && cap > 0)
            default_system[0] = '\0';
        return TDM_OK;
    }
    if (rc == TDM_ENOTFOUND)
        return tdm_error_set(err, TDM_EINVALID, "the model has no tokenizer.chat_template: %s",
                             hint);
    if (rc != TDM_OK)
        return tdm_error_set(err, TDM_EINVALID, "%s: %s", kv_err.msg, hint);
    if (s.len > SIZE_MAX / 2)
        return tdm_error_set(err, TDM_EINVALID, "tokenizer.chat_template is too long: %s", hint);
    const char *tpl = s.data;
    size_t n = (size_t)s.len;

    tdm_chat_template_t t;
    if (!family_of(tpl, n, &t))
        return tdm_error_set(err, TDM_EINVALID,
                             "the model's tokenizer.chat_template (%zu bytes, starting \"%.*s\") "
                             "is not one of the built-in chat templates (ChatML, Llama-3, "
                             "Llama-2, Gemma): %s",
                             n, (int)(n < 40 ? n : 40), tpl, hint);

    if (default_system && cap > 0) {
        tdm_buf_t sb = TDM_BUF_INIT;
        if (t == TDM_CHAT_TEMPLATE_CHATML)
            find_chatml_default(tpl, n, &sb);
        if (sb.oom) {
            tdm_buf_free(&sb);
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory reading the chat template");
        }
        if (sb.len + 1 > cap) {
            tdm_buf_free(&sb);
            return tdm_error_set(err, TDM_ERESOURCE,
                                 "the chat template's default system message (%zu bytes) does "
                                 "not fit in %zu bytes",
                                 sb.len, cap);
        }
        if (sb.len)
            memcpy(default_system, sb.data, sb.len);
        default_system[sb.len] = '\0';
        tdm_buf_free(&sb);
    }
    *out = t;
    return TDM_OK;
}

/* ---- rendering ---- */

typedef enum role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL } role_t;

static bool has_text(const char *s)
{
    return s && s[0];
}

/* What rendering needs besides the messages: each message's role, the tool calls of the
 * assistant messages rendered (calls[i], NULL when none) and the system message's text with
 * the tools block (system, NULL without tools). */
typedef struct prepared {
    role_t *roles;
    char **calls;
    char *system;
} prepared_t;

static int role_of(const tdm_chat_message_t *m, size_t i, role_t *out, tdm_error_t *err)
{
    static const char *const names[] = {"system", "user", "assistant", "tool"};
    if (!m->role)
        return tdm_error_set(err, TDM_EINVALID, "message %zu has no role", i);
    bool known = false;
    for (size_t k = 0; k < sizeof names / sizeof names[0] && !known; k++)
        if (strcmp(m->role, names[k]) == 0) {
            *out = (role_t)k;
            known = true;
        }
    if (!known)
        return tdm_error_set(err, TDM_EINVALID,
                             "message %zu has role '%.32s'; expected system, user, assistant or "
                             "tool",
                             i, m->role);
    if (!m->content && !(*out == ROLE_ASSISTANT && has_text(m->tool_calls)))
        return tdm_error_set(err, TDM_EINVALID, "message %zu (role '%.32s') has no content", i,
                             m->role);
    if (*out == ROLE_SYSTEM && i > 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "message %zu has role 'system'; a system message may only be "
                             "the first message",
                             i);
    if (has_text(m->tool_calls) && *out != ROLE_ASSISTANT)
        return tdm_error_set(err, TDM_EINVALID,
                             "message %zu has role '%s'; only assistant messages have tool_calls",
                             i, m->role);
    return TDM_OK;
}

/* Gemma: after an optional system message, user turns and assistant turns alternate, user
 * first (Gemma's templates raise an exception otherwise); a run of tool messages is one user
 * turn, as it is rendered. */
static int check_gemma_turns(const tdm_chat_message_t *msgs, size_t n, const role_t *roles,
                             tdm_error_t *err)
{
    size_t turn = 0;
    for (size_t i = n > 0 && roles[0] == ROLE_SYSTEM ? 1 : 0; i < n; i++, turn++) {
        bool user = roles[i] != ROLE_ASSISTANT;
        if (user != (turn % 2 == 0))
            return tdm_error_set(err, TDM_EINVALID,
                                 "message %zu has role '%s'; the gemma chat template needs user "
                                 "and assistant messages to alternate, starting with user (a run "
                                 "of tool messages counts as one user turn)",
                                 i, msgs[i].role);
        while (roles[i] == ROLE_TOOL && i + 1 < n && roles[i + 1] == ROLE_TOOL)
            i++;
    }
    return TDM_OK;
}

/* Checks the messages and fills roles[n]. */
static int check_messages(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                          role_t *roles, tdm_error_t *err)
{
    for (size_t i = 0; i < n; i++) {
        int rc = role_of(&msgs[i], i, &roles[i], err);
        if (rc != TDM_OK)
            return rc;
        if (t == TDM_CHAT_TEMPLATE_LLAMA2 &&
            (roles[i] == ROLE_TOOL || has_text(msgs[i].tool_calls)))
            return tdm_error_set(err, TDM_EINVALID,
                                 "message %zu: the llama2 chat template has no tool calling "
                                 "(role 'tool', tool_calls)",
                                 i);
    }
    if (t == TDM_CHAT_TEMPLATE_GEMMA)
        return check_gemma_turns(msgs, n, roles, err);
    if (t == TDM_CHAT_TEMPLATE_LLAMA2) {
        size_t first = n > 0 && roles[0] == ROLE_SYSTEM ? 1 : 0;
        for (size_t i = first; i < n; i++) {
            role_t want = (i - first) % 2 == 0 ? ROLE_USER : ROLE_ASSISTANT;
            if (roles[i] != want)
                return tdm_error_set(err, TDM_EINVALID,
                                     "message %zu has role '%s'; the llama2 chat template needs "
                                     "user and assistant messages to alternate, starting with "
                                     "user",
                                     i, msgs[i].role);
        }
    }
    return TDM_OK;
}

/* The content of message m; "" for a NULL one (an assistant message with only tool calls). */
static const char *content_of(const tdm_chat_message_t *m)
{
    return m->content ? m->content : "";
}

/* Renders the tool calls of the assistant messages and, with tools, the system text. */
static int prepare_tools(const tdm_chat_message_t *msgs, size_t n, const char *tools,
                         const char *default_system, prepared_t *pp, tdm_error_t *err)
{
    for (size_t i = 0; i < n; i++) {
        if (!has_text(msgs[i].tool_calls))
            continue;
        tdm_buf_t b = TDM_BUF_INIT;
        int rc = chat_tool_calls_text(msgs[i].tool_calls, i, &b, err);
        pp->calls[i] = tdm_buf_take(&b);
        if (rc != TDM_OK)
            return rc;
        if (!pp->calls[i])
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering tool calls");
    }
    if (!has_text(tools))
        return TDM_OK;
    const char *sys = n > 0 && pp->roles[0] == ROLE_SYSTEM ? content_of(&msgs[0]) : default_system;
    tdm_buf_t b = TDM_BUF_INIT;
    if (has_text(sys)) {
        sb_puts(&b, sys);
        sb_puts(&b, "\n\n");
    }
    int rc = chat_tools_block(tools, &b, err);
    pp->system = tdm_buf_take(&b);
    if (rc == TDM_OK && !pp->system)
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering the tools");
    return rc;
}

/* The text of a run of tool messages msgs[i..] (one user turn); returns the index after it. */
static size_t tool_responses(tdm_buf_t *sb, const tdm_chat_message_t *msgs, size_t n, size_t i,
                             const role_t *roles)
{
    for (; i < n && roles[i] == ROLE_TOOL; i++) {
        sb_puts(sb, "\n<tool_response>\n");
        sb_puts(sb, content_of(&msgs[i]));
        sb_puts(sb, "\n</tool_response>");
    }
    return i;
}

/* The first message the loop renders: after the system message when it was rendered with the
 * tools already. */
static size_t first_turn(size_t n, const prepared_t *pp)
{
    return pp->system && n > 0 && pp->roles[0] == ROLE_SYSTEM ? 1 : 0;
}

static void render_chatml(tdm_buf_t *sb, const tdm_chat_message_t *msgs, size_t n,
                          bool add_generation_prompt, const char *default_system,
                          const prepared_t *pp)
{
    if (pp->system) {
        sb_puts(sb, "<|im_start|>system\n");
        sb_puts(sb, pp->system);
        sb_puts(sb, "<|im_end|>\n");
    } else if (n > 0 && pp->roles[0] != ROLE_SYSTEM && default_system && default_system[0]) {
        sb_puts(sb, "<|im_start|>system\n");
        sb_puts(sb, default_system);
        sb_puts(sb, "<|im_end|>\n");
    }
    for (size_t i = first_turn(n, pp); i < n;) {
        if (pp->roles[i] == ROLE_TOOL) {
            sb_puts(sb, "<|im_start|>user");
            i = tool_responses(sb, msgs, n, i, pp->roles);
            sb_puts(sb, "<|im_end|>\n");
            continue;
        }
        sb_puts(sb, "<|im_start|>");
        sb_puts(sb, msgs[i].role);
        if (pp->calls[i]) {
            /* Qwen2.5: "\n" + content only when there is content, then the calls */
            if (has_text(msgs[i].content))
                sb_puts(sb, "\n");
            sb_puts(sb, content_of(&msgs[i]));
            sb_puts(sb, pp->calls[i]);
        } else {
            sb_puts(sb, "\n");
            sb_puts(sb, msgs[i].content);
        }
        sb_puts(sb, "<|im_end|>\n");
        i++;
    }
    if (add_generation_prompt)
        sb_puts(sb, "<|im_start|>assistant\n");
}

static void llama3_message(tdm_buf_t *sb, const char *role, const char *content)
{
    sb_puts(sb, "<|start_header_id|>");
    sb_puts(sb, role);
    sb_puts(sb, "<|end_header_id|>\n\n");
    sb_append_stripped(sb, content, strlen(content));
    sb_puts(sb, "<|eot_id|>");
}

/* A Llama-3 turn whose content is built first (tool calls, tool responses), then trimmed. */
static void llama3_built(tdm_buf_t *sb, const char *role, tdm_buf_t *turn)
{
    if (turn->oom)
        sb->oom = true;
    else
        llama3_message(sb, role, turn->data ? turn->data : "");
    tdm_buf_free(turn);
}

static void render_llama3(tdm_buf_t *sb, const tdm_chat_message_t *msgs, size_t n,
                          bool add_generation_prompt, const char *default_system,
                          const prepared_t *pp)
{
    if (n > 0)
        sb_puts(sb, "<|begin_of_text|>");
    if (pp->system)
        llama3_message(sb, "system", pp->system);
    else if (n > 0 && pp->roles[0] != ROLE_SYSTEM && default_system && default_system[0])
        llama3_message(sb, "system", default_system);
    for (size_t i = first_turn(n, pp); i < n;) {
        tdm_buf_t turn = TDM_BUF_INIT;
        if (pp->roles[i] == ROLE_TOOL) {
            i = tool_responses(&turn, msgs, n, i, pp->roles);
            llama3_built(sb, "user", &turn);
            continue;
        }
        if (pp->calls[i]) {
            sb_puts(&turn, content_of(&msgs[i]));
            sb_puts(&turn, pp->calls[i]);
            llama3_built(sb, msgs[i].role, &turn);
        } else {
            llama3_message(sb, msgs[i].role, msgs[i].content);
        }
        i++;
    }
    if (add_generation_prompt)
        sb_puts(sb, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void render_llama2(tdm_buf_t *sb, const tdm_chat_message_t *msgs, size_t n,
                          const char *default_system, const role_t *roles)
{
    const char *system = NULL;
    size_t first = 0;
    if (n > 0 && roles[0] == ROLE_SYSTEM) {
        system = msgs[0].content;
        first = 1;
    } else if (default_system && default_system[0]) {
        system = default_system;
    }
    for (size_t i = first; i < n; i++) {
        if (roles[i] == ROLE_ASSISTANT) {
            sb_puts(sb, " ");
            sb_append_stripped(sb, msgs[i].content, strlen(msgs[i].content));
            sb_puts(sb, " </s>");
            continue;
        }
        sb_puts(sb, "<s>[INST] ");
        if (i == first && system) {
            /* the template strips "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content as one
             * string: only the content's end (or, for empty content, the "\n\n") is trimmed */
            tdm_buf_t turn = TDM_BUF_INIT;
            sb_puts(&turn, "<<SYS>>\n");
            sb_puts(&turn, system);
            sb_puts(&turn, "\n<</SYS>>\n\n");
            sb_puts(&turn, msgs[i].content);
            if (!turn.oom)
                sb_append_stripped(sb, turn.data, turn.len);
            else
                sb->oom = true;
            tdm_buf_free(&turn);
        } else {
            sb_append_stripped(sb, msgs[i].content, strlen(msgs[i].content));
        }
        sb_puts(sb, " [/INST]");
    }
}

/* One Gemma turn: "<start_of_turn>ROLE\n" + prefix + trim(content) + "<end_of_turn>\n". */
static void gemma_turn(tdm_buf_t *sb, const char *role, const char *prefix, const char *content,
                       size_t len)
{
    sb_puts(sb, "<start_of_turn>");
    sb_puts(sb, role);
    sb_puts(sb, "\n");
    if (prefix) {
        sb_puts(sb, prefix);
        sb_puts(sb, "\n\n");
    }
    sb_append_stripped(sb, content, len);
    sb_puts(sb, "<end_of_turn>\n");
}

/* Gemma 3 (gemma-3-*-it's template): "<bos>" always, then a turn per message with the
 * assistant's role written "model"; there is no system turn: the system message (untrimmed,
 * then "\n\n") opens the first turn's text. Tools as for Llama-3: the Hermes block in the
 * system text, tool calls in the model turn, a run of tool results as one user turn. */
static void render_gemma(tdm_buf_t *sb, const tdm_chat_message_t *msgs, size_t n,
                         bool add_generation_prompt, const char *default_system,
                         const prepared_t *pp)
{
    const char *system = has_text(default_system) ? default_system : NULL;
    size_t i = 0;
    if (n > 0 && pp->roles[0] == ROLE_SYSTEM) {
        system = msgs[0].content;
        i = 1;
    }
    if (pp->system)
        system = pp->system;
    sb_puts(sb, "<bos>");
    for (; i < n; system = NULL) {
        tdm_buf_t turn = TDM_BUF_INIT;
        const char *role = pp->roles[i] == ROLE_ASSISTANT ? "model" : "user";
        if (pp->roles[i] == ROLE_TOOL) {
            i = tool_responses(&turn, msgs, n, i, pp->roles);
        } else {
            sb_puts(&turn, content_of(&msgs[i]));
            if (pp->calls[i])
                sb_puts(&turn, pp->calls[i]);
            i++;
        }
        if (turn.oom)
            sb->oom = true;
        else
            gemma_turn(sb, role, system, turn.data ? turn.data : "", turn.len);
        tdm_buf_free(&turn);
    }
    if (add_generation_prompt)
        sb_puts(sb, "<start_of_turn>model\n");
}

int tdm_chat_apply(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                   bool add_generation_prompt, const char *default_system, char **out,
                   size_t *out_len, tdm_error_t *err)
{
    return tdm_chat_apply_tools(t, msgs, n, NULL, add_generation_prompt, default_system, out,
                                out_len, err);
}

/* Checks the messages and renders what tools need into *pp (freed by prepared_free). */
static int prepare(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                   const char *tools, const char *default_system, prepared_t *pp, tdm_error_t *err)
{
    if (n > 0) {
        pp->roles = calloc(n, sizeof *pp->roles);
        pp->calls = calloc(n, sizeof *pp->calls);
        if (!pp->roles || !pp->calls)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory for %zu chat messages", n);
    }
    int rc = check_messages(t, msgs, n, pp->roles, err);
    if (rc != TDM_OK)
        return rc;
    if (t == TDM_CHAT_TEMPLATE_LLAMA2 && has_text(tools))
        return tdm_error_set(err, TDM_EINVALID,
                             "tools: the llama2 chat template has no tool calling");
    return prepare_tools(msgs, n, tools, default_system, pp, err);
}

static void prepared_free(prepared_t *pp, size_t n)
{
    for (size_t i = 0; pp->calls && i < n; i++)
        free(pp->calls[i]);
    free(pp->calls);
    free(pp->roles);
    free(pp->system);
}

int tdm_chat_apply_tools(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                         const char *tools, bool add_generation_prompt, const char *default_system,
                         char **out, size_t *out_len, tdm_error_t *err)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (t != TDM_CHAT_TEMPLATE_CHATML && t != TDM_CHAT_TEMPLATE_LLAMA3 &&
        t != TDM_CHAT_TEMPLATE_LLAMA2 && t != TDM_CHAT_TEMPLATE_GEMMA)
        return tdm_error_set(err, TDM_EINVALID, "unknown chat template %d", (int)t);
    if (n > 0 && !msgs)
        return tdm_error_set(err, TDM_EINVALID, "%zu messages but no message array", n);

    prepared_t pp = {NULL, NULL, NULL};
    tdm_buf_t sb = TDM_BUF_INIT;
    int rc = prepare(t, msgs, n, tools, default_system, &pp, err);
    if (rc != TDM_OK)
        goto out_free_prepared;

    switch (t) {
    case TDM_CHAT_TEMPLATE_CHATML:
        render_chatml(&sb, msgs, n, add_generation_prompt, default_system, &pp);
        break;
    case TDM_CHAT_TEMPLATE_LLAMA3:
        render_llama3(&sb, msgs, n, add_generation_prompt, default_system, &pp);
        break;
    case TDM_CHAT_TEMPLATE_LLAMA2: render_llama2(&sb, msgs, n, default_system, pp.roles); break;
    case TDM_CHAT_TEMPLATE_GEMMA:
        render_gemma(&sb, msgs, n, add_generation_prompt, default_system, &pp);
        break;
    }
    size_t len = sb.len;
    *out = tdm_buf_take(&sb); /* "" (allocated) for an empty rendering */
    if (!*out) {
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering %zu chat messages", n);
        goto out_free_prepared;
    }
    if (out_len)
        *out_len = len;

out_free_prepared:
    prepared_free(&pp, n);
    return rc;
}
