/* jinja_parse.c - Jinja tokens into a syntax tree, with jinja2's grammar and precedence. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_lex.h"

typedef struct parser {
    jj_arena_t *arena;
    jj_lex_t lx;
    size_t i;
    unsigned depth; /* nesting of expressions and blocks now being parsed */
    jmp_buf fail;
    int code;
    tdm_error_t *err;
} parser_t;

static const jj_token_t *cur(parser_t *p)
{
    return &p->lx.toks[p->i];
}

_Noreturn static void pfail(parser_t *p, const jj_token_t *t, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

_Noreturn static void pfail(parser_t *p, const jj_token_t *t, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->code = tdm_error_set(p->err, TDM_EINVALID, "%d:%d: %s", t->line, t->col, msg);
    longjmp(p->fail, 1);
}

/* Nesting bound: the parser and the renderer recurse once per level. */
#define JJ_MAX_NESTING 200

static void enter(parser_t *p)
{
    if (++p->depth > JJ_MAX_NESTING)
        pfail(p, cur(p), "template nested too deeply (more than %d levels)", JJ_MAX_NESTING);
}

static void leave(parser_t *p)
{
    p->depth--;
}

/* Height bound of an expression's tree: the renderer recurses once per level, as jinja2's
 * compiled code does (Python gives up at about 250 to 500 links of a chain). */
#define JJ_MAX_HEIGHT 256

static unsigned height_of(const jj_node_t *n)
{
    return n ? n->height : 0;
}

/* n, complete, with its height set from its operands; fails past JJ_MAX_HEIGHT so that no chain
 * of operators, filters, subscripts or attributes builds a tree deeper than the renderer may
 * walk. */
static jj_node_t *seal(parser_t *p, jj_node_t *n)
{
    unsigned h = height_of(n->a);
    const jj_node_t *more[] = {n->b, n->c, n->orelse};
    for (size_t k = 0; k < 3; k++)
        if (height_of(more[k]) > h)
            h = height_of(more[k]);
    for (size_t k = 0; k < n->n_kids; k++)
        if (height_of(n->kids[k]) > h)
            h = height_of(n->kids[k]);
    n->height = h + 1;
    if (n->height > JJ_MAX_HEIGHT) {
        p->code = tdm_error_set(p->err, TDM_EINVALID,
                                "%d:%d: expression nested too deeply (more than %d levels)",
                                n->line, n->col, JJ_MAX_HEIGHT);
        longjmp(p->fail, 1);
    }
    return n;
}

static void *palloc(parser_t *p, size_t n)
{
    void *m = jj_alloc(p->arena, n);
    if (!m) {
        p->code = tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
        longjmp(p->fail, 1);
    }
    return m;
}

static jj_node_t *node(parser_t *p, jj_node_kind_t kind, const jj_token_t *t)
{
    jj_node_t *n = palloc(p, sizeof *n);
    n->kind = kind;
    n->line = t->line;
    n->col = t->col;
    return n;
}

static void add_kid(parser_t *p, jj_node_t *parent, jj_node_t *kid)
{
    if ((parent->n_kids & (parent->n_kids - 1)) == 0) { /* 0, 1, 2, 4...: grow */
        size_t cap = parent->n_kids ? parent->n_kids * 2 : 1;
        jj_node_t **k = palloc(p, cap * sizeof *k);
        if (parent->n_kids)
            memcpy(k, parent->kids, parent->n_kids * sizeof *k);
        parent->kids = k;
    }
    parent->kids[parent->n_kids++] = kid;
}

static bool is_op(const jj_token_t *t, const char *op)
{
    return t->kind == JT_OP && t->n == strlen(op) && memcmp(t->s, op, t->n) == 0;
}

static bool is_name(const jj_token_t *t, const char *name)
{
    return t->kind == JT_NAME && t->n == strlen(name) && memcmp(t->s, name, t->n) == 0;
}

static bool accept_op(parser_t *p, const char *op)
{
    if (!is_op(cur(p), op))
        return false;
    p->i++;
    return true;
}

static bool accept_name(parser_t *p, const char *name)
{
    if (!is_name(cur(p), name))
        return false;
    p->i++;
    return true;
}

static const char *describe(const jj_token_t *t)
{
    switch (t->kind) {
    case JT_BLOCK_END: return "end of statement block";
    case JT_VAR_END: return "end of print statement";
    case JT_EOF: return "end of template";
    default: return "token";
    }
}

static void expect_op(parser_t *p, const char *op)
{
    if (!accept_op(p, op))
        pfail(p, cur(p), "expected token '%s', got %s '%.*s'", op, describe(cur(p)), (int)cur(p)->n,
              cur(p)->s ? cur(p)->s : "");
}

static const char *name_str(parser_t *p, const jj_token_t *t)
{
    char *s = palloc(p, t->n + 1);
    memcpy(s, t->s, t->n);
    return s;
}

static const char *expect_name(parser_t *p)
{
    const jj_token_t *t = cur(p);
    if (t->kind != JT_NAME)
        pfail(p, t, "expected a name");
    p->i++;
    return name_str(p, t);
}

static void expect_block_end(parser_t *p)
{
    if (cur(p)->kind != JT_BLOCK_END)
        pfail(p, cur(p), "expected token 'end of statement block', got '%.*s'", (int)cur(p)->n,
              cur(p)->s ? cur(p)->s : "");
    p->i++;
}

/* ---- expressions ---- */

static jj_node_t *parse_expr(parser_t *p);

static jj_node_t *parse_tuple(parser_t *p, bool with_condexpr);
static jj_node_t *parse_filter(parser_t *p, jj_node_t *base);

/* A string literal's body decoded as Python's unicode-escape does. */
static size_t put_utf8(char *o, unsigned long cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static size_t hex_escape(const char *s, size_t n, size_t digits, unsigned long *cp)
{
    if (n < digits)
        return 0;
    unsigned long v = 0;
    for (size_t k = 0; k < digits; k++) {
        char ch = s[k];
        int d = ch >= '0' && ch <= '9'   ? ch - '0'
                : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                                         : -1;
        if (d < 0)
            return 0;
        v = v * 16 + (unsigned long)d;
    }
    *cp = v;
    return digits;
}

static char simple_escape(char ch)
{
    switch (ch) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case '\\': return '\\';
    case '\'': return '\'';
    case '"': return '"';
    case 'a': return '\a';
    case 'b': return '\b';
    case 'f': return '\f';
    case 'v': return '\v';
    case '\n': return 1; /* line continuation: nothing */
    default: return 2;
    }
}

static size_t decode_string(const char *s, size_t n, char *o)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) {
            o[k++] = s[i];
            continue;
        }
        char e = s[++i];
        unsigned long cp;
        size_t used = 0;
        if (e >= '0' && e <= '7') { /* octal: up to three digits */
            cp = 0;
            size_t d = 0;
            while (d < 3 && i + d < n && s[i + d] >= '0' && s[i + d] <= '7')
                cp = cp * 8 + (unsigned long)(s[i + d++] - '0');
            i += d - 1;
            k += put_utf8(o + k, cp);
            continue;
        }
        if (e == 'u')
            used = hex_escape(s + i + 1, n - i - 1, 4, &cp);
        else if (e == 'U')
            used = hex_escape(s + i + 1, n - i - 1, 8, &cp);
        else if (e == 'x')
            used = hex_escape(s + i + 1, n - i - 1, 2, &cp);
        if (used) {
            k += put_utf8(o + k, cp);
            i += used;
            continue;
        }
        char d = simple_escape(e);
        if (d == 1)
            continue;
        if (d == 2) {
            o[k++] = '\\';
            o[k++] = e;
        } else {
            o[k++] = d;
        }
    }
    return k;
}

