/* json_schema_string.c - JSON Schema strings (minLength, maxLength, pattern, format) and the
 * literal values of enum / const, written as Python's json.dumps(..., ensure_ascii=False)
 * writes them (the form instances are compared in).
 *
 * Formats enforced: date, time, date-time (RFC 3339 full-date / full-time, `T` or `t`),
 * uuid, email (dot-atom local part @ host name labels), uri (scheme ":" then URI
 * characters), hostname (RFC 1123 labels), ipv4 (dotted quad 0-255), ipv6 (RFC 4291 text
 * forms, no zone), duration (JSON Schema's ISO 8601 subset). The other formats JSON Schema
 * defines are refused; any other name is a custom format, an annotation, and ignored. A length
 * bound beside a pattern is built into the pattern when that is exact (an anchored pattern with one
 * repeated character class: `^[a-z]+$` with maxLength 10), kept when the pattern already implies
 * it, refused otherwise; a format with another string keyword is refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"
#include "regex_internal.h"

#define HOST_LABEL "[a-zA-Z0-9] ( [a-zA-Z0-9\\x2D]{0,61} [a-zA-Z0-9] )?"
#define D28 "( \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8] )"
#define D30 "( \"0\" [1-9] | [12] [0-9] | \"30\" )"
#define D31 "( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )"
/* leap years: divisible by 4, and not by 100 unless by 400 */
#define LEAP                                                                                       \
    "( [0-9]{2} ( [02468] [48] | [13579] [26] | [2468] \"0\" ) | ( [02468] [048] | [13579] "       \
    "[26] ) \"00\" )"
#define DATE                                                                                       \
    "( [0-9]{4} \"-\" ( ( \"0\" [13578] | \"1\" [02] ) \"-\" " D31 " | ( \"0\" [469] | "           \
    "\"11\" ) \"-\" " D30 " | \"02-\" " D28 " ) | " LEAP " \"-02-29\" )"
/* a leap second (:60) only where it is 23:59:60 UTC that can be read off the text alone: a zero
 * offset (RFC 3339 5.7; other offsets would need the clock arithmetic, so they are rejected) */
#define TIME                                                                                       \
    "( ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]+ )? ( [zZ] " \
    "| [+\\x2D] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] ) | \"23:59:60\" ( \".\" [0-9]+ "   \
    ")? "                                                                                          \
    "( [zZ] | [+\\x2D] \"00:00\" ) )"
#define OCTET "( \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9] )"
#define IPV4 OCTET " \".\" " OCTET " \".\" " OCTET " \".\" " OCTET
/* RFC 4291 section 2.2 as RFC 3986's IPv6address writes it: eight groups of 1-4 hex digits,
 * one "::" standing for one or more zero groups, the last two groups possibly a dotted quad */
#define H16 "[0-9a-fA-F]{1,4}"
#define H16C "( " H16 " \":\" )"
#define LS32 "( " H16 " \":\" " H16 " | " IPV4 " )"
#define IPV6                                                                                       \
    H16C "{6} " LS32 " | \"::\" " H16C "{5} " LS32 " | ( " H16 " )? \"::\" " H16C "{4} " LS32      \
         " | ( " H16C "{0,1} " H16 " )? \"::\" " H16C "{3} " LS32 " | ( " H16C "{0,2} " H16        \
         " )? \"::\" " H16C "{2} " LS32 " | ( " H16C "{0,3} " H16 " )? \"::\" " H16C " " LS32      \
         " | ( " H16C "{0,4} " H16 " )? \"::\" " LS32 " | ( " H16C "{0,5} " H16 " )? \"::\" " H16  \
         " | ( " H16C "{0,6} " H16 " )? \"::\""
/* JSON Schema 2020-12 appendix A (ISO 8601 durations): P, then years months days and a time
 * part of hours minutes seconds, each unit present only with its neighbours in order, or
 * weeks alone; digits only (no fractions) */
#define DUR_SECOND "[0-9]+ \"S\""
#define DUR_MINUTE "[0-9]+ \"M\" ( " DUR_SECOND " )?"
#define DUR_HOUR "[0-9]+ \"H\" ( " DUR_MINUTE " )?"
#define DUR_TIME "\"T\" ( " DUR_HOUR " | " DUR_MINUTE " | " DUR_SECOND " )"
#define DUR_DAY "[0-9]+ \"D\""
#define DUR_MONTH "[0-9]+ \"M\" ( " DUR_DAY " )?"
#define DUR_YEAR "[0-9]+ \"Y\" ( " DUR_MONTH " )?"
#define DURATION                                                                                   \
    "\"P\" ( ( " DUR_YEAR " | " DUR_MONTH " | " DUR_DAY " ) ( " DUR_TIME " )? | " DUR_TIME         \
    " | [0-9]+ \"W\" )"

