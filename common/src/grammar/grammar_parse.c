/* grammar_parse.c - GBNF text to the parser's rule list (grammar_internal.h), with llama.cpp's
 * syntax (grammars/README.md): `name ::= alternatives`, newlines end a rule outside
 * parentheses, `|` may be followed by a newline, `# ...` comments, string literals, classes,
 * `.`, groups and the postfix operators `* + ? {m} {m,} {m,n}`.
 *
 * Groups become generated rules and a repeated item is first made one element (a literal of
 * several characters becomes a generated rule), so repetition copies single elements:
 * x{m,n} is m copies of x then n - m nested optional rules, x* is `R ::= x R |`. The
 * expansion is capped (TDM_GRAMMAR_MAX_REPEAT, TDM_GRAMMAR_MAX_ELEMENTS).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

typedef struct parser {
    gram_ir_t *ir;
    const char *s; /* text */
    size_t len, pos;
    uint32_t rule; /* rule being defined (for messages) */
    tdm_error_t *err;
} parser_t;

int tdm_gram_error_at(const gram_ir_t *ir, size_t at, uint32_t rule, tdm_error_t *err,
                      const char *fmt, ...)
{
    unsigned line = 1, col = 1;
    for (size_t i = 0; i < at && i < ir->len; i++) {
        if (ir->text[i] == '\n') {
            line++;
            col = 1;
        } else if (((unsigned char)ir->text[i] & 0xC0) != 0x80) {
            col++; /* columns count characters, not bytes */
        }
    }
    char what[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (rule >= ir->n_rules) /* before the first rule's name */
        return tdm_error_set(err, TDM_EINVALID, "line %u, column %u: %s", line, col, what);
    return tdm_error_set(err, TDM_EINVALID, "line %u, column %u (rule %s): %s", line, col,
                         ir->rules[rule].name, what);
}

void tdm_gram_ir_free(gram_ir_t *ir)
{
    for (uint32_t i = 0; i < ir->n_rules; i++) {
        free(ir->rules[i].name);
        free(ir->rules[i].elems);
    }
    free(ir->rules);
    free(ir->ranges);
    free(ir->class_off);
    free(ir->names);
    memset(ir, 0, sizeof *ir);
}

static int oom(parser_t *p)
{
    return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory compiling the grammar");
}

static int fail(parser_t *p, size_t at, const char *what)
{
    return tdm_gram_error_at(p->ir, at, p->rule, p->err, "%s", what);
}

bool tdm_gram_grow(void **arr, uint32_t *cap, uint32_t need, size_t sz)
{
    if (need <= *cap)
        return true;
    uint32_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *a = realloc(*arr, (size_t)n * sz);
    if (!a)
        return false;
    *arr = a;
    *cap = n;
    return true;
}

/* ---- rules ---- */

/* Adds a rule named name[len] (copied); returns its id or UINT32_MAX on out of memory. */
static uint32_t rule_add(gram_ir_t *ir, const char *name, size_t len)
{
    if (!tdm_gram_grow((void **)&ir->rules, &ir->cap_rules, ir->n_rules + 1, sizeof *ir->rules))
        return UINT32_MAX;
    gram_rule_t *r = &ir->rules[ir->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(len + 1);
    if (!r->name)
        return UINT32_MAX;
    memcpy(r->name, name, len);
    r->name[len] = '\0';
    return ir->n_rules++;
}

static uint32_t name_hash(const char *name, size_t len)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)name[i]) * 16777619u;
    return h;
}

/* Doubles the table of user rule names (ids + 1, open addressing). */
static bool names_grow(gram_ir_t *ir)
{
    uint32_t cap = ir->name_cap ? 2 * ir->name_cap : 64;
    uint32_t *t = calloc(cap, sizeof *t);
    if (!t)
        return false;
    for (uint32_t i = 0; i < ir->name_cap; i++) {
        uint32_t id = ir->names[i];
        if (!id)
            continue;
        const char *n = ir->rules[id - 1].name;
        uint32_t j = name_hash(n, strlen(n)) & (cap - 1);
        while (t[j])
            j = (j + 1) & (cap - 1);
        t[j] = id;
    }
    free(ir->names);
    ir->names = t;
    ir->name_cap = cap;
    return true;
}