static jj_node_t *const_node(parser_t *p, const jj_token_t *t, jj_kind_t kind)
{
    jj_node_t *n = node(p, JN_CONST, t);
    n->value = palloc(p, sizeof *n->value);
    n->value->kind = kind;
    return n;
}

static jj_node_t *parse_string(parser_t *p)
{
    const jj_token_t *t = cur(p);
    size_t total = 0;
    for (size_t k = p->i; p->lx.toks[k].kind == JT_STRING; k++)
        total += p->lx.toks[k].n * 4 + 1;
    char *o = palloc(p, total + 1);
    size_t len = 0;
    while (cur(p)->kind == JT_STRING) {
        len += decode_string(cur(p)->s, cur(p)->n, o + len);
        p->i++;
    }
    jj_node_t *n = const_node(p, t, JV_STR);
    n->value->u.str.s = o;
    n->value->u.str.n = len;
    return n;
}

static jj_node_t *parse_number(parser_t *p)
{
    const jj_token_t *t = cur(p);
    char buf[64];
    size_t k = 0;
    for (size_t i = 0; i < t->n && k + 1 < sizeof buf; i++)
        if (t->s[i] != '_')
            buf[k++] = t->s[i];
    buf[k] = 0;
    p->i++;
    if (t->kind == JT_INT) {
        jj_node_t *n = const_node(p, t, JV_INT);
        n->value->u.i = strtoll(buf, NULL, 10);
        return n;
    }
    jj_node_t *n = const_node(p, t, JV_FLOAT);
    n->value->u.f = strtod(buf, NULL);
    return n;
}