static const struct {
    const char *name, *content;
} k_formats[] = {
    {"date", DATE},
    {"time", TIME},
    {"date-time", DATE " [Tt] " TIME},
    {"uuid", "[0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} "
             "\"-\" [0-9a-fA-F]{12}"},
    {"email", "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~\\x2D]+ ( \".\" [a-zA-Z0-9!#$%&'*+/=?^_`{|}~\\x2D]+ )* "
              "\"@\" " HOST_LABEL " ( \".\" " HOST_LABEL " )*"},
    {"uri", "[a-zA-Z] [a-zA-Z0-9+.\\x2D]* \":\" [^\\x00-\\x20\"\\\\<>{}|^`\\x7F]*"},
    {"hostname", HOST_LABEL " ( \".\" " HOST_LABEL " )*"},
    {"ipv4", IPV4},
    {"ipv6", IPV6},
    {"duration", DURATION},
};

/* The other formats JSON Schema (drafts 4 to 2020-12) defines: compiled from their regexes
 * (json_schema_format.c) through the automaton, or refused (no exact grammar: IDNA's rules,
 * ECMA-262's nested groups). Any name in neither list is a custom format, an annotation
 * (2020-12 section 7.2.3): compiled as if `format` were absent. */
static const char *const k_formats_regex[] = {
    "uri-reference",         "iri",          "iri-reference",
    "uri-template",          "json-pointer", "host-name",
    "relative-json-pointer", "ip-address",   NULL};
static const char *const k_formats_refused[] = {"idn-email", "idn-hostname", "regex", NULL};

/* A non-negative integer keyword (minLength, ...) into *v; absent leaves *v. */
static int get_count(js_ctx_t *c, json_t *s, const char *ptr, const char *key, size_t *v)
{
    json_t *x = json_object_get(s, key);
    if (!x)
        return 0;
    double d = json_is_integer(x) ? (double)json_integer_value(x)
               : json_is_real(x)  ? json_real_value(x)
                                  : -1;
    if (d < 0 || d != floor(d) || d > 1e9)
        return js_fail(c, ptr, key, "must be a non-negative integer");
    if (d > JS_COUNT_MAX)
        return js_fail(c, ptr, key, "%.0f is above the limit of %u", d, JS_COUNT_MAX);
    *v = (size_t)d;
    return 0;
}

bool js_format_custom(json_t *f)
{
    if (!json_is_string(f))
        return false;
    for (size_t i = 0; i < sizeof k_formats / sizeof k_formats[0]; i++)
        if (strcmp(k_formats[i].name, json_string_value(f)) == 0)
            return false;
    for (size_t i = 0; k_formats_refused[i]; i++)
        if (strcmp(k_formats_refused[i], json_string_value(f)) == 0)
            return false;
    for (size_t i = 0; k_formats_regex[i]; i++)
        if (strcmp(k_formats_regex[i], json_string_value(f)) == 0)
            return false;
    return true;
}

/* `format`: the content expression of a supported format into *content, or NULL for a custom
 * format (an annotation); fails on a defined format that is not supported. */
static int format_content(js_ctx_t *c, json_t *s, const char *ptr, const char **content)
{
    json_t *f = json_object_get(s, "format");
    *content = NULL;
    if (!f)
        return 0;
    if (!json_is_string(f))
        return js_fail(c, ptr, "format", "must be a string");
    if (js_format_custom(f))
        return 0;
    for (size_t i = 0; i < sizeof k_formats / sizeof k_formats[0]; i++) {
        if (strcmp(k_formats[i].name, json_string_value(f)) == 0) {
            *content = k_formats[i].content;
            return 0;
        }
    }
    for (size_t i = 0; k_formats_regex[i]; i++) {
        if (strcmp(k_formats_regex[i], json_string_value(f)) == 0) {
            *content = ""; /* through its regex only */
            return 0;
        }
    }
    return js_fail(c, ptr, "format", "'%s' not supported", json_string_value(f));
}

