/* regex.c - the regular-expression subset of JSON Schema's `pattern` (and of regex
 * constraints) translated to a GBNF expression; plus the GBNF text escaping the schema
 * compiler shares.
 *
 * Subset (docs/structured-output.md): literals, escapes (\d \D \w \W \s \S \n \t \r \f \v \0
 * \xHH \uHHHH and escaped punctuation), classes with ranges and negation, `.` (any character
 * but \n), groups `( )` `(?: )` `(?<name> )`, alternation, `* + ? {m} {m,} {m,n}` (a lazy `?`
 * after them is accepted: it changes which match is found, not which strings match), and the
 * anchors `^` `$` only at the start / end of a top-level alternative. Everything else
 * (backreferences, lookaround, \b, flags, possessive quantifiers) is refused with its offset.
 * \d \w are the ASCII classes (ECMA-262 without the u flag, as JSON Schema says); \s is
 * ECMA-262's WhiteSpace and LineTerminator, which hold Unicode spaces (U+00A0, U+2028, ...).
 *
 * Two modes. Raw: the expression matches the text itself, whole (a regex constraint).
 * JSON: it matches the content of a JSON string (between the quotes) whose decoded text the
 * regex finds, so `"`, `\` and control characters appear in their json.dumps escaped form,
 * and an unanchored side admits any string content (search semantics, as JSON Schema says).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"
#include "regex_internal.h"
#include "tandem/grammar.h"
#include "tandem/json_schema.h"

/* ---- GBNF text ---- */

/* Appends esc (a backslash and a letter) and cp as digits upper-case hex digits. */
static int put_hex_escape(tdm_buf_t *b, const char *esc, uint32_t cp, int digits)
{
    static const char hex[] = "0123456789ABCDEF";
    char t[12];
    t[0] = esc[0];
    t[1] = esc[1];
    for (int i = 0; i < digits; i++)
        t[2 + i] = hex[cp >> (4 * (digits - 1 - i)) & 0xFu];
    return tdm_buf_append(b, t, (size_t)digits + 2);
}

int js_gbnf_lit_cp(tdm_buf_t *b, uint32_t cp)
{
    switch (cp) {
    case '"': return tdm_buf_puts(b, "\\\"");
    case '\\': return tdm_buf_puts(b, "\\\\");
    case '\n': return tdm_buf_puts(b, "\\n");
    case '\t': return tdm_buf_puts(b, "\\t");
    case '\r': return tdm_buf_puts(b, "\\r");
    default: break;
    }
    if (cp < 0x20 || cp == 0x7F)
        return put_hex_escape(b, "\\x", cp, 2);
    if (cp < 0x80) {
        char ch = (char)cp;
        return tdm_buf_append(b, &ch, 1);
    }
    if (cp <= 0xFFFF)
        return put_hex_escape(b, "\\u", cp, 4);
    return put_hex_escape(b, "\\U", cp, 8);
}

int js_gbnf_lit(tdm_buf_t *b, const char *s, size_t n)
{
    tdm_buf_puts(b, "\"");
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (k == 0) { /* not UTF-8: the byte itself (callers pass UTF-8; jansson checks it) */
            cp = (unsigned char)s[i];
            k = 1;
        }
        js_gbnf_lit_cp(b, cp);
        i += k;
    }
    return tdm_buf_puts(b, "\"");
}

/* A code point inside a GBNF character class. */
void js_gbnf_class_cp(tdm_buf_t *b, uint32_t cp)
{
    /* GBNF (llama.cpp) classes know the escapes \\ \] \[ and \xHH, not \- or \^. */
    if (cp == ']' || cp == '[' || cp == '\\') {
        char e[3] = {'\\', (char)cp, 0};
        tdm_buf_puts(b, e);
    } else if (cp == '-' || cp == '^') {
        put_hex_escape(b, "\\x", cp, 2);
    } else if (cp == '"') {
        tdm_buf_puts(b, "\"");
    } else {
        js_gbnf_lit_cp(b, cp);
    }
}

/* ---- code point sets ---- */

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

bool js_cpset_add(cpset_t *s, uint32_t lo, uint32_t hi)
{
    if (s->n == CPSET_MAX)
        return false;
    s->lo[s->n] = lo;
    s->hi[s->n] = hi;
    s->n++;
    return true;
}