static jj_node_t *parse_name_primary(parser_t *p)
{
    const jj_token_t *t = cur(p);
    p->i++;
    if (is_name(t, "true") || is_name(t, "True") || is_name(t, "false") || is_name(t, "False")) {
        jj_node_t *n = const_node(p, t, JV_BOOL);
        n->value->u.b = t->s[0] == 't' || t->s[0] == 'T';
        return n;
    }
    if (is_name(t, "none") || is_name(t, "None"))
        return const_node(p, t, JV_NONE);
    jj_node_t *n = node(p, JN_NAME, t);
    n->name = name_str(p, t);
    return n;
}

static jj_node_t *parse_seq(parser_t *p, const jj_token_t *t, jj_node_kind_t kind,
                            const char *close)
{
    jj_node_t *n = node(p, kind, t);
    while (!accept_op(p, close)) {
        if (n->n_kids)
            expect_op(p, ",");
        if (accept_op(p, close))
            break;
        if (kind == JN_DICT) {
            jj_node_t *kv = node(p, JN_KWARG, cur(p));
            kv->a = parse_expr(p);
            expect_op(p, ":");
            kv->b = parse_expr(p);
            add_kid(p, n, seal(p, kv));
        } else {
            add_kid(p, n, parse_expr(p));
        }
    }
    return seal(p, n);
}

static jj_node_t *parse_primary(parser_t *p)
{
    const jj_token_t *t = cur(p);
    if (t->kind == JT_NAME)
        return parse_name_primary(p);
    if (t->kind == JT_STRING)
        return parse_string(p);
    if (t->kind == JT_INT || t->kind == JT_FLOAT)
        return parse_number(p);
    if (accept_op(p, "(")) {
        if (accept_op(p, ")"))
            return node(p, JN_TUPLE, t);
        jj_node_t *e = parse_expr(p);
        if (is_op(cur(p), ",")) {
            jj_node_t *tup = node(p, JN_TUPLE, t);
            add_kid(p, tup, e);
            while (accept_op(p, ",") && !is_op(cur(p), ")"))
                add_kid(p, tup, parse_expr(p));
            e = seal(p, tup);
        }
        expect_op(p, ")");
        return e;
    }
    if (accept_op(p, "["))
        return parse_seq(p, t, JN_LIST, "]");
    if (accept_op(p, "{"))
        return parse_seq(p, t, JN_DICT, "}");
    if (t->kind == JT_VAR_END || t->kind == JT_BLOCK_END || t->kind == JT_EOF)
        pfail(p, t, "Expected an expression, got '%s'", describe(t)); /* jinja2's words */
    pfail(p, t, "unexpected '%.*s'", t->s ? (int)t->n : (int)strlen(describe(t)),
          t->s ? t->s : describe(t));
}