/* The strings matching every regex of res[0..n_pos) (the format's, the pattern), none of
 * res[n_pos..n) (a `not`'s pattern or format) and none of names[n_names], with lo to hi
 * characters: their automaton times a counter of characters (exact), the start rule into
 * body. key names the keyword blamed when the automaton is too large. */
static int string_dfa(js_ctx_t *c, const char *ptr, const char *key, const char *const *res,
                      size_t n, size_t n_pos, const char *const *names, size_t n_names, size_t lo,
                      size_t hi, tdm_buf_t *body)
{
    js_dfa_t *d = NULL;
    size_t bad;
    tdm_error_t e;
    char rule[JS_NAME_MAX];
    int rc = js_dfa_get(c, res, n, names, n_names, &d, &bad, &e);
    if (rc == TDM_ERESOURCE)
        return js_oom(c);
    if (rc != 0)
        return js_fail(c, ptr, key, "%s", e.msg);
    rc = js_dfa_emit(c, d, (1u << n_pos) - 1, lo, hi, rule); /* res[n_pos..n) must not match */
    js_dfa_release(c, &d);
    if (rc == TDM_EINVALID) {
        snprintf(e.msg, sizeof e.msg, "%s", c->err->msg);
        return js_fail(c, ptr, key, "%s", e.msg);
    }
    if (rc == 0 && !rule[0])
        return js_fail_unsat(c, ptr, key, "no string matches (format, pattern, lengths, not)");
    if (rc == 0)
        tdm_buf_puts(body, rule);
    return rc;
}

/* The strings `not: {enum / const}` excludes (all strings: compile_object_schema sends only
 * that form here) into names (caller frees); *n how many. */
static const char **not_names(json_t *s, size_t *n)
{
    json_t *no = json_object_get(s, "not"), *vals = json_object_get(no, "enum"), *e;
    json_t *one = json_object_get(no, "const");
    const char **names = calloc(json_array_size(vals) + 2, sizeof *names);
    size_t i;
    *n = 0;
    if (!names)
        return NULL;
    if (json_is_string(one))
        names[(*n)++] = json_string_value(one);
    json_array_foreach(vals, i, e) if (json_is_string(e)) names[(*n)++] = json_string_value(e);
    return names;
}

/* A format beside a pattern or length bounds, a format with no GBNF form, or strings a `not`
 * excludes: through the automaton of the format's regex, the pattern and the excluded names. */
static int string_auto(js_ctx_t *c, json_t *s, const char *ptr, size_t lo, size_t hi,
                       tdm_buf_t *body)
{
    json_t *p = json_object_get(s, "pattern"), *f = json_object_get(s, "format");
    if (p && !json_is_string(p))
        return js_fail(c, ptr, "pattern", "must be a string");
    tdm_buf_t rx = TDM_BUF_INIT;
    const char *res[3];
    size_t n = 0, n_names = 0;
    int rc = 0;
    if (json_is_string(f) && !js_format_custom(f)) {
        rc = js_format_regex(json_string_value(f), &rx);
        if (rc == 0 && rx.oom)
            rc = TDM_ERESOURCE;
        res[n++] = rx.data;
    }
    if (p)
        res[n++] = json_string_value(p);
    size_t n_pos = n; /* the regexes a string must match; then the one it must not */
    json_t *no = json_object_get(s, "not"), *np = json_object_get(no, "pattern");
    json_t *nf = json_object_get(no, "format");
    tdm_buf_t nrx = TDM_BUF_INIT;
    if (rc == 0 && json_is_string(np)) {
        res[n++] = json_string_value(np);
    } else if (rc == 0 && json_is_string(nf) && !js_format_custom(nf)) {
        rc = js_format_regex(json_string_value(nf), &nrx);
        rc = rc == 0 && nrx.oom ? TDM_ERESOURCE : rc;
        res[n++] = nrx.data;
    }
    const char **names = not_names(s, &n_names);
    const char *key = p                   ? "pattern"
                      : lo                ? "minLength"
                      : hi != JS_LEN_INF  ? "maxLength"
                      : n_names && n == 0 ? "not"
                                          : "format";
    if (!names)
        rc = TDM_ERESOURCE;
    if (rc == 0)
        rc = string_dfa(c, ptr, key, res, n, n_pos, names, n_names, lo, hi, body);
    else
        rc = rc == TDM_ERESOURCE ? js_oom(c) : js_fail(c, ptr, "format", "no regex form");
    free(names);
    tdm_buf_free(&rx);
    tdm_buf_free(&nrx);
    return rc;
}

