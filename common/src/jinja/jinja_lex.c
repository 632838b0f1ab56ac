/* jinja_lex.c - cuts Jinja source into tokens, as jinja2's lexer does (trim_blocks,
 * lstrip_blocks, "-" and "+" whitespace control, raw blocks, comments). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_lex.h"

typedef struct lexer {
    jj_lex_t *lx;
    const char *src;
    size_t len, pos;
    const tdm_jinja_options_t *opt;
    bool line_starting; /* the last tag's end consumed a newline (or at the start) */
    size_t w_off;       /* the last token's offset and its line and column (w_line 0: none) */
    int w_line, w_col;
} lexer_t;

/* Line and column (1-based) of offset off. */
static void where(const char *src, size_t off, int *line, int *col)
{
    int l = 1, c = 1;
    for (size_t i = 0; i < off; i++) {
        if (src[i] == '\n') {
            l++;
            c = 1;
        } else {
            c++;
        }
    }
    *line = l;
    *col = c;
}

static int lex_fail(lexer_t *L, size_t off, const char *what)
{
    int line, col;
    where(L->src, off, &line, &col);
    return tdm_error_set(L->lx->err, TDM_EINVALID, "%d:%d: %s", line, col, what);
}

static jj_token_t *push(lexer_t *L, jj_tok_kind_t kind, size_t off)
{
    jj_lex_t *lx = L->lx;
    if (lx->n == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        jj_token_t *t = realloc(lx->toks, cap * sizeof *t);
        if (!t)
            return NULL;
        lx->toks = t;
        lx->cap = cap;
    }
    jj_token_t *t = &lx->toks[lx->n++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    t->off = off;
    /* Line and column counted on from the last token's (tokens come in source order), so the
     * parser's nodes and errors need no scan from the start each (quadratic in the template). */
    if (L->w_line == 0 || off < L->w_off) {
        L->w_off = 0;
        L->w_line = 1;
        L->w_col = 1;
    }
    for (size_t i = L->w_off; i < off; i++) {
        if (L->src[i] == '\n') {
            L->w_line++;
            L->w_col = 1;
        } else {
            L->w_col++;
        }
    }
    L->w_off = off;
    t->line = L->w_line;
    t->col = L->w_col;
    return t;
}

static int push_text(lexer_t *L, size_t off, size_t n)
{
    if (n == 0)
        return 0;
    jj_token_t *t = push(L, JT_TEXT, off);
    if (!t)
        return tdm_error_set(L->lx->err, TDM_ERESOURCE, "out of memory");
    t->s = L->src + off;
    t->n = n;
    return 0;
}

static bool is_ws(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v';
}

/* The text before a tag at L->src[start, end), stripped as the tag's sign asks. */
static size_t strip_text(lexer_t *L, size_t start, size_t end, char sign, bool block)
{
    const char *s = L->src;
    if (sign == '-') {
        while (end > start && is_ws(s[end - 1]))
            end--;
        return end;
    }
    if (sign == '+' || !block || !L->opt->lstrip_blocks)
        return end;
    size_t l = end;
    while (l > start && s[l - 1] != '\n')
        l--;
    if (l == start && !L->line_starting)
        return end;
    for (size_t i = l; i < end; i++)
        if (s[i] != ' ' && s[i] != '\t')
            return end;
    return l;
}

/* After a tag's end at L->pos: "-" strips all whitespace, trim_blocks one newline. */
static void after_tag_end(lexer_t *L, bool minus, bool block)
{
    size_t p = L->pos;
    if (minus) {
        while (p < L->len && is_ws(L->src[p]))
            p++;
    } else if (block && L->opt->trim_blocks && p < L->len && L->src[p] == '\n') {
        p++;
    }
    L->line_starting = p > 0 && L->src[p - 1] == '\n';
    L->pos = p;
}

/* Finds the next tag start at or after from; returns its offset or len. */
static size_t next_tag(const lexer_t *L, size_t from)
{
    for (size_t i = from; i + 1 < L->len; i++)
        if (L->src[i] == '{' &&
            (L->src[i + 1] == '{' || L->src[i + 1] == '%' || L->src[i + 1] == '#'))
            return i;
    return L->len;
}

static int lex_comment(lexer_t *L, size_t at)
{
    const char *end = NULL;
    for (size_t i = at + 2; i + 1 < L->len; i++)
        if (L->src[i] == '#' && L->src[i + 1] == '}') {
            end = L->src + i;
            break;
        }
    if (!end)
        return lex_fail(L, at, "Missing end of comment tag");
    size_t e = (size_t)(end - L->src);
    bool minus = e > at + 2 && L->src[e - 1] == '-';
    L->pos = e + 2;
    after_tag_end(L, minus, true);
    return 0;
}

/* {% raw %} at at whose tag ends at L->pos: text up to {% endraw %}. */
static int lex_raw(lexer_t *L, size_t at)
{
    for (size_t i = L->pos; i + 1 < L->len; i++) {
        if (L->src[i] != '{' || L->src[i + 1] != '%')
            continue;
        size_t j = i + 2;
        char sign = 0;
        if (j < L->len && (L->src[j] == '-' || L->src[j] == '+'))
            sign = L->src[j++];
        while (j < L->len && is_ws(L->src[j]))
            j++;
        if (L->len - j < 6 || memcmp(L->src + j, "endraw", 6) != 0)
            continue;
        j += 6;
        while (j < L->len && is_ws(L->src[j]))
            j++;
        bool minus = j < L->len && L->src[j] == '-';
        if (minus)
            j++;
        if (j + 1 >= L->len || L->src[j] != '%' || L->src[j + 1] != '}')
            continue;
        size_t tend = strip_text(L, L->pos, i, sign, true); /* lstrip_blocks applies */
        int rc = push_text(L, L->pos, tend - L->pos);
        L->pos = j + 2;
        after_tag_end(L, minus, true);
        return rc;
    }
    return lex_fail(L, at, "Missing end of raw directive");
}

/* True when the block tag starting at L->pos (after "{%" and its sign) is "raw %}". */
static bool is_raw(lexer_t *L, size_t *end, bool *minus)
{
    size_t j = L->pos;
    while (j < L->len && is_ws(L->src[j]))
        j++;
    if (L->len - j < 3 || memcmp(L->src + j, "raw", 3) != 0)
        return false;
    j += 3;
    while (j < L->len && is_ws(L->src[j]))
        j++;
    *minus = j < L->len && L->src[j] == '-';
    if (*minus)
        j++;
    if (j + 1 >= L->len || L->src[j] != '%' || L->src[j + 1] != '}')
        return false;
    *end = j + 2;
    return true;
}

static const char *const OPS[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                  "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                  "]",  "{",  "}",  ",",  ".",  ":",  "|", NULL};

static int lex_string(lexer_t *L, jj_token_t *t)
{
    char q = L->src[L->pos];
    size_t i = L->pos + 1;
    while (i < L->len && L->src[i] != q) {
        if (L->src[i] == '\\')
            i++;
        i++;
    }
    if (i >= L->len)
        return lex_fail(L, L->pos, "unexpected end of string");
    t->kind = JT_STRING;
    t->s = L->src + L->pos + 1;
    t->n = i - L->pos - 1;
    L->pos = i + 1;
    return 0;
}

static void lex_number(lexer_t *L, jj_token_t *t)
{
    size_t i = L->pos;
    while (i < L->len && (isdigit((unsigned char)L->src[i]) || L->src[i] == '_'))
        i++;
    bool is_float = false;
    if (i + 1 < L->len && L->src[i] == '.' && isdigit((unsigned char)L->src[i + 1])) {
        is_float = true;
        i++;
        while (i < L->len && (isdigit((unsigned char)L->src[i]) || L->src[i] == '_'))
            i++;
    }
    if (i < L->len && (L->src[i] == 'e' || L->src[i] == 'E')) {
        size_t j = i + 1;
        if (j < L->len && (L->src[j] == '+' || L->src[j] == '-'))
            j++;
        if (j < L->len && isdigit((unsigned char)L->src[j])) {
            is_float = true;
            i = j;
            while (i < L->len && isdigit((unsigned char)L->src[i]))
                i++;
        }
    }
    t->kind = is_float ? JT_FLOAT : JT_INT;
    t->s = L->src + L->pos;
    t->n = i - L->pos;
    L->pos = i;
}

/* One token inside a tag at L->pos (whitespace skipped already). */
static int lex_one(lexer_t *L, jj_token_t *t)
{
    char ch = L->src[L->pos];
    if (ch == '"' || ch == '\'')
        return lex_string(L, t);
    if (isdigit((unsigned char)ch)) {
        lex_number(L, t);
        return 0;
    }
    if (isalpha((unsigned char)ch) || ch == '_') {
        size_t i = L->pos;
        while (i < L->len && (isalnum((unsigned char)L->src[i]) || L->src[i] == '_'))
            i++;
        t->kind = JT_NAME;
        t->s = L->src + L->pos;
        t->n = i - L->pos;
        L->pos = i;
        return 0;
    }
    for (int k = 0; OPS[k]; k++) {
        size_t n = strlen(OPS[k]);
        if (L->len - L->pos >= n && memcmp(L->src + L->pos, OPS[k], n) == 0) {
            t->kind = JT_OP;
            t->s = OPS[k];
            t->n = n;
            L->pos += n;
            return 0;
        }
    }
    char msg[64];
    snprintf(msg, sizeof msg, "unexpected char '%c'", ch);
    return lex_fail(L, L->pos, msg);
}

/* True when a tag end (of a block when block, else of a variable) is at L->pos. */
static bool at_end(const lexer_t *L, bool block, bool *minus)
{
    const char *end = block ? "%}" : "}}";
    size_t p = L->pos;
    *minus = false;
    if (p < L->len && L->src[p] == '-' && p + 2 < L->len + 0 &&
        memcmp(L->src + p + 1, end, 2) == 0) {
        *minus = true;
        return true;
    }
    return L->len - p >= 2 && memcmp(L->src + p, end, 2) == 0;
}

/* Brackets open at once in one tag: the parser refuses 200 levels anyway. */
#define JJ_MAX_BRACKETS 512

/* The tokens of a tag from L->pos to its end, then the end token. Brackets must balance within
 * the tag, with jinja2's lexer's messages ("unexpected ')', expected ']'"). */
static int lex_tag(lexer_t *L, size_t at, bool block)
{
    (void)at;
    char want[JJ_MAX_BRACKETS]; /* the closing bracket each open one expects */
    int depth = 0;
    char msg[64];
    for (;;) {
        while (L->pos < L->len && is_ws(L->src[L->pos]))
            L->pos++;
        if (L->pos >= L->len) {
            if (depth)
                snprintf(msg, sizeof msg, "unexpected end of template, expected '%c'.",
                         want[depth - 1]);
            else
                snprintf(msg, sizeof msg, "unexpected end of template, expected '%s'.",
                         block ? "end of statement block" : "end of print statement");
            return lex_fail(L, L->len, msg);
        }
        bool minus;
        if (depth == 0 && at_end(L, block, &minus)) {
            if (!push(L, block ? JT_BLOCK_END : JT_VAR_END, L->pos))
                return tdm_error_set(L->lx->err, TDM_ERESOURCE, "out of memory");
            L->pos += minus ? 3 : 2;
            after_tag_end(L, minus, block);
            return 0;
        }
        size_t start = L->pos;
        jj_token_t *t = push(L, JT_OP, L->pos);
        if (!t)
            return tdm_error_set(L->lx->err, TDM_ERESOURCE, "out of memory");
        int rc = lex_one(L, t);
        if (rc)
            return rc;
        if (t->kind != JT_OP || t->n != 1)
            continue;
        char ch = t->s[0];
        if (ch == '(' || ch == '[' || ch == '{') {
            if (depth == JJ_MAX_BRACKETS)
                return lex_fail(L, start, "template nested too deeply (more than 512 brackets)");
            want[depth++] = ch == '(' ? ')' : ch == '[' ? ']' : '}';
        } else if (ch == ')' || ch == ']' || ch == '}') {
            if (depth == 0 || want[depth - 1] != ch) {
                if (depth == 0)
                    snprintf(msg, sizeof msg, "unexpected '%c'", ch);
                else
                    snprintf(msg, sizeof msg, "unexpected '%c', expected '%c'", ch,
                             want[depth - 1]);
                return lex_fail(L, start, msg);
            }
            depth--;
        }
    }
}

static int lex_run(lexer_t *L)
{
    while (L->pos < L->len) {
        size_t at = next_tag(L, L->pos);
        if (at == L->len)
            return push_text(L, L->pos, L->len - L->pos);
        char kind = L->src[at + 1];
        char sign = at + 2 < L->len ? L->src[at + 2] : 0;
        if (sign != '-' && sign != '+')
            sign = 0;
        size_t tend = strip_text(L, L->pos, at, sign, kind != '{');
        int rc = push_text(L, L->pos, tend - L->pos);
        if (rc)
            return rc;
        L->pos = at + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            rc = lex_comment(L, at);
        } else {
            size_t rend;
            bool minus;
            if (kind == '%' && is_raw(L, &rend, &minus)) {
                L->pos = rend;
                after_tag_end(L, minus, false); /* jinja2: no trim_blocks after raw */
                rc = lex_raw(L, at);
            } else {
                if (!push(L, kind == '%' ? JT_BLOCK_BEGIN : JT_VAR_BEGIN, at))
                    return tdm_error_set(L->lx->err, TDM_ERESOURCE, "out of memory");
                rc = lex_tag(L, at, kind == '%');
            }
        }
        if (rc)
            return rc;
    }
    return 0;
}

int jj_lex(jj_lex_t *lx, const char *src, size_t len, const tdm_jinja_options_t *opt)
{
    static const tdm_jinja_options_t none = {false, false};
    if (len > 0 && src[len - 1] == '\n') /* keep_trailing_newline=False */
        len--;
    lexer_t L = {.lx = lx, .src = src, .len = len, .opt = opt ? opt : &none, .line_starting = true};
    lx->src = src;
    int rc = lex_run(&L);
    if (rc)
        return rc;
    return push(&L, JT_EOF, len) ? 0 : tdm_error_set(lx->err, TDM_ERESOURCE, "out of memory");
}

void jj_where(const char *src, size_t off, int *line, int *col)
{
    where(src, off, line, col);
}