/* "(args)" after the "(" was taken: positional into n's kids, name=value as JN_KWARG. */
static void parse_args(parser_t *p, jj_node_t *n)
{
    while (!accept_op(p, ")")) {
        if (n->n_kids)
            expect_op(p, ",");
        if (accept_op(p, ")"))
            break;
        if (cur(p)->kind == JT_NAME && is_op(&p->lx.toks[p->i + 1], "=")) {
            jj_node_t *kw = node(p, JN_KWARG, cur(p));
            kw->name = expect_name(p);
            p->i++;
            kw->a = parse_expr(p);
            add_kid(p, n, seal(p, kw));
        } else {
            add_kid(p, n, parse_expr(p));
        }
    }
}

static jj_node_t *parse_subscript(parser_t *p, jj_node_t *obj, const jj_token_t *t)
{
    jj_node_t *parts[3] = {NULL, NULL, NULL};
    int k = 0;
    bool slice = false;
    for (;;) {
        if (!is_op(cur(p), ":") && !is_op(cur(p), "]"))
            parts[k] = parse_expr(p);
        if (accept_op(p, ":") && k < 2) {
            slice = true;
            k++;
            continue;
        }
        break;
    }
    if (!slice && !parts[0])
        pfail(p, cur(p), "Expected an expression, got '%s'", describe(cur(p)));
    expect_op(p, "]");
    jj_node_t *n = node(p, slice ? JN_SLICE : JN_ITEM, t);
    n->a = obj;
    n->b = parts[0];
    if (slice) {
        n->c = parts[1];
        n->orelse = parts[2];
    }
    return seal(p, n);
}

static jj_node_t *parse_postfix(parser_t *p, jj_node_t *n)
{
    for (;;) {
        const jj_token_t *t = cur(p);
        if (accept_op(p, ".")) {
            jj_node_t *a = node(p, JN_ATTR, t);
            a->a = n;
            if (cur(p)->kind == JT_INT) {
                a->kind = JN_ITEM;
                a->b = parse_number(p);
            } else {
                a->name = expect_name(p);
            }
            n = seal(p, a);
        } else if (accept_op(p, "[")) {
            n = parse_subscript(p, n, t);
        } else if (accept_op(p, "(")) {
            jj_node_t *call = node(p, JN_CALL, t);
            call->a = n;
            parse_args(p, call);
            n = seal(p, call);
        } else {
            return n;
        }
    }
}

static jj_node_t *parse_filter(parser_t *p, jj_node_t *base)
{
    jj_node_t *f = node(p, JN_FILTER, cur(p));
    f->a = base;
    f->name = expect_name(p);
    while (accept_op(p, ".")) {
        const char *more = expect_name(p);
        char *s = palloc(p, strlen(f->name) + strlen(more) + 2);
        sprintf(s, "%s.%s", f->name, more);
        f->name = s;
    }
    if (accept_op(p, "("))
        parse_args(p, f);
    return seal(p, f);
}

static bool starts_test_arg(const jj_token_t *t)
{
    if (t->kind == JT_NAME)
        return !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and");
    return t->kind == JT_STRING || t->kind == JT_INT || t->kind == JT_FLOAT || is_op(t, "(") ||
           is_op(t, "[") || is_op(t, "{");
}

static jj_node_t *parse_test(parser_t *p, jj_node_t *base)
{
    jj_node_t *n = node(p, JN_TEST, cur(p));
    n->a = base;
    n->negate = accept_name(p, "not");
    n->name = expect_name(p);
    if (accept_op(p, "("))
        parse_args(p, n);
    else if (starts_test_arg(cur(p)))
        add_kid(p, n, parse_postfix(p, parse_primary(p)));
    return seal(p, n);
}

static jj_node_t *parse_filter_expr(parser_t *p, jj_node_t *n)
{
    for (;;) {
        const jj_token_t *t = cur(p);
        if (accept_op(p, "|")) {
            n = parse_filter(p, n);
        } else if (accept_name(p, "is")) {
            n = parse_test(p, n);
        } else if (accept_op(p, "(")) {
            jj_node_t *call = node(p, JN_CALL, t);
            call->a = n;
            parse_args(p, call);
            n = seal(p, call);
        } else {
            return n;
        }
    }
}