/* The id of the user rule named name[len], added undefined when new; UINT32_MAX on OOM. */
static uint32_t rule_find(gram_ir_t *ir, const char *name, size_t len)
{
    if (2 * (ir->n_names + 1) > ir->name_cap && !names_grow(ir))
        return UINT32_MAX;
    uint32_t mask = ir->name_cap - 1, i = name_hash(name, len) & mask;
    for (uint32_t id; (id = ir->names[i]) != 0; i = (i + 1) & mask) {
        const char *n = ir->rules[id - 1].name;
        if (strncmp(n, name, len) == 0 && n[len] == '\0')
            return id - 1;
    }
    uint32_t id = rule_add(ir, name, len);
    if (id != UINT32_MAX) {
        ir->names[i] = id + 1;
        ir->n_names++;
    }
    return id;
}

/* A new generated rule "<parent>_<n>", defined at byte offset at. */
static uint32_t rule_generate(parser_t *p, uint32_t parent, size_t at)
{
    char name[256];
    int n = snprintf(name, sizeof name, "%.200s_%u", p->ir->rules[parent].name, p->ir->n_rules);
    uint32_t id = rule_add(p->ir, name, (size_t)n);
    if (id != UINT32_MAX) {
        p->ir->rules[id].defined = true;
        p->ir->rules[id].def_at = at;
    }
    return id;
}

static int emit(parser_t *p, uint32_t rule, uint32_t elem)
{
    gram_rule_t *r = &p->ir->rules[rule];
    if (++p->ir->n_elems_total > TDM_GRAMMAR_MAX_ELEMENTS)
        return tdm_gram_error_at(p->ir, p->pos, p->rule, p->err,
                                 "the grammar expands to more than %u elements once its "
                                 "repetitions are unrolled; use smaller repetition counts",
                                 TDM_GRAMMAR_MAX_ELEMENTS);
    if (!tdm_gram_grow((void **)&r->elems, &r->cap, r->n_elems + 1, sizeof *r->elems))
        return oom(p);
    r->elems[r->n_elems++] = elem;
    return TDM_OK;
}

/* ---- classes ---- */

static int range_cmp(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Sorts and merges the ranges of the class being built (from index first, in pairs), and
 * complements them when negated; then closes the class. Returns its id or UINT32_MAX (OOM). */
static uint32_t class_close(gram_ir_t *ir, uint32_t first, bool negated)
{
    uint32_t *r = ir->ranges + 2 * (size_t)first;
    uint32_t n = ir->n_ranges - first, k = 0, run = 1;
    while (run < n && r[2 * (run - 1)] <= r[2 * run])
        run++;
    if (run < n) /* generated classes mostly come in order */
        qsort(r, n, 2 * sizeof *r, range_cmp);
    for (uint32_t i = 0; i < n; i++) {
        if (k > 0 && r[2 * i] <= r[2 * k - 1] + 1) {
            if (r[2 * i + 1] > r[2 * k - 1])
                r[2 * k - 1] = r[2 * i + 1];
        } else {
            r[2 * k] = r[2 * i];
            r[2 * k + 1] = r[2 * i + 1];
            k++;
        }
    }
    ir->n_ranges = first + k;
    if (negated) {
        uint32_t *tmp = malloc((2 * (size_t)k + 2) * sizeof *tmp);
        if (!tmp)
            return UINT32_MAX;
        uint32_t m = 0, next = 0;
        for (uint32_t i = 0; i < k; i++) {
            if (r[2 * i] > next) {
                tmp[2 * m] = next;
                tmp[2 * m + 1] = r[2 * i] - 1;
                m++;
            }
            next = r[2 * i + 1] + 1;
        }
        if (next <= GRAM_MAX_CP) {
            tmp[2 * m] = next;
            tmp[2 * m + 1] = GRAM_MAX_CP;
            m++;
        }
        ir->n_ranges = first;
        if (!tdm_gram_grow((void **)&ir->ranges, &ir->cap_ranges, 2 * (first + m),
                           sizeof *ir->ranges)) {
            free(tmp);
            return UINT32_MAX;
        }
        memcpy(ir->ranges + 2 * (size_t)first, tmp, 2 * (size_t)m * sizeof *tmp);
        ir->n_ranges = first + m;
        free(tmp);
    }
    if (!tdm_gram_grow((void **)&ir->class_off, &ir->cap_classes, ir->n_classes + 2,
                       sizeof *ir->class_off))
        return UINT32_MAX;
    if (ir->n_classes == 0)
        ir->class_off[0] = 0;
    ir->class_off[ir->n_classes + 1] = ir->n_ranges;
    return ir->n_classes++;
}

static bool range_push(gram_ir_t *ir, uint32_t lo, uint32_t hi)
{
    /* n_ranges counts pairs; the array holds 2 * n_ranges values */
    uint32_t cap = ir->cap_ranges;
    if (!tdm_gram_grow((void **)&ir->ranges, &cap, 2 * (ir->n_ranges + 1), sizeof *ir->ranges))
        return false;
    ir->cap_ranges = cap;
    ir->ranges[2 * ir->n_ranges] = lo;
    ir->ranges[2 * ir->n_ranges + 1] = hi;
    ir->n_ranges++;
    return true;
}

/* Emits a class of the single code point cp. */
static int emit_char(parser_t *p, uint32_t rule, uint32_t cp)
{
    uint32_t first = p->ir->n_ranges;
    if (!range_push(p->ir, cp, cp))
        return oom(p);
    uint32_t c = class_close(p->ir, first, false);
    if (c == UINT32_MAX)
        return oom(p);
    return emit(p, rule, GRAM_ELEM(GRAM_CLASS, c));
}

/* ---- lexing ---- */

static bool is_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
}