/* The end of the group that starts at re[i] ('('), or 0 when it does not close. */
static size_t group_end(const char *re, size_t i)
{
    int depth = 0;
    bool in_class = false;
    for (; re[i]; i++) {
        if (re[i] == '\\' && re[i + 1]) {
            i++;
        } else if (in_class) {
            in_class = re[i] != ']';
        } else if (re[i] == '[') {
            in_class = true;
        } else if (re[i] == '(') {
            depth++;
        } else if (re[i] == ')' && --depth == 0) {
            return i;
        }
    }
    return 0;
}

/* A pattern regex.c does not read, through the automaton: anchors anywhere, and lookaheads
 * right after a leading ^ (`^(?=.*[A-Z])(?!x).{8,}$`), each one a regex of its own anchored
 * there that the string must match (?=) or must not match (?!), the rest another. Refused
 * with why_not (regex.c's message) when the automaton cannot read it either. */
static int pattern_auto(js_ctx_t *c, const char *ptr, const char *re, size_t lo, size_t hi,
                        tdm_buf_t *body, const char *why_not)
{
    tdm_buf_t part[8];
    const char *pos[8], *neg[8], *res[8];
    size_t n_pos = 0, n_neg = 0, i = 1, n = 0;
    for (size_t k = 0; k < 8; k++)
        part[k] = (tdm_buf_t)TDM_BUF_INIT;
    while (re[0] == '^' && strncmp(re + i, "(?", 2) == 0 &&
           (re[i + 2] == '=' || re[i + 2] == '!') && n < 7) {
        size_t end = group_end(re, i);
        if (end == 0)
            break;
        tdm_buf_printf(&part[n], "^(?:%.*s)", (int)(end - i - 3), re + i + 3);
        if (re[i + 2] == '=')
            pos[n_pos++] = part[n].data;
        else
            neg[n_neg++] = part[n].data;
        n++;
        i = end + 1;
    }
    tdm_buf_printf(&part[n], "%s%s", n ? "^" : "", n ? re + i : re);
    pos[n_pos++] = part[n].data;
    bool oom = false;
    for (size_t k = 0; k <= n; k++)
        oom = oom || part[k].oom;
    for (size_t k = 0; k < n_pos; k++)
        res[k] = pos[k];
    for (size_t k = 0; k < n_neg; k++)
        res[n_pos + k] = neg[k];
    js_dfa_t *d = NULL;
    size_t bad;
    tdm_error_t e;
    int rc = oom ? TDM_ERESOURCE : js_dfa_get(c, res, n_pos + n_neg, NULL, 0, &d, &bad, &e);
    js_dfa_release(c, &d);
    if (rc == 0)
        rc = string_dfa(c, ptr, "pattern", res, n_pos + n_neg, n_pos, NULL, 0, lo, hi, body);
    else if (rc == TDM_EINVALID)
        rc = js_fail(c, ptr, "pattern", "%s", why_not);
    else
        rc = js_oom(c);
    for (size_t k = 0; k <= n; k++)
        tdm_buf_free(&part[k]);
    return rc;
}

/* `pattern` with optional length bounds: the content expression into body. */
static int pattern_content(js_ctx_t *c, json_t *s, const char *ptr, size_t lo, size_t hi,
                           tdm_buf_t *body)
{
    json_t *p = json_object_get(s, "pattern");
    if (!json_is_string(p))
        return js_fail(c, ptr, "pattern", "must be a string");
    char ch[JS_NAME_MAX];
    int rc = js_prim(c, JS_PRIM_CHAR, ch);
    if (rc != 0)
        return rc;
    size_t min_len, max_len, start = body->len;
    tdm_error_t e;
    rc = js_regex_expr(json_string_value(p), json_string_length(p), true, ch, lo, hi, body,
                       &min_len, &max_len, &e);
    if (rc == TDM_ERESOURCE)
        return js_oom(c);
    if (rc != 0) { /* anchors inside, leading lookaheads: the automaton may read it */
        if (body->data)
            body->data[body->len = start] = 0;
        return pattern_auto(c, ptr, json_string_value(p), lo, hi, body, e.msg);
    }
    if (min_len >= lo && max_len <= hi)
        return 0;
    body->len = start; /* the bounds are not implied: the automaton times a length counter */
    if (body->data)
        body->data[start] = 0;
    const char *re = json_string_value(p);
    return string_dfa(c, ptr, hi != JS_LEN_INF ? "maxLength" : "minLength", &re, 1, 1, NULL, 0, lo,
                      hi, body);
}