/* Sorts and merges overlapping or touching ranges. */
void js_cpset_normalize(cpset_t *s)
{
    uint32_t pairs[CPSET_MAX][2];
    bool sorted = true;
    for (size_t i = 0; i < s->n; i++) {
        pairs[i][0] = s->lo[i];
        pairs[i][1] = s->hi[i];
        sorted = sorted && (i == 0 || s->lo[i - 1] <= s->lo[i]);
    }
    if (!sorted) /* the automaton's classes come in order */
        qsort(pairs, s->n, sizeof pairs[0], cmp_range);
    size_t m = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (m > 0 && pairs[i][0] <= s->hi[m - 1] + 1) {
            if (pairs[i][1] > s->hi[m - 1])
                s->hi[m - 1] = pairs[i][1];
            continue;
        }
        s->lo[m] = pairs[i][0];
        s->hi[m] = pairs[i][1];
        m++;
    }
    s->n = m;
}

/* Copies the n ranges of src into dst (not the unused rest of the arrays). */
void js_cpset_copy(cpset_t *dst, const cpset_t *src)
{
    dst->n = src->n;
    memcpy(dst->lo, src->lo, src->n * sizeof *src->lo);
    memcpy(dst->hi, src->hi, src->n * sizeof *src->hi);
}

/* Complement within [0, CP_MAX] of a normalized set. */
void js_cpset_negate(cpset_t *s)
{
    cpset_t t;
    t.n = 0;
    uint32_t next = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->lo[i] > next)
            js_cpset_add(&t, next, s->lo[i] - 1);
        next = s->hi[i] + 1;
    }
    if (next <= CP_MAX && (s->n == 0 || s->hi[s->n - 1] < CP_MAX))
        js_cpset_add(&t, next, CP_MAX);
    js_cpset_copy(s, &t);
}

bool js_cpset_has(const cpset_t *s, uint32_t cp)
{
    for (size_t i = 0; i < s->n; i++)
        if (cp >= s->lo[i] && cp <= s->hi[i])
            return true;
    return false;
}

/* Removes [lo, hi] from a normalized set (in place: the ranges it overlaps, i .. j - 1, give
 * way to their parts outside it; past CPSET_MAX ranges the last ones are dropped). */
void js_cpset_remove(cpset_t *s, uint32_t lo, uint32_t hi)
{
    size_t i = 0, j, k = 0;
    while (i < s->n && s->hi[i] < lo)
        i++;
    for (j = i; j < s->n && s->lo[j] <= hi;)
        j++;
    if (i == j)
        return;
    uint32_t keep_lo[2], keep_hi[2];
    if (s->lo[i] < lo)
        keep_lo[k] = s->lo[i], keep_hi[k++] = lo - 1;
    if (s->hi[j - 1] > hi)
        keep_lo[k] = hi + 1, keep_hi[k++] = s->hi[j - 1];
    if (k > CPSET_MAX - i)
        k = CPSET_MAX - i;
    size_t tail = s->n - j;
    if (tail > CPSET_MAX - i - k)
        tail = CPSET_MAX - i - k;
    memmove(s->lo + i + k, s->lo + j, tail * sizeof *s->lo);
    memmove(s->hi + i + k, s->hi + j, tail * sizeof *s->hi);
    memcpy(s->lo + i, keep_lo, k * sizeof *keep_lo);
    memcpy(s->hi + i, keep_hi, k * sizeof *keep_hi);
    s->n = i + k + tail;
}

/* Appends a GBNF class (or a one-character literal) for a normalized, non-empty set. */
static void set_emit_class(tdm_buf_t *b, const cpset_t *s)
{
    if (s->n == 1 && s->lo[0] == s->hi[0]) {
        tdm_buf_puts(b, "\"");
        js_gbnf_lit_cp(b, s->lo[0]);
        tdm_buf_puts(b, "\"");
        return;
    }
    cpset_t t;
    js_cpset_copy(&t, s);
    bool neg = t.n > 0 && t.hi[t.n - 1] == CP_MAX;
    if (neg)
        js_cpset_negate(&t);
    tdm_buf_puts(b, neg ? "[^" : "[");
    for (size_t i = 0; i < t.n; i++) {
        js_gbnf_class_cp(b, t.lo[i]);
        if (t.hi[i] != t.lo[i]) {
            if (t.hi[i] > t.lo[i] + 1)
                tdm_buf_puts(b, "-");
            js_gbnf_class_cp(b, t.hi[i]);
        }
    }
    tdm_buf_puts(b, "]");
}