/* Skips blanks and comments, and newlines too when newlines is true. */
static void skip_space(parser_t *p, bool newlines)
{
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c == ' ' || c == '\t' || (newlines && (c == '\n' || c == '\r'))) {
            p->pos++;
        } else if (c == '#') {
            while (p->pos < p->len && p->s[p->pos] != '\n' && p->s[p->pos] != '\r')
                p->pos++;
        } else {
            break;
        }
    }
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Reads n hex digits after an escape letter into *cp. */
static int parse_hex(parser_t *p, size_t at, unsigned n, uint32_t *cp)
{
    uint32_t v = 0;
    for (unsigned i = 0; i < n; i++) {
        int h = p->pos < p->len ? hex_value(p->s[p->pos]) : -1;
        if (h < 0)
            return tdm_gram_error_at(p->ir, at, p->rule, p->err,
                                     "expecting %u hex digits after '\\%c'", n, p->s[at + 1]);
        v = v << 4 | (uint32_t)h;
        p->pos++;
    }
    if (v > GRAM_MAX_CP)
        return fail(p, at, "code point above U+10FFFF");
    *cp = v;
    return TDM_OK;
}

/* Reads one character of a literal or class (an escape or a UTF-8 character) into *cp. */
static int parse_char(parser_t *p, uint32_t *cp)
{
    size_t at = p->pos;
    if (p->s[at] != '\\') {
        size_t n = tdm_utf8_decode((const unsigned char *)p->s + at, p->len - at, cp);
        if (n == 0)
            return fail(p, at, "invalid UTF-8");
        p->pos += n;
        return TDM_OK;
    }
    if (at + 1 >= p->len)
        return fail(p, at, "unfinished escape");
    char e = p->s[at + 1];
    p->pos += 2;
    switch (e) {
    case 'x': return parse_hex(p, at, 2, cp);
    case 'u': return parse_hex(p, at, 4, cp);
    case 'U': return parse_hex(p, at, 8, cp);
    case 'n': *cp = '\n'; return TDM_OK;
    case 't': *cp = '\t'; return TDM_OK;
    case 'r': *cp = '\r'; return TDM_OK;
    case '\\':
    case '"':
    case '[':
    case ']':
    case '-':
    case '^': *cp = (uint32_t)e; return TDM_OK;
    default: return tdm_gram_error_at(p->ir, at, p->rule, p->err, "unknown escape '\\%c'", e);
    }
}

/* ---- items ---- */