int js_string(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    size_t lo = 0, hi = JS_LEN_INF;
    int rc = get_count(c, s, ptr, "minLength", &lo);
    if (rc == 0)
        rc = get_count(c, s, ptr, "maxLength", &hi);
    if (rc != 0)
        return rc;
    const char *format;
    if ((rc = format_content(c, s, ptr, &format)) != 0)
        return rc;
    bool has_pattern = json_object_get(s, "pattern"), has_format = format != NULL;
    bool excl = json_object_get(s, "not") != NULL; /* not: {enum} of strings */
    if (!excl && !has_pattern && !has_format && lo == 0 && hi == JS_LEN_INF)
        return js_prim(c, JS_PRIM_STRING, name);
    bool via_dfa =
        excl || (has_format && (has_pattern || lo != 0 || hi != JS_LEN_INF || !format[0]));
    if (lo > hi)
        return js_fail_unsat(c, ptr, "minLength", "greater than maxLength");
    tdm_buf_t body = TDM_BUF_INIT;
    char ch[JS_NAME_MAX];
    tdm_buf_puts(&body, "\"\\\"\" ");
    if (via_dfa) {
        rc = string_auto(c, s, ptr, lo, hi, &body);
    } else if (has_format) {
        tdm_buf_printf(&body, "( %s )", format);
    } else if (has_pattern) {
        rc = pattern_content(c, s, ptr, lo, hi, &body);
    } else if ((rc = js_prim(c, JS_PRIM_CHAR, ch)) == 0) {
        js_rep(&body, ch, lo, hi);
    }
    tdm_buf_puts(&body, " \"\\\"\"");
    if (rc == 0) {
        js_new_name(c, name);
        rc = body.oom ? js_oom(c) : js_emit_rule(c, name, body.data);
    }
    tdm_buf_free(&body);
    return rc;
}

/* ---- literal values ---- */

/* Appends the JSON text of string s[n] as json.dumps(ensure_ascii=False) writes it. */
static void json_string_text(const char *s, size_t n, bool with_quotes, tdm_buf_t *j)
{
    static const char short_esc[] = "btn\0fr";
    if (with_quotes)
        tdm_buf_puts(j, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            tdm_buf_printf(j, "\\%c", ch);
        else if (ch >= 8 && ch <= 13 && short_esc[ch - 8])
            tdm_buf_printf(j, "\\%c", short_esc[ch - 8]);
        else if (ch < 0x20)
            tdm_buf_printf(j, "\\u%04x", ch);
        else
            tdm_buf_append(j, &s[i], 1);
    }
    if (with_quotes)
        tdm_buf_puts(j, "\"");
}

int js_json_string_literal(const char *s, size_t n, bool with_quotes, tdm_buf_t *body)
{
    /* First the JSON text of the string as json.dumps writes it, then that as GBNF. */
    tdm_buf_t j = TDM_BUF_INIT;
    json_string_text(s, n, with_quotes, &j);
    int rc = j.oom ? TDM_ERESOURCE : js_gbnf_lit(body, j.data ? j.data : "", j.len);
    tdm_buf_free(&j);
    return rc;
}

/* Python's repr() of a finite double: the shortest digits that round-trip, in fixed notation
 * when the exponent is in [-4, 16), scientific otherwise ("1e-05", "1.5e+16"). */
static void python_repr(double v, char *out, size_t cap)
{
    char e[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, v);
        if (strtod(e, NULL) == v)
            break;
    }
    char digits[24];
    size_t nd = 0;
    const char *q = e + (e[0] == '-');
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9')
            digits[nd++] = *q;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    int ex = atoi(q + 1);
    const char *sign = v < 0 ? "-" : "";
    if (ex < -4 || ex >= 16) {
        snprintf(out, cap, "%s%c%s%se%c%02d", sign, digits[0], nd > 1 ? "." : "", digits + 1,
                 ex < 0 ? '-' : '+', abs(ex));
    } else if (ex < 0) {
        char zeros[8] = "000"; /* ex in [-4, -1]: 0 to 3 zeros after the point */
        zeros[-ex - 1] = 0;
        snprintf(out, cap, "%s0.%s%s", sign, zeros, digits);
    } else {
        char ip[24], fp[24];
        size_t ni = (size_t)ex + 1;
        for (size_t i = 0; i < ni; i++)
            ip[i] = i < nd ? digits[i] : '0';
        ip[ni] = 0;
        snprintf(fp, sizeof fp, "%s", nd > ni ? digits + ni : "0");
        snprintf(out, cap, "%s%s.%s", sign, ip, fp);
    }
}