static jj_node_t *parse_unary(parser_t *p, bool with_filter)
{
    const jj_token_t *t = cur(p);
    jj_node_t *n;
    if (accept_op(p, "-") || accept_op(p, "+")) {
        n = node(p, t->s[0] == '-' ? JN_NEG : JN_POS, t);
        enter(p);
        n->a = parse_unary(p, false);
        leave(p);
        seal(p, n);
    } else {
        n = parse_primary(p);
    }
    n = parse_postfix(p, n);
    return with_filter ? parse_filter_expr(p, n) : n;
}

static jj_node_t *binop(parser_t *p, const jj_token_t *t, int op, jj_node_t *a, jj_node_t *b)
{
    jj_node_t *n = node(p, JN_BINOP, t);
    n->op = op;
    n->a = a;
    n->b = b;
    return seal(p, n);
}

static jj_node_t *parse_pow(parser_t *p)
{
    jj_node_t *n = parse_unary(p, true);
    for (const jj_token_t *t = cur(p); accept_op(p, "**"); t = cur(p))
        n = binop(p, t, 'P', n, parse_unary(p, true));
    return n;
}

static jj_node_t *parse_math2(parser_t *p)
{
    jj_node_t *n = parse_pow(p);
    for (;;) {
        const jj_token_t *t = cur(p);
        int op = accept_op(p, "*")    ? '*'
                 : accept_op(p, "//") ? 'F'
                 : accept_op(p, "/")  ? '/'
                 : accept_op(p, "%")  ? '%'
                                      : 0;
        if (!op)
            return n;
        n = binop(p, t, op, n, parse_pow(p));
    }
}

static jj_node_t *parse_concat(parser_t *p)
{
    jj_node_t *n = parse_math2(p);
    for (const jj_token_t *t = cur(p); accept_op(p, "~"); t = cur(p))
        n = binop(p, t, '~', n, parse_math2(p));
    return n;
}

static jj_node_t *parse_math1(parser_t *p)
{
    jj_node_t *n = parse_concat(p);
    for (;;) {
        const jj_token_t *t = cur(p);
        int op = accept_op(p, "+") ? '+' : accept_op(p, "-") ? '-' : 0;
        if (!op)
            return n;
        n = binop(p, t, op, n, parse_concat(p));
    }
}

static int compare_op(parser_t *p, bool *negate)
{
    static const struct {
        const char *tok;
        int op;
    } ops[] = {{"==", 'E'}, {"!=", 'N'}, {"<=", 'L'}, {">=", 'G'}, {"<", '<'}, {">", '>'}};
    *negate = false;
    for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++)
        if (accept_op(p, ops[k].tok))
            return ops[k].op;
    if (accept_name(p, "in"))
        return 'I';
    if (is_name(cur(p), "not") && is_name(&p->lx.toks[p->i + 1], "in")) {
        p->i += 2;
        *negate = true;
        return 'I';
    }
    return 0;
}

/* a < b < c is (a < b) and (b < c), as in Python (b is evaluated twice here). */
static jj_node_t *parse_compare(parser_t *p)
{
    jj_node_t *n = parse_math1(p), *chain = NULL, *left = n;
    for (;;) {
        const jj_token_t *t = cur(p);
        bool negate;
        int op = compare_op(p, &negate);
        if (!op)
            return chain ? chain : n;
        jj_node_t *c = node(p, JN_CMP, t);
        c->op = op;
        c->negate = negate;
        c->a = left;
        c->b = parse_math1(p);
        left = c->b;
        seal(p, c);
        if (chain) {
            jj_node_t *both = node(p, JN_AND, t);
            both->a = chain;
            both->b = c;
            chain = seal(p, both);
        } else {
            chain = c;
        }
    }
}

static jj_node_t *parse_not(parser_t *p)
{
    const jj_token_t *t = cur(p);
    if (accept_name(p, "not")) {
        jj_node_t *n = node(p, JN_NOT, t);
        enter(p);
        n->a = parse_not(p);
        leave(p);
        return seal(p, n);
    }
    return parse_compare(p);
}