static int parse_alternates(parser_t *p, uint32_t rule, bool nested);

static int parse_literal(parser_t *p, uint32_t rule)
{
    size_t at = p->pos++;
    while (p->pos < p->len && p->s[p->pos] != '"') {
        uint32_t cp;
        int rc = parse_char(p, &cp);
        if (rc == TDM_OK)
            rc = emit_char(p, rule, cp);
        if (rc != TDM_OK)
            return rc;
    }
    if (p->pos >= p->len)
        return fail(p, at, "unterminated string literal");
    p->pos++;
    return TDM_OK;
}

static int parse_class(parser_t *p, uint32_t rule)
{
    size_t at = p->pos++;
    bool negated = p->pos < p->len && p->s[p->pos] == '^';
    if (negated)
        p->pos++;
    uint32_t first = p->ir->n_ranges;
    while (p->pos < p->len && p->s[p->pos] != ']') {
        uint32_t lo, hi;
        int rc = parse_char(p, &lo);
        if (rc != TDM_OK)
            return rc;
        hi = lo;
        if (p->pos + 1 < p->len && p->s[p->pos] == '-' && p->s[p->pos + 1] != ']') {
            p->pos++;
            size_t hi_at = p->pos;
            if ((rc = parse_char(p, &hi)) != TDM_OK)
                return rc;
            if (hi < lo)
                return fail(p, hi_at, "class range end is below its start");
        }
        if (!range_push(p->ir, lo, hi))
            return oom(p);
    }
    if (p->pos >= p->len)
        return fail(p, at, "unterminated character class");
    p->pos++;
    uint32_t c = class_close(p->ir, first, negated);
    if (c == UINT32_MAX)
        return oom(p);
    return emit(p, rule, GRAM_ELEM(GRAM_CLASS, c));
}

static int parse_any(parser_t *p, uint32_t rule)
{
    p->pos++;
    uint32_t first = p->ir->n_ranges;
    if (!range_push(p->ir, 0, GRAM_MAX_CP))
        return oom(p);
    uint32_t c = class_close(p->ir, first, false);
    if (c == UINT32_MAX)
        return oom(p);
    return emit(p, rule, GRAM_ELEM(GRAM_CLASS, c));
}

static int parse_ref(parser_t *p, uint32_t rule)
{
    size_t at = p->pos;
    while (p->pos < p->len && is_name_char(p->s[p->pos]))
        p->pos++;
    uint32_t id = rule_find(p->ir, p->s + at, p->pos - at);
    if (id == UINT32_MAX)
        return oom(p);
    gram_rule_t *r = &p->ir->rules[id];
    if (r->ref_at == 0) {
        r->ref_at = at + 1; /* + 1: 0 means "not referenced yet" */
        r->ref_from = p->rule;
    }
    return emit(p, rule, GRAM_ELEM(GRAM_REF, id));
}

static int parse_group(parser_t *p, uint32_t rule)
{
    size_t at = p->pos++;
    uint32_t sub = rule_generate(p, p->rule, at);
    if (sub == UINT32_MAX)
        return oom(p);
    skip_space(p, true);
    int rc = parse_alternates(p, sub, true);
    if (rc != TDM_OK)
        return rc;
    if (p->pos >= p->len || p->s[p->pos] != ')')
        return fail(p, at, "expecting ')' to close this group");
    p->pos++;
    return emit(p, rule, GRAM_ELEM(GRAM_REF, sub));
}

/* ---- repetition ---- */

/* Reads an unsigned number for {m,n}. */
static int parse_count(parser_t *p, uint32_t *out)
{
    size_t at = p->pos;
    uint64_t v = 0;
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
        if (v <= TDM_GRAMMAR_MAX_REPEAT) /* saturates past the limit: the digits say the rest */
            v = v * 10 + (uint64_t)(p->s[p->pos] - '0');
        p->pos++;
    }
    if (v > TDM_GRAMMAR_MAX_REPEAT)
        return tdm_gram_error_at(
            p->ir, at, p->rule, p->err, "repetition count %.*s is above the limit of %u",
            (int)(p->pos - at < 24 ? p->pos - at : 24), p->s + at, TDM_GRAMMAR_MAX_REPEAT);
    if (p->pos == at)
        return fail(p, at, "expecting a number in '{'");
    *out = (uint32_t)v;
    return TDM_OK;
}