/* The json.dumps escape of a control character or of `"` / `\`. */
static void json_escape_lit(tdm_buf_t *b, uint32_t cp)
{
    static const char short_esc[] = "btn\0fr"; /* 8..13; \v (11) has no short form */
    static const char hex[] = "0123456789abcdef";
    char t[10] = {'"', '\\', '\\', 0};
    size_t n = 3;
    if (cp == '"' || cp == '\\') {
        t[n++] = '\\';
        t[n++] = (char)cp;
    } else if (cp >= 8 && cp <= 13 && short_esc[cp - 8]) {
        t[n++] = short_esc[cp - 8];
    } else {
        t[n++] = 'u';
        for (int i = 3; i >= 0; i--)
            t[n++] = hex[cp >> (4 * i) & 0xFu];
    }
    t[n++] = '"';
    tdm_buf_append(b, t, n);
}

/* JSON mode: the set's characters as they appear inside a JSON string. */
void js_cpset_emit_json(tdm_buf_t *b, const cpset_t *s)
{
    cpset_t plain;
    js_cpset_copy(&plain, s);
    js_cpset_remove(&plain, 0, 0x1F);
    js_cpset_remove(&plain, '"', '"');
    js_cpset_remove(&plain, '\\', '\\');
    tdm_buf_t alts = TDM_BUF_INIT;
    int n_alts = 0;
    if (plain.n > 0) {
        set_emit_class(&alts, &plain);
        n_alts++;
    }
    bool low[(uint32_t)'\\' + 1] = {false}; /* the set's members up to '\\', from its ranges */
    for (size_t i = 0; i < s->n; i++)
        for (uint32_t cp = s->lo[i]; cp <= s->hi[i] && cp <= '\\'; cp++)
            low[cp] = true;
    bool all_ctl = true;
    for (uint32_t cp = 0; cp < 0x20; cp++)
        all_ctl = all_ctl && low[cp];
    if (all_ctl) {
        tdm_buf_puts(&alts, n_alts ? " | " : "");
        tdm_buf_puts(&alts, "\"\\\\\" [bfnrt] | \"\\\\u00\" [01] [0-9a-fA-F]");
        n_alts += 2;
    }
    for (uint32_t i = all_ctl ? 0x20 : 0; i < 0x22; i++) { /* the controls, '"', '\\' */
        uint32_t cp = i < 0x20 ? i : i == 0x20 ? '"' : '\\';
        if (low[cp]) {
            tdm_buf_puts(&alts, n_alts ? " | " : "");
            json_escape_lit(&alts, cp);
            n_alts++;
        }
    }
    if (n_alts > 1) {
        tdm_buf_puts(b, "( ");
        tdm_buf_puts(b, alts.data ? alts.data : "");
        tdm_buf_puts(b, " )");
    } else {
        tdm_buf_puts(b, alts.data ? alts.data : "");
    }
    if (alts.oom)
        b->oom = true;
    tdm_buf_free(&alts);
}

/* ---- the parser: each function appends GBNF for what it parsed and its length bounds ---- */

typedef struct rx_len {
    size_t min, max; /* characters; max JS_LEN_INF when unbounded */
} rx_len_t;

static size_t len_add(size_t a, size_t b)
{
    return (a == JS_LEN_INF || b == JS_LEN_INF || a + b < a) ? JS_LEN_INF : a + b;
}

static size_t len_mul(size_t a, size_t k)
{
    if (a == 0 || k == 0)
        return 0;
    if (a == JS_LEN_INF || k == JS_LEN_INF || a > JS_LEN_INF / k)
        return JS_LEN_INF;
    return a * k;
}

int js_rx_fail(rx_t *r, const char *what)
{
    return tdm_error_set(r->err, TDM_EINVALID, "%s (at offset %zu)", what, r->i);
}