static jj_node_t *parse_and(parser_t *p)
{
    jj_node_t *n = parse_not(p);
    for (const jj_token_t *t = cur(p); accept_name(p, "and"); t = cur(p)) {
        jj_node_t *a = node(p, JN_AND, t);
        a->a = n;
        a->b = parse_not(p);
        n = seal(p, a);
    }
    return n;
}

static jj_node_t *parse_or(parser_t *p)
{
    jj_node_t *n = parse_and(p);
    for (const jj_token_t *t = cur(p); accept_name(p, "or"); t = cur(p)) {
        jj_node_t *o = node(p, JN_OR, t);
        o->a = n;
        o->b = parse_and(p);
        n = seal(p, o);
    }
    return n;
}

static jj_node_t *parse_expr(parser_t *p)
{
    enter(p);
    jj_node_t *n = parse_or(p);
    for (const jj_token_t *t = cur(p); accept_name(p, "if"); t = cur(p)) {
        jj_node_t *c = node(p, JN_COND, t);
        c->a = n;
        c->b = parse_or(p);
        if (accept_name(p, "else"))
            c->c = parse_expr(p);
        n = seal(p, c);
    }
    leave(p);
    return n;
}

static bool ends_tuple(const jj_token_t *t)
{
    return t->kind == JT_BLOCK_END || t->kind == JT_VAR_END || t->kind == JT_EOF || is_op(t, ")") ||
           is_op(t, "]") || is_op(t, "}") || is_op(t, "=") ||
           (t->kind == JT_NAME &&
            (is_name(t, "if") || is_name(t, "in") || is_name(t, "recursive")));
}

/* An expression, or a tuple of them "a, b" (without parentheses). */
static jj_node_t *parse_tuple(parser_t *p, bool with_condexpr)
{
    const jj_token_t *t = cur(p);
    jj_node_t *e = with_condexpr ? parse_expr(p) : parse_or(p);
    if (!is_op(cur(p), ","))
        return e;
    jj_node_t *tup = node(p, JN_TUPLE, t);
    add_kid(p, tup, e);
    while (accept_op(p, ",") && !ends_tuple(cur(p)))
        add_kid(p, tup, with_condexpr ? parse_expr(p) : parse_or(p));
    return seal(p, tup);
}

/* ---- statements ---- */

static jj_node_t *parse_body(parser_t *p, const char *const *ends);

static jj_node_t *parse_if(parser_t *p, const jj_token_t *at)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    jj_node_t *n = node(p, JN_IF, at);
    n->a = parse_tuple(p, true);
    expect_block_end(p);
    n->body = parse_body(p, ends);
    const jj_token_t *t = cur(p);
    if (accept_name(p, "elif")) {
        enter(p); /* each elif nests one level deeper in the tree */
        n->orelse = parse_if(p, t);
        leave(p);
        return n;
    }
    if (accept_name(p, "else")) {
        static const char *const endif[] = {"endif", NULL};
        expect_block_end(p);
        n->orelse = parse_body(p, endif);
    }
    if (!accept_name(p, "endif"))
        pfail(p, cur(p), "expected 'endif'");
    expect_block_end(p);
    return n;
}

static jj_node_t *parse_target(parser_t *p)
{
    const jj_token_t *t = cur(p);
    jj_node_t *first = node(p, JN_NAME, t);
    first->name = expect_name(p);
    if (!is_op(cur(p), ","))
        return first;
    jj_node_t *tup = node(p, JN_TUPLE, t);
    add_kid(p, tup, first);
    while (accept_op(p, ",")) {
        jj_node_t *k = node(p, JN_NAME, cur(p));
        k->name = expect_name(p);
        add_kid(p, tup, k);
    }
    return tup;
}