/* Reads the operator at p->pos into min/max (max UINT32_MAX: unbounded). */
static int parse_operator(parser_t *p, uint32_t *min, uint32_t *max)
{
    char c = p->s[p->pos];
    size_t at = p->pos++;
    *min = c == '+' ? 1 : 0;
    *max = c == '?' ? 1 : UINT32_MAX;
    if (c != '{')
        return TDM_OK;
    skip_space(p, false);
    int rc = parse_count(p, min);
    if (rc != TDM_OK)
        return rc;
    skip_space(p, false);
    *max = *min;
    if (p->pos < p->len && p->s[p->pos] == ',') {
        p->pos++;
        skip_space(p, false);
        *max = UINT32_MAX;
        if (p->pos < p->len && p->s[p->pos] != '}' && (rc = parse_count(p, max)) != TDM_OK)
            return rc;
        skip_space(p, false);
    }
    if (p->pos >= p->len || p->s[p->pos] != '}')
        return fail(p, at, "expecting '}' to close the repetition");
    p->pos++;
    if (*max < *min)
        return fail(p, at, "repetition {m,n} with n < m");
    return TDM_OK;
}

/* Appends `e R |` or `e |` alternatives: a new rule matching e{0,1} (tail NULL) or e tail?. */
static uint32_t rule_optional(parser_t *p, uint32_t e, uint32_t tail, size_t at, int *rc)
{
    uint32_t r = rule_generate(p, p->rule, at);
    if (r == UINT32_MAX) {
        *rc = oom(p);
        return r;
    }
    if ((*rc = emit(p, r, e)) != TDM_OK)
        return r;
    if (tail != UINT32_MAX && (*rc = emit(p, r, GRAM_ELEM(GRAM_REF, tail))) != TDM_OK)
        return r;
    if ((*rc = emit(p, r, GRAM_ELEM(GRAM_ALT, 0))) == TDM_OK)
        *rc = emit(p, r, GRAM_ELEM(GRAM_END, 0));
    return r;
}

/* Replaces the item rule[start..] by its repetition {min,max}. */
static int repeat_item(parser_t *p, uint32_t rule, uint32_t start, uint32_t min, uint32_t max,
                       size_t at)
{
    gram_rule_t *r = &p->ir->rules[rule];
    int rc = TDM_OK;
    if (r->n_elems - start > 1) { /* a literal of several characters: one rule */
        uint32_t sub = rule_generate(p, p->rule, at);
        if (sub == UINT32_MAX)
            return oom(p);
        r = &p->ir->rules[rule];
        for (uint32_t i = start; i < r->n_elems && rc == TDM_OK; i++)
            rc = emit(p, sub, p->ir->rules[rule].elems[i]);
        if (rc == TDM_OK)
            rc = emit(p, sub, GRAM_ELEM(GRAM_END, 0));
        if (rc != TDM_OK)
            return rc;
        r = &p->ir->rules[rule];
        r->elems[start] = GRAM_ELEM(GRAM_REF, sub);
        r->n_elems = start + 1;
    }
    uint32_t e = r->elems[start];
    r->n_elems = start;
    for (uint32_t i = 0; i < min && rc == TDM_OK; i++)
        rc = emit(p, rule, e);
    if (rc != TDM_OK || max == min)
        return rc;
    uint32_t opt;
    if (max == UINT32_MAX) { /* R ::= e R | */
        opt = rule_generate(p, p->rule, at);
        if (opt == UINT32_MAX)
            return oom(p);
        rc = emit(p, opt, e);
        if (rc == TDM_OK)
            rc = emit(p, opt, GRAM_ELEM(GRAM_REF, opt));
        if (rc == TDM_OK)
            rc = emit(p, opt, GRAM_ELEM(GRAM_ALT, 0));
        if (rc == TDM_OK)
            rc = emit(p, opt, GRAM_ELEM(GRAM_END, 0));
    } else { /* R1 ::= e | ; Rk ::= e R(k-1) | */
        opt = UINT32_MAX;
        for (uint32_t k = 0; k < max - min && rc == TDM_OK; k++)
            opt = rule_optional(p, e, opt, at, &rc);
    }
    return rc == TDM_OK ? emit(p, rule, GRAM_ELEM(GRAM_REF, opt)) : rc;
}