/* Reads one UTF-8 character (a byte that is not UTF-8 is refused). */
int js_rx_char(rx_t *r, uint32_t *cp)
{
    size_t k = tdm_utf8_decode((const unsigned char *)r->s + r->i, r->n - r->i, cp);
    if (k == 0)
        return js_rx_fail(r, "invalid UTF-8");
    r->i += k;
    return 0;
}

static int rx_hex(rx_t *r, int digits, uint32_t *cp)
{
    uint32_t v = 0;
    for (int k = 0; k < digits; k++) {
        uint32_t ch = js_rx_peek(r);
        int d = ch >= '0' && ch <= '9'   ? (int)(ch - '0')
                : ch >= 'a' && ch <= 'f' ? (int)(ch - 'a' + 10)
                : ch >= 'A' && ch <= 'F' ? (int)(ch - 'A' + 10)
                                         : -1;
        if (d < 0)
            return js_rx_fail(r, "bad hexadecimal escape");
        v = v * 16 + (uint32_t)d;
        r->i++;
    }
    *cp = v;
    return 0;
}

/* \d \w \s and their negations into s; false when ch is not one of them. */
static bool class_escape(uint32_t ch, cpset_t *s)
{
    cpset_t t = {0};
    switch (ch | 0x20) {
    case 'd': js_cpset_add(&t, '0', '9'); break;
    case 'w':
        js_cpset_add(&t, '0', '9');
        js_cpset_add(&t, 'A', 'Z');
        js_cpset_add(&t, 'a', 'z');
        js_cpset_add(&t, '_', '_');
        break;
    case 's': /* ECMA-262's WhiteSpace and LineTerminator, Unicode ones included */
        js_cpset_add(&t, '\t', '\r');
        js_cpset_add(&t, ' ', ' ');
        js_cpset_add(&t, 0xA0, 0xA0);
        js_cpset_add(&t, 0x1680, 0x1680);
        js_cpset_add(&t, 0x2000, 0x200A);
        js_cpset_add(&t, 0x2028, 0x2029);
        js_cpset_add(&t, 0x202F, 0x202F);
        js_cpset_add(&t, 0x205F, 0x205F);
        js_cpset_add(&t, 0x3000, 0x3000);
        js_cpset_add(&t, 0xFEFF, 0xFEFF);
        break;
    default: return false;
    }
    js_cpset_normalize(&t);
    if (ch >= 'A' && ch <= 'Z')
        js_cpset_negate(&t);
    for (size_t i = 0; i < t.n; i++)
        js_cpset_add(s, t.lo[i], t.hi[i]);
    return true;
}

/* After a backslash: one character (*cp) or a class added to *s (*is_class). */
int js_rx_escape(rx_t *r, bool in_class, uint32_t *cp, cpset_t *s, bool *is_class)
{
    *is_class = false;
    if (js_rx_eof(r))
        return js_rx_fail(r, "trailing backslash");
    uint32_t ch = js_rx_peek(r);
    r->i++;
    if (class_escape(ch, s)) {
        *is_class = true;
        return 0;
    }
    switch (ch) {
    case 'n': *cp = '\n'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case '0': *cp = 0; return 0;
    case 'x': return rx_hex(r, 2, cp);
    case 'u': return rx_hex(r, 4, cp);
    case 'b':
        if (in_class) {
            *cp = '\b';
            return 0;
        }
        return js_rx_fail(r, "\\b (word boundary) not supported");
    default: break;
    }
    if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '1' && ch <= '9'))
        return js_rx_fail(r, "escape not supported (backreference, \\p, \\B, ...)");
    r->i--;
    return js_rx_char(r, cp);
}

/* One member of a class: a character, a range a-b, or an escape class. */
static int class_item(rx_t *r, cpset_t *s)
{
    uint32_t lo, hi;
    bool is_class = false;
    int rc = js_rx_peek(r) == '\\' ? (r->i++, js_rx_escape(r, true, &lo, s, &is_class))
                                   : js_rx_char(r, &lo);
    if (rc != 0 || is_class)
        return rc;
    hi = lo;
    if (js_rx_peek(r) == '-' && r->i + 1 < r->n && r->s[r->i + 1] != ']') {
        r->i++;
        bool hi_class = false;
        rc = js_rx_peek(r) == '\\' ? (r->i++, js_rx_escape(r, true, &hi, s, &hi_class))
                                   : js_rx_char(r, &hi);
        if (rc != 0)
            return rc;
        if (hi_class || hi < lo)
            return js_rx_fail(r, "bad range in character class");
    }
    if (!js_cpset_add(s, lo, hi))
        return js_rx_fail(r, "character class too large");
    return 0;
}