static jj_node_t *parse_for(parser_t *p, const jj_token_t *at)
{
    static const char *const ends[] = {"endfor", "else", NULL}; /* jinja2's order */
    static const char *const endfor[] = {"endfor", NULL};
    jj_node_t *n = node(p, JN_FOR, at);
    n->a = parse_target(p);
    if (!accept_name(p, "in"))
        pfail(p, cur(p), "expected 'in'");
    n->b = parse_tuple(p, false);
    if (accept_name(p, "if"))
        n->c = parse_expr(p);
    accept_name(p, "recursive");
    expect_block_end(p);
    n->body = parse_body(p, ends);
    if (accept_name(p, "else")) {
        expect_block_end(p);
        n->orelse = parse_body(p, endfor);
    }
    if (!accept_name(p, "endfor"))
        pfail(p, cur(p), "expected 'endfor'");
    expect_block_end(p);
    return n;
}

static jj_node_t *parse_set(parser_t *p, const jj_token_t *at)
{
    static const char *const endset[] = {"endset", NULL};
    const jj_token_t *t = cur(p);
    jj_node_t *target;
    if (t->kind == JT_NAME && is_op(&p->lx.toks[p->i + 1], ".")) {
        target = node(p, JN_NSATTR, t);
        target->name = expect_name(p);
        p->i++;
        target->a = node(p, JN_CONST, cur(p));
        target->a->name = expect_name(p);
    } else {
        target = parse_target(p);
    }
    if (accept_op(p, "=")) {
        jj_node_t *n = node(p, JN_SET, at);
        n->a = target;
        n->b = parse_tuple(p, true);
        expect_block_end(p);
        return n;
    }
    jj_node_t *n = node(p, JN_SET_BLOCK, at);
    n->a = target;
    while (accept_op(p, "|"))
        n->c = parse_filter(p, n->c ? n->c : NULL);
    expect_block_end(p);
    n->body = parse_body(p, endset);
    p->i++;
    expect_block_end(p);
    return n;
}

static jj_node_t *parse_macro(parser_t *p, const jj_token_t *at)
{
    static const char *const ends[] = {"endmacro", NULL};
    jj_node_t *n = node(p, JN_MACRO, at);
    n->name = expect_name(p);
    expect_op(p, "(");
    while (!accept_op(p, ")")) {
        if (n->n_kids)
            expect_op(p, ",");
        if (accept_op(p, ")"))
            break;
        jj_node_t *param = node(p, JN_KWARG, cur(p));
        param->name = expect_name(p);
        if (accept_op(p, "="))
            param->a = parse_expr(p);
        add_kid(p, n, param);
    }
    expect_block_end(p);
    n->body = parse_body(p, ends);
    p->i++;
    expect_block_end(p);
    return n;
}

static jj_node_t *parse_simple_body(parser_t *p, jj_node_kind_t kind, const jj_token_t *at,
                                    const char *end)
{
    const char *const ends[] = {end, NULL};
    jj_node_t *n = node(p, kind, at);
    if (kind == JN_FILTER_BLOCK) {
        n->c = NULL;
        do
            n->c = parse_filter(p, n->c);
        while (accept_op(p, "|"));
    }
    expect_block_end(p);
    n->body = parse_body(p, ends);
    p->i++;
    expect_block_end(p);
    return n;
}

/* {% call(params) macro(args) %}body{% endcall %}: a the call, kids caller's parameters. */
static jj_node_t *parse_call_block(parser_t *p, const jj_token_t *at)
{
    static const char *const ends[] = {"endcall", NULL};
    jj_node_t *n = node(p, JN_CALL_BLOCK, at);
    if (accept_op(p, "(")) {
        while (!accept_op(p, ")")) {
            if (n->n_kids)
                expect_op(p, ",");
            jj_node_t *param = node(p, JN_KWARG, cur(p));
            param->name = expect_name(p);
            if (accept_op(p, "="))
                param->a = parse_expr(p);
            add_kid(p, n, param);
        }
    }
    n->a = parse_expr(p);
    if (n->a->kind != JN_CALL)
        pfail(p, at, "expected a call after 'call'");
    expect_block_end(p);
    n->body = parse_body(p, ends);
    p->i++;
    expect_block_end(p);
    return n;
}