/* ---- sequences, alternatives, rules ---- */

static int parse_item(parser_t *p, uint32_t rule)
{
    char c = p->s[p->pos];
    if (c == '"')
        return parse_literal(p, rule);
    if (c == '[')
        return parse_class(p, rule);
    if (c == '.')
        return parse_any(p, rule);
    if (c == '(')
        return parse_group(p, rule);
    if (is_name_char(c))
        return parse_ref(p, rule);
    return tdm_gram_error_at(p->ir, p->pos, p->rule, p->err, "unexpected character '%c'", c);
}

static bool at_sequence_end(const parser_t *p)
{
    if (p->pos >= p->len)
        return true;
    char c = p->s[p->pos];
    return c == '|' || c == ')' || c == '\n' || c == '\r';
}

static int parse_sequence(parser_t *p, uint32_t rule, bool nested)
{
    uint32_t last = UINT32_MAX; /* start of the last item in rule's elements */
    while (!at_sequence_end(p)) {
        char c = p->s[p->pos];
        int rc;
        if (c == '*' || c == '+' || c == '?' || c == '{') {
            size_t at = p->pos;
            if (last == UINT32_MAX)
                return tdm_gram_error_at(p->ir, at, p->rule, p->err,
                                         "expecting an item before '%c'", c);
            uint32_t min, max;
            if ((rc = parse_operator(p, &min, &max)) != TDM_OK ||
                (rc = repeat_item(p, rule, last, min, max, at)) != TDM_OK)
                return rc;
            last = UINT32_MAX;
        } else {
            last = p->ir->rules[rule].n_elems;
            if ((rc = parse_item(p, rule)) != TDM_OK)
                return rc;
        }
        skip_space(p, nested);
    }
    return TDM_OK;
}

static int parse_alternates(parser_t *p, uint32_t rule, bool nested)
{
    int rc = parse_sequence(p, rule, nested);
    while (rc == TDM_OK && p->pos < p->len && p->s[p->pos] == '|') {
        p->pos++;
        skip_space(p, true);
        if ((rc = emit(p, rule, GRAM_ELEM(GRAM_ALT, 0))) == TDM_OK)
            rc = parse_sequence(p, rule, nested);
    }
    return rc == TDM_OK ? emit(p, rule, GRAM_ELEM(GRAM_END, 0)) : rc;
}

static int parse_rule(parser_t *p)
{
    size_t at = p->pos;
    p->rule = UINT32_MAX;
    while (p->pos < p->len && is_name_char(p->s[p->pos]))
        p->pos++;
    if (p->pos == at)
        return fail(p, at, "expecting a rule name");
    uint32_t id = rule_find(p->ir, p->s + at, p->pos - at);
    if (id == UINT32_MAX)
        return oom(p);
    p->rule = id;
    if (p->ir->rules[id].defined)
        return fail(p, at, "rule defined twice");
    p->ir->rules[id].defined = true;
    p->ir->rules[id].def_at = at;
    skip_space(p, false);
    if (p->len - p->pos < 3 || memcmp(p->s + p->pos, "::=", 3) != 0)
        return fail(p, p->pos, "expecting '::='");
    p->pos += 3;
    skip_space(p, true);
    int rc = parse_alternates(p, id, false);
    if (rc != TDM_OK)
        return rc;
    if (p->pos < p->len && p->s[p->pos] == ')')
        return fail(p, p->pos, "unmatched ')'");
    skip_space(p, true);
    return TDM_OK;
}

int tdm_gram_parse_ir(gram_ir_t *ir, const char *text, size_t len, tdm_error_t *err)
{
    parser_t p = {.ir = ir, .s = text, .len = len, .rule = UINT32_MAX, .err = err};
    ir->text = text;
    ir->len = len;
    skip_space(&p, true);
    while (p.pos < p.len) {
        int rc = parse_rule(&p);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}