/* After '[': the class up to its ']'. */
int js_rx_class(rx_t *r, cpset_t *s)
{
    bool neg = js_rx_peek(r) == '^';
    if (neg)
        r->i++;
    bool first = true;
    while (!js_rx_eof(r) && (js_rx_peek(r) != ']' || first)) {
        if (js_rx_peek(r) == '[' && r->i + 1 < r->n && r->s[r->i + 1] == ':')
            return js_rx_fail(r, "POSIX classes ([:alpha:]) not supported");
        int rc = class_item(r, s);
        if (rc != 0)
            return rc;
        first = false;
    }
    if (js_rx_eof(r))
        return js_rx_fail(r, "unterminated character class");
    r->i++;
    js_cpset_normalize(s);
    if (neg)
        js_cpset_negate(s);
    if (s->n == 0)
        return js_rx_fail(r, "character class matches nothing");
    return 0;
}

static void set_emit(const rx_t *r, tdm_buf_t *b, const cpset_t *s)
{
    if (r->json)
        js_cpset_emit_json(b, s);
    else
        set_emit_class(b, s);
}

static int parse_alt(rx_t *r, tdm_buf_t *b, rx_len_t *len, bool top);

int js_rx_group_open(rx_t *r)
{
    if (js_rx_peek(r) == '?') {
        r->i++;
        if (js_rx_peek(r) == ':') {
            r->i++;
        } else if (js_rx_peek(r) == '<' || js_rx_peek(r) == 'P') {
            if (js_rx_peek(r) == 'P')
                r->i++;
            if (js_rx_peek(r) != '<' ||
                (r->i + 1 < r->n && (r->s[r->i + 1] == '=' || r->s[r->i + 1] == '!')))
                return js_rx_fail(r, "lookbehind not supported");
            while (!js_rx_eof(r) && js_rx_peek(r) != '>')
                r->i++;
            if (js_rx_eof(r))
                return js_rx_fail(r, "unterminated group name");
            r->i++;
        } else {
            return js_rx_fail(r, "group kind not supported (lookahead, flags, ...)");
        }
    }
    if (++r->depth > RX_MAX_DEPTH)
        return js_rx_fail(r, "groups nested too deep");
    return 0;
}

/* A group after '(' (its kind prefix), up to its ')'. */
static int parse_group(rx_t *r, tdm_buf_t *b, rx_len_t *len)
{
    int rc0 = js_rx_group_open(r);
    if (rc0 != 0)
        return rc0;
    tdm_buf_puts(b, "( ");
    int rc = parse_alt(r, b, len, false);
    r->depth--;
    if (rc != 0)
        return rc;
    if (js_rx_peek(r) != ')')
        return js_rx_fail(r, "missing )");
    r->i++;
    tdm_buf_puts(b, " )");
    return 0;
}

/* One atom: a character, class, '.', or group. */
static int parse_atom(rx_t *r, tdm_buf_t *b, rx_len_t *len)
{
    uint32_t ch = js_rx_peek(r);
    cpset_t s;
    s.n = 0;
    len->min = len->max = 1;
    if (ch == '(') {
        r->i++;
        return parse_group(r, b, len);
    }
    if (ch == '*' || ch == '+' || ch == '?' || ch == '{')
        return js_rx_fail(r, "nothing to repeat");
    if (ch == '^' || ch == '$')
        return js_rx_fail(r, "anchors are supported only at the ends of the pattern");
    r->i++;
    if (ch == '[') {
        int rc = js_rx_class(r, &s);
        if (rc != 0)
            return rc;
    } else if (ch == '.') {
        js_cpset_add(&s, 0, CP_MAX);
        js_cpset_remove(&s, '\n', '\n');
    } else {
        uint32_t cp = ch;
        bool is_class = false;
        int rc =
            ch == '\\' ? js_rx_escape(r, false, &cp, &s, &is_class) : (r->i--, js_rx_char(r, &cp));
        if (rc != 0)
            return rc;
        if (!is_class)
            js_cpset_add(&s, cp, cp);
        js_cpset_normalize(&s);
    }
    set_emit(r, b, &s);
    return 0;
}

