/* json_schema_number.c - JSON Schema integers and numbers with bounds (minimum, maximum,
 * exclusiveMinimum, exclusiveMaximum: numbers in draft 6 and later, booleans beside
 * minimum / maximum in draft 4), compiled to digit-range grammars.
 *
 * Integers: exact for any bounds (non-integral bounds round inward). Numbers: bounds must be
 * integral (others are refused); a bounded side allows no exponent, except that a side with
 * no upper bound allows a positive exponent (it only grows the value), so "1e+20" passes
 * `minimum: 0` while "5e-05" does not (a validation error, never an invalid acceptance).
 * "-0" is not written for zero.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "json_schema_internal.h"

#define BOUND_MAX 1e17 /* larger bounds are refused */

typedef struct bound {
    bool set, excl;
    double v;
} bound_t;

/* Digits of a non-negative integer written as exactly len digits (leading zeros kept). */
static void digits_of(uint64_t v, int len, char *out)
{
    out[len] = 0;
    for (int i = len - 1; i >= 0; i--) {
        out[i] = (char)('0' + v % 10);
        v /= 10;
    }
}

static int n_digits(uint64_t v)
{
    int n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

static bool all_digit(const char *s, char d)
{
    for (; *s; s++)
        if (*s != d)
            return false;
    return true;
}

/* Strings of exactly strlen(lo) digits between lo and hi (same length, lo <= hi). */
static void same_len(tdm_buf_t *b, const char *lo, const char *hi)
{
    size_t n = strlen(lo);
    if (n == 0)
        return;
    if (lo[0] == hi[0]) {
        tdm_buf_printf(b, "\"%c\" ", lo[0]);
        same_len(b, lo + 1, hi + 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    nines[n - 1] = zeros[n - 1] = 0;
    char first = all_digit(lo + 1, '0') ? lo[0] : (char)(lo[0] + 1);
    char last = all_digit(hi + 1, '9') ? hi[0] : (char)(hi[0] - 1);
    int alts = 0;
    tdm_buf_puts(b, "( ");
    if (first != lo[0]) {
        tdm_buf_printf(b, "\"%c\" ", lo[0]);
        same_len(b, lo + 1, nines);
        alts++;
    }
    if (first <= last) {
        tdm_buf_printf(b, "%s[%c-%c]", alts++ ? "| " : "", first, last);
        if (n > 1)
            tdm_buf_printf(b, " [0-9]{%zu}", n - 1);
        tdm_buf_puts(b, " ");
    }
    if (last != hi[0]) {
        tdm_buf_printf(b, "%s\"%c\" ", alts++ ? "| " : "", hi[0]);
        same_len(b, zeros, hi + 1);
    }
    tdm_buf_puts(b, ") ");
}

/* Decimal integers (no leading zeros) from lo to hi; hi_inf: no upper bound. */
static void uint_range(tdm_buf_t *b, uint64_t lo, uint64_t hi, bool hi_inf)
{
    int dl = n_digits(lo), dh = hi_inf ? dl : n_digits(hi);
    tdm_buf_puts(b, "( ");
    for (int len = dl; len <= dh; len++) {
        uint64_t p = 1;
        for (int k = 1; k < len; k++)
            p *= 10;
        uint64_t a = len == dl ? lo : p, z = (!hi_inf && len == dh) ? hi : p * 10 - 1;
        char sa[24], sz[24];
        digits_of(a, len, sa);
        digits_of(z, len, sz);
        tdm_buf_puts(b, len > dl ? "| " : "");
        same_len(b, sa, sz);
    }
    if (hi_inf)
        tdm_buf_printf(b, "| [1-9] [0-9]{%d,} ", dl);
    tdm_buf_puts(b, ")");
}

/* Reads the bounds of s: *lo / *hi (draft-4 boolean exclusives too). */
static int read_bounds(js_ctx_t *c, json_t *s, const char *ptr, bound_t *lo, bound_t *hi)
{
    static const char *const keys[4] = {"minimum", "exclusiveMinimum", "maximum",
                                        "exclusiveMaximum"};
    memset(lo, 0, sizeof *lo);
    memset(hi, 0, sizeof *hi);
    for (int k = 0; k < 4; k++) {
        json_t *x = json_object_get(s, keys[k]);
        bound_t *b = k < 2 ? lo : hi;
        if (!x || (json_is_boolean(x) && k % 2 == 1))
            continue;
        if (!json_is_number(x))
            return js_fail(c, ptr, keys[k], "must be a number");
        double v = json_number_value(x);
        if (fabs(v) > BOUND_MAX)
            return js_fail(c, ptr, keys[k], "bounds beyond 1e17 not supported");
        bool excl = k % 2 == 1;
        /* the tighter of two bounds on one side wins */
        bool tighter = !b->set || (k < 2 ? v > b->v : v < b->v) || (v == b->v && excl);
        if (tighter) {
            b->set = true;
            b->v = v;
            b->excl = excl;
        }
    }
    json_t *xmin = json_object_get(s, "exclusiveMinimum"),
           *xmax = json_object_get(s, "exclusiveMaximum");
    if (json_is_true(xmin) && json_object_get(s, "minimum"))
        lo->excl = true;
    if (json_is_true(xmax) && json_object_get(s, "maximum"))
        hi->excl = true;
    return 0;
}

int js_integer(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    bound_t lo, hi;
    int rc = read_bounds(c, s, ptr, &lo, &hi);
    if (rc != 0)
        return rc;
    if (!lo.set && !hi.set)
        return js_prim(c, JS_PRIM_INTEGER, name);
    long long a = lo.set ? (long long)(lo.excl ? floor(lo.v) + 1 : ceil(lo.v)) : 0;
    long long z = hi.set ? (long long)(hi.excl ? ceil(hi.v) - 1 : floor(hi.v)) : 0;
    if (lo.set && hi.set && a > z)
        return js_fail_unsat(c, ptr, "minimum", "no integer within the bounds");
    tdm_buf_t body = TDM_BUF_INIT;
    int alts = 0;
    if (!lo.set || a < 0) { /* negatives: "-" magnitude in [max(1, -z), -a] */
        uint64_t m_lo = (hi.set && z < 0) ? (uint64_t)-z : 1;
        tdm_buf_puts(&body, "\"-\" ");
        uint_range(&body, m_lo, lo.set ? (uint64_t)-a : 0, !lo.set);
        alts++;
    }
    if (!hi.set || z >= 0) {
        tdm_buf_puts(&body, alts ? " | " : "");
        uint_range(&body, lo.set && a > 0 ? (uint64_t)a : 0, hi.set ? (uint64_t)z : 0, !hi.set);
    }
    js_new_name(c, name);
    rc = body.oom ? js_oom(c) : js_emit_rule(c, name, body.data);
    tdm_buf_free(&body);
    return rc;
}

/* Non-negative decimal numbers x with lo (<, <=) x (<, <=) hi, written intpart [frac] [exp];
 * hi_inf: no upper bound (then a positive exponent is allowed). Appends nothing and returns
 * false when no such number exists. */
static bool side(tdm_buf_t *b, uint64_t lo, bool lo_excl, uint64_t hi, bool hi_excl, bool hi_inf)
{
    static const char frac[] = " ( \".\" [0-9]+ )?", exp[] = " ( [eE] \"+\"? [0-9]+ )?";
    int alts = 0;
    uint64_t a = lo_excl ? lo + 1 : lo;
    tdm_buf_puts(b, "( ");
    if (hi_inf || (hi >= 1 && a <= hi - 1)) { /* int part in [a, hi - 1]: any fraction */
        uint_range(b, a, hi_inf ? 0 : hi - 1, hi_inf);
        tdm_buf_printf(b, "%s%s", frac, hi_inf ? exp : "");
        alts++;
    }
    if (lo_excl && (hi_inf || lo < hi)) { /* int part lo: a non-zero fraction */
        tdm_buf_printf(b, "%s\"%llu\" \".\" [0-9]* [1-9] [0-9]*%s", alts++ ? " | " : "",
                       (unsigned long long)lo, hi_inf ? exp : "");
    }
    if (!hi_inf && !hi_excl && (hi > lo || (hi == lo && !lo_excl))) /* hi itself */
        tdm_buf_printf(b, "%s\"%llu\" ( \".\" \"0\"+ )?", alts++ ? " | " : "",
                       (unsigned long long)hi);
    tdm_buf_puts(b, " )");
    return alts > 0;
}

int js_number(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    bound_t lo, hi;
    int rc = read_bounds(c, s, ptr, &lo, &hi);
    if (rc != 0)
        return rc;
    if (!lo.set && !hi.set)
        return js_prim(c, JS_PRIM_NUMBER, name);
    if ((lo.set && lo.v != floor(lo.v)) || (hi.set && hi.v != floor(hi.v)))
        return js_fail(c, ptr,
                       lo.set && lo.v != floor(lo.v) ? (lo.excl ? "exclusiveMinimum" : "minimum")
                                                     : (hi.excl ? "exclusiveMaximum" : "maximum"),
                       "non-integral bounds on numbers not supported");
    tdm_buf_t body = TDM_BUF_INIT, part = TDM_BUF_INIT;
    int alts = 0;
    if (!lo.set || lo.v < 0) { /* x = -m, m > 0 */
        bool m_lo_excl = !(hi.set && hi.v < 0) || hi.excl;
        uint64_t m_lo = hi.set && hi.v < 0 ? (uint64_t)-hi.v : 0;
        if (side(&part, m_lo, m_lo_excl, lo.set ? (uint64_t)-lo.v : 0, lo.excl, !lo.set)) {
            tdm_buf_printf(&body, "\"-\" %s", part.data);
            alts++;
        }
    }
    tdm_buf_clear(&part);
    if (!hi.set || hi.v > 0 || (hi.v == 0 && !hi.excl)) {
        bool from_lo = lo.set && lo.v >= 0;
        if (side(&part, from_lo ? (uint64_t)lo.v : 0, from_lo && lo.excl,
                 hi.set ? (uint64_t)hi.v : 0, hi.excl, !hi.set))
            tdm_buf_printf(&body, "%s%s", alts++ ? " | " : "", part.data);
    }
    if (alts == 0)
        rc = js_fail_unsat(c, ptr, "minimum", "no number within the bounds");
    else if (body.oom || part.oom)
        rc = js_oom(c);
    if (rc == 0) {
        js_new_name(c, name);
        rc = js_emit_rule(c, name, body.data);
    }
    tdm_buf_free(&body);
    tdm_buf_free(&part);
    return rc;
}