static jj_node_t *parse_statement(parser_t *p)
{
    const jj_token_t *at = cur(p);
    if (at->kind != JT_NAME)
        pfail(p, at, "tag name expected");
    p->i++;
    if (is_name(at, "if"))
        return parse_if(p, at);
    if (is_name(at, "for"))
        return parse_for(p, at);
    if (is_name(at, "set"))
        return parse_set(p, at);
    if (is_name(at, "call"))
        return parse_call_block(p, at);
    if (is_name(at, "macro"))
        return parse_macro(p, at);
    if (is_name(at, "filter"))
        return parse_simple_body(p, JN_FILTER_BLOCK, at, "endfilter");
    if (is_name(at, "generation")) /* transformers' tag: its body, marked for training only */
        return parse_simple_body(p, JN_BODY, at, "endgeneration")->body;
    if (is_name(at, "break") || is_name(at, "continue")) {
        jj_node_t *n = node(p, is_name(at, "break") ? JN_BREAK : JN_CONTINUE, at);
        expect_block_end(p);
        return n;
    }
    pfail(p, at, "Encountered unknown tag '%.*s'.", (int)at->n, at->s);
}

static bool in_ends(const jj_token_t *t, const char *const *ends)
{
    for (size_t k = 0; ends && ends[k]; k++)
        if (is_name(t, ends[k]))
            return true;
    return false;
}

/* The end of the source inside a block: jinja2's message, naming the tags in ends (in the
 * order jinja2 gives them) and the block ("endfor" closes "for"). */
_Noreturn static void unclosed(parser_t *p, const jj_token_t *t, const char *const *ends)
{
    char tags[128] = "", *o = tags;
    const char *block = "";
    for (size_t k = 0; ends[k]; k++) {
        o += snprintf(o, (size_t)(tags + sizeof tags - o), "%s'%s'", k ? " or " : "", ends[k]);
        if (strncmp(ends[k], "end", 3) == 0)
            block = ends[k] + 3;
    }
    pfail(p, t,
          "Unexpected end of template. Jinja was looking for the following tags: %s. The "
          "innermost block that needs to be closed is '%s'.",
          tags, block);
}

/* Statements up to a block tag named in ends (left at its name) or the end of the source. */
static jj_node_t *parse_body(parser_t *p, const char *const *ends)
{
    enter(p);
    jj_node_t *body = node(p, JN_BODY, cur(p));
    for (;;) {
        const jj_token_t *t = cur(p);
        if (t->kind == JT_EOF) {
            if (ends && ends[0])
                unclosed(p, t, ends);
            leave(p);
            return body;
        }
        p->i++;
        if (t->kind == JT_TEXT) {
            jj_node_t *n = node(p, JN_TEXT, t);
            n->text = t->s;
            n->text_len = t->n;
            add_kid(p, body, n);
        } else if (t->kind == JT_VAR_BEGIN) {
            jj_node_t *n = node(p, JN_OUTPUT, t);
            n->a = parse_tuple(p, true);
            if (cur(p)->kind != JT_VAR_END)
                pfail(p, cur(p), "expected token 'end of print statement', got '%.*s'",
                      (int)cur(p)->n, cur(p)->s ? cur(p)->s : "");
            p->i++;
            add_kid(p, body, n);
        } else if (t->kind == JT_BLOCK_BEGIN) {
            if (in_ends(cur(p), ends)) {
                leave(p);
                return body;
            }
            add_kid(p, body, parse_statement(p));
        } else {
            pfail(p, t, "unexpected token");
        }
    }
}

jj_node_t *jj_parse(jj_arena_t *arena, const char *src, size_t len, const tdm_jinja_options_t *opt,
                    tdm_error_t *err)
{
    parser_t *p = calloc(1, sizeof *p);
    if (!p) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    p->arena = arena;
    p->err = err;
    p->lx.err = err;
    jj_node_t *root = NULL;
    if (jj_lex(&p->lx, src, len, opt) == 0 && setjmp(p->fail) == 0)
        root = parse_body(p, NULL);
    free(p->lx.toks);
    free(p);
    return root;
}