bool js_rx_number(rx_t *r, size_t *v)
{
    size_t start = r->i, x = 0;
    while (js_rx_peek(r) >= '0' && js_rx_peek(r) <= '9' && r->i - start < 6) {
        x = x * 10 + (js_rx_peek(r) - '0');
        r->i++;
    }
    *v = x;
    return r->i > start;
}

/* A quantifier after an atom, if any: sets *lo / *hi (JS_LEN_INF) and appends its GBNF. */
static int parse_quant(rx_t *r, tdm_buf_t *b, size_t *lo, size_t *hi)
{
    uint32_t ch = js_rx_peek(r);
    *lo = *hi = 1;
    if (ch == '*' || ch == '+' || ch == '?') {
        r->i++;
        *lo = ch == '+';
        *hi = ch == '?' ? 1 : JS_LEN_INF;
        char q[2] = {(char)ch, 0};
        tdm_buf_puts(b, q);
    } else if (ch == '{') {
        r->i++;
        if (!js_rx_number(r, lo))
            return js_rx_fail(r, "bad {m,n} quantifier");
        *hi = *lo;
        if (js_rx_peek(r) == ',') {
            r->i++;
            *hi = js_rx_number(r, hi) ? *hi : JS_LEN_INF;
        }
        if (js_rx_peek(r) != '}' || *hi < *lo)
            return js_rx_fail(r, "bad {m,n} quantifier");
        if (*lo > TDM_GRAMMAR_MAX_REPEAT || (*hi != JS_LEN_INF && *hi > TDM_GRAMMAR_MAX_REPEAT)) {
            char what[96];
            snprintf(what, sizeof what, "repetition count %zu is above the limit of %u",
                     *lo > TDM_GRAMMAR_MAX_REPEAT ? *lo : *hi, TDM_GRAMMAR_MAX_REPEAT);
            return js_rx_fail(r, what);
        }
        r->i++;
        if (*hi == JS_LEN_INF)
            tdm_buf_printf(b, "{%zu,}", *lo);
        else if (*hi == *lo)
            tdm_buf_printf(b, "{%zu}", *lo);
        else
            tdm_buf_printf(b, "{%zu,%zu}", *lo, *hi);
    } else {
        return 0;
    }
    if (js_rx_peek(r) == '?')
        r->i++; /* lazy: same strings */
    else if (js_rx_peek(r) == '+')
        return js_rx_fail(r, "possessive quantifiers not supported");
    if (js_rx_peek(r) == '*' || js_rx_peek(r) == '+' || js_rx_peek(r) == '?' ||
        js_rx_peek(r) == '{')
        return js_rx_fail(r, "nothing to repeat");
    return 0;
}

#define RX_MAX_PIECES 64

/* The pieces (atom + quantifier) of a top-level sequence, for clamp_lengths. */
typedef struct rx_piece {
    size_t atom_start, atom_end, end; /* offsets in the sequence's GBNF text */
    size_t lo, hi;                    /* its quantifier */
    rx_len_t atom;                    /* the atom's length bounds */
} rx_piece_t;

typedef struct rx_seq {
    rx_piece_t p[RX_MAX_PIECES];
    size_t n;
    bool overflow;
} rx_seq_t;

/* A sequence up to '|', ')' or the end; top: anchors allowed at its ends (*at_start,
 * *at_end). q (when not NULL) gets its pieces. */