int js_scalar_texts(json_t *v, tdm_buf_t t[2])
{
    int n = 1;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
    case JSON_ARRAY: return 0;
    case JSON_STRING:
        json_string_text(json_string_value(v), json_string_length(v), true, &t[0]);
        break;
    case JSON_INTEGER:
        tdm_buf_printf(&t[0], "%lld", (long long)json_integer_value(v));
        tdm_buf_printf(&t[1], "%lld.0", (long long)json_integer_value(v));
        n = 2;
        break;
    case JSON_REAL: {
        double d = json_real_value(v);
        char r[64];
        if (!isfinite(d)) {
            tdm_buf_puts(&t[0], "null");
            break;
        }
        python_repr(d, r, sizeof r);
        tdm_buf_puts(&t[0], r);
        if (d == floor(d) && fabs(d) < 1e17 && ++n)
            tdm_buf_printf(&t[1], "%.0f", d);
        break;
    }
    case JSON_TRUE: tdm_buf_puts(&t[0], "true"); break;
    case JSON_FALSE: tdm_buf_puts(&t[0], "false"); break;
    case JSON_NULL: tdm_buf_puts(&t[0], "null"); break;
    }
    return t[0].oom || t[1].oom ? TDM_ERESOURCE : n;
}

/* A number value: integers as digits; reals as Python writes them, and an integral value in
 * both forms ("2" and "2.0": JSON Schema compares numbers by value). */
static int number_literal(json_t *v, tdm_buf_t *body)
{
    tdm_buf_t t[2] = {TDM_BUF_INIT, TDM_BUF_INIT};
    int n = js_scalar_texts(v, t);
    if (n == 2)
        tdm_buf_puts(body, "( ");
    for (int i = 0; i < n; i++) {
        tdm_buf_puts(body, i ? " | " : "");
        js_gbnf_lit(body, t[i].data, t[i].len);
    }
    if (n == 2)
        tdm_buf_puts(body, " )");
    tdm_buf_free(&t[0]);
    tdm_buf_free(&t[1]);
    return n < 0 ? n : body->oom ? TDM_ERESOURCE : 0;
}

int js_literal(js_ctx_t *c, json_t *v, tdm_buf_t *body)
{
    char ws[JS_NAME_MAX];
    int rc = js_prim(c, JS_PRIM_WS, ws);
    const char *key;
    json_t *x;
    size_t i;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        tdm_buf_printf(body, "( \"{\" %s ", ws);
        i = 0;
        json_object_foreach(v, key, x)
        {
            if (i++)
                tdm_buf_printf(body, "\",\" %s ", ws);
            js_json_string_literal(key, strlen(key), true, body);
            tdm_buf_printf(body, " %s \":\" %s ", ws, ws);
            rc = rc ? rc : js_literal(c, x, body);
            tdm_buf_printf(body, " %s ", ws);
        }
        return rc ? rc : tdm_buf_puts(body, "\"}\" )");
    case JSON_ARRAY:
        tdm_buf_printf(body, "( \"[\" %s ", ws);
        json_array_foreach(v, i, x)
        {
            if (i)
                tdm_buf_printf(body, "\",\" %s ", ws);
            rc = rc ? rc : js_literal(c, x, body);
            tdm_buf_printf(body, " %s ", ws);
        }
        return rc ? rc : tdm_buf_puts(body, "\"]\" )");
    case JSON_STRING:
        return js_json_string_literal(json_string_value(v), json_string_length(v), true, body);
    case JSON_INTEGER:
    case JSON_REAL: return number_literal(v, body);
    case JSON_TRUE: return tdm_buf_puts(body, "\"true\"");
    case JSON_FALSE: return tdm_buf_puts(body, "\"false\"");
    case JSON_NULL: return tdm_buf_puts(body, "\"null\"");
    }
    return rc;
}