static int parse_seq(rx_t *r, tdm_buf_t *b, rx_len_t *len, bool top, bool *at_start, bool *at_end,
                     rx_seq_t *q)
{
    len->min = len->max = 0;
    *at_start = *at_end = false;
    if (top && js_rx_peek(r) == '^') {
        r->i++;
        *at_start = true;
    }
    bool any = false;
    while (!js_rx_eof(r) && js_rx_peek(r) != '|' && js_rx_peek(r) != ')') {
        if (top && js_rx_peek(r) == '$' && (r->i + 1 == r->n || r->s[r->i + 1] == '|')) {
            r->i++;
            *at_end = true;
            break;
        }
        rx_piece_t pc;
        tdm_buf_puts(b, any ? " " : "");
        pc.atom_start = b->len;
        int rc = parse_atom(r, b, &pc.atom);
        pc.atom_end = b->len;
        if (rc == 0)
            rc = parse_quant(r, b, &pc.lo, &pc.hi);
        if (rc != 0)
            return rc;
        pc.end = b->len;
        if (q && q->n < RX_MAX_PIECES)
            q->p[q->n++] = pc;
        else if (q)
            q->overflow = true;
        len->min = len_add(len->min, len_mul(pc.atom.min, pc.lo));
        len->max = len_add(len->max, len_mul(pc.atom.max, pc.hi));
        any = true;
    }
    if (!any)
        tdm_buf_puts(b, "\"\"");
    return 0;
}

/* Builds the length bounds [lo, hi] into an anchored sequence whose pieces all have a fixed
 * length but one, a single character repeated (`^[a-z]+$` with maxLength 10 becomes
 * `[a-z]{1,10}`): exact, so the bounds need no intersection. Returns false (out untouched)
 * when the sequence has another shape or no length fits. */
static bool clamp_lengths(const tdm_buf_t *t, const rx_seq_t *q, size_t lo, size_t hi,
                          tdm_buf_t *out, rx_len_t *len)
{
    size_t fixed = 0, var = RX_MAX_PIECES;
    for (size_t i = 0; i < q->n && !q->overflow; i++) {
        const rx_piece_t *p = &q->p[i];
        if (p->atom.min == p->atom.max && p->lo == p->hi && p->atom.max != JS_LEN_INF)
            fixed = len_add(fixed, len_mul(p->atom.min, p->lo));
        else if (p->atom.min == 1 && p->atom.max == 1 && var == RX_MAX_PIECES)
            var = i;
        else
            return false;
    }
    if (q->overflow || var == RX_MAX_PIECES || fixed == JS_LEN_INF ||
        (hi != JS_LEN_INF && hi < fixed))
        return false;
    const rx_piece_t *v = &q->p[var];
    size_t vlo = lo > fixed ? lo - fixed : 0, vhi = hi == JS_LEN_INF ? JS_LEN_INF : hi - fixed;
    vlo = vlo > v->lo ? vlo : v->lo;
    vhi = vhi < v->hi ? vhi : v->hi;
    if (vlo > vhi)
        return false;
    char atom[4096];
    if (v->atom_end - v->atom_start >= sizeof atom)
        return false;
    memcpy(atom, t->data + v->atom_start, v->atom_end - v->atom_start);
    atom[v->atom_end - v->atom_start] = 0;
    tdm_buf_append(out, t->data, v->atom_start);
    js_rep(out, atom, vlo, vhi);
    tdm_buf_append(out, t->data + v->end, t->len - v->end);
    len->min = fixed + vlo;
    len->max = len_add(fixed, vhi);
    return true;
}

/* One top-level alternative in JSON mode: the length bounds built in when that is exact
 * (clamp_lengths), then any text on its unanchored sides. */
static void emit_branch(rx_t *r, tdm_buf_t *b, tdm_buf_t *seq, const rx_seq_t *q, bool only,
                        bool at_start, bool at_end, rx_len_t *l)
{
    tdm_buf_t clamped = TDM_BUF_INIT;
    bool clamp =
        r->json && only && at_start && at_end && (r->want_lo > 0 || r->want_hi != JS_LEN_INF);
    if (clamp && seq->data && clamp_lengths(seq, q, r->want_lo, r->want_hi, &clamped, l)) {
        tdm_buf_free(seq);
        *seq = clamped;
    }
    bool open_start = r->json && !at_start, open_end = r->json && !at_end;
    tdm_buf_printf(b, "%s%s%s%s%s", open_start ? r->char_rule : "", open_start ? "* " : "",
                   seq->data ? seq->data : "", open_end ? " " : "", open_end ? r->char_rule : "");
    if (open_end)
        tdm_buf_puts(b, "*");
    if (seq->oom)
        b->oom = true;
    if (open_start || open_end)
        l->max = JS_LEN_INF;
}

/* Alternatives separated by '|'. At the top level in JSON mode an unanchored side of an
 * alternative admits any string content there. */
static int parse_alt(rx_t *r, tdm_buf_t *b, rx_len_t *len, bool top)
{
    bool first = true;
    len->min = JS_LEN_INF;
    len->max = 0;
    for (;;) {
        bool at_start, at_end;
        rx_len_t l;
        tdm_buf_t seq = TDM_BUF_INIT;
        rx_seq_t q;
        q.n = 0;
        q.overflow = false;
        int rc = parse_seq(r, &seq, &l, top, &at_start, &at_end, top ? &q : NULL);
        tdm_buf_puts(b, first ? "" : " | ");
        if (top)
            emit_branch(r, b, &seq, &q, first && js_rx_peek(r) != '|', at_start, at_end, &l);
        else
            tdm_buf_puts(b, seq.data ? seq.data : "");
        tdm_buf_free(&seq);
        if (rc != 0)
            return rc;
        len->min = l.min < len->min ? l.min : len->min;
        len->max = l.max > len->max ? l.max : len->max;
        first = false;
        if (js_rx_peek(r) != '|')
            return 0;
        r->i++;
    }
}

int js_regex_expr(const char *re, size_t len, bool json_mode, const char *char_rule, size_t want_lo,
                  size_t want_hi, tdm_buf_t *expr, size_t *min_len, size_t *max_len,
                  tdm_error_t *err)
{
    rx_t r = {re, len, 0, json_mode, char_rule, err, 0, want_lo, want_hi};
    rx_len_t l;
    tdm_buf_puts(expr, "( ");
    int rc = parse_alt(&r, expr, &l, true);
    if (rc == 0 && !js_rx_eof(&r))
        rc = js_rx_fail(&r, "unmatched )");
    if (rc != 0)
        return rc;
    tdm_buf_puts(expr, " )");
    if (expr->oom)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    *min_len = l.min;
    *max_len = l.max;
    return 0;
}

static bool rule_name_ok(const char *rule)
{
    if (!rule || !*rule || strlen(rule) >= JS_PREFIX_MAX)
        return false;
    for (const char *p = rule; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-'))
            return false;
    return true;
}

int tdm_regex_to_gbnf_rule(const char *re, size_t len, const char *rule, tdm_buf_t *out,
                           tdm_error_t *err)
{
    if (!rule_name_ok(rule))
        return tdm_error_set(err, TDM_EINVALID, "rule name '%s' is not [a-zA-Z0-9-]+",
                             rule ? rule : "(null)");
    tdm_buf_t expr = TDM_BUF_INIT;
    size_t lo, hi;
    int rc = js_regex_expr(re, len, false, NULL, 0, JS_LEN_INF, &expr, &lo, &hi, err);
    if (rc == 0) {
        tdm_buf_printf(out, "%s ::= %s\n", rule, expr.data);
        if (out->oom)
            rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    if (rc != 0 && rc != TDM_ERESOURCE)
        tdm_error_prefix(err, rc, "regex: ");
    tdm_buf_free(&expr);
    return rc;
}

static bool is_utf8(const char *s)
{
    for (size_t k = 0, n = strlen(s); k < n;) {
        uint32_t cp;
        size_t step = tdm_utf8_decode((const unsigned char *)s + k, n - k, &cp);
        if (step == 0)
            return false;
        k += step;
    }
    return true;
}

int tdm_choice_to_gbnf(const char *const *choices, size_t n, tdm_buf_t *out, tdm_error_t *err)
{
    if (n == 0)
        return tdm_error_set(err, TDM_EINVALID, "choice: the list is empty");
    for (size_t i = 0; i < n; i++) {
        if (!choices[i])
            return tdm_error_set(err, TDM_EINVALID, "choice: entry %zu is null", i);
        if (!is_utf8(choices[i]))
            return tdm_error_set(err, TDM_EINVALID, "choice: entry %zu is not UTF-8", i);
    }
    tdm_buf_puts(out, "root ::= ");
    for (size_t i = 0; i < n; i++) {
        tdm_buf_puts(out, i ? " | " : "");
        js_gbnf_lit(out, choices[i], strlen(choices[i]));
    }
    tdm_buf_puts(out, "\n");
    return out->oom ? tdm_error_set(err, TDM_ERESOURCE, "out of memory") : 0;
}
