/* json_schema_number.c - JSON Schema integers and numbers with bounds (minimum, maximum,
 * exclusiveMinimum, exclusiveMaximum: numbers in draft 6 and later, booleans beside
 * minimum / maximum in draft 4), compiled to digit-string grammars.
 *
 * Exact for any decimal bound: a bound is taken as the decimal its text denotes (a real as
 * the shortest decimal that reads back as the same double, which is the text written in the
 * schema whenever that has at most 15 significant digits; an integer of any size digit for
 * digit) and instances are compared with it by their decimal value, digit string against
 * digit string. Integers: non-integral bounds round inward. Numbers: a bounded side allows no
 * exponent, except that a side with no upper bound allows a positive exponent (it only grows
 * the value), so "1e+20" passes `minimum: 0` while "5e-05" does not (a validation error, never
 * an invalid acceptance). "-0" is not written for zero.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"

#define DEC_MAX 400 /* digits of a bound's integer or fraction part; more are refused */

/* A decimal: neg, integer part ip (no leading zeros, "0" for zero), fraction fp (no trailing
 * zeros, "" when integral). */
typedef struct dec {
    bool neg;
    char ip[DEC_MAX + 2], fp[DEC_MAX + 2];
} dec_t;

typedef struct bound {
    bool set, excl;
    dec_t v;
} bound_t;

static const char k_nines[DEC_MAX + 2] = {[0 ... DEC_MAX] = '9'};
static const char k_zeros[DEC_MAX + 2] = {[0 ... DEC_MAX] = '0'};

/* The last n characters of a run of nines / zeros (n <= DEC_MAX). */
static const char *nines(size_t n)
{
    return k_nines + (DEC_MAX + 1 - n);
}
static const char *zeros(size_t n)
{
    return k_zeros + (DEC_MAX + 1 - n);
}

static bool is_zero(const dec_t *d)
{
    return strcmp(d->ip, "0") == 0 && !d->fp[0];
}

/* Compares magnitudes (digit strings without leading zeros). */
static int mag_cmp(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    return la != lb ? (la < lb ? -1 : 1) : strcmp(a, b);
}

/* Compares the values of two decimals. */
static int dec_cmp(const dec_t *a, const dec_t *b)
{
    if (is_zero(a) && is_zero(b))
        return 0;
    if (a->neg != b->neg)
        return a->neg ? -1 : 1;
    int c = mag_cmp(a->ip, b->ip);
    if (c == 0)
        c = strcmp(a->fp, b->fp); /* no trailing zeros: lexicographic order is value order */
    return a->neg ? -c : c;
}

/* s += 1 (a magnitude; room for one more digit). */
static void mag_inc(char *s)
{
    size_t n = strlen(s);
    for (size_t i = n; i-- > 0;) {
        if (s[i] != '9') {
            s[i]++;
            return;
        }
        s[i] = '0';
    }
    memmove(s + 1, s, n + 1);
    s[0] = '1';
}

/* s -= 1 (a magnitude >= 1). */
static void mag_dec(char *s)
{
    size_t n = strlen(s);
    for (size_t i = n; i-- > 0;) {
        if (s[i] != '0') {
            s[i]--;
            break;
        }
        s[i] = '9';
    }
    if (n > 1 && s[0] == '0')
        memmove(s, s + 1, n);
}

/* The decimal value of number x into *d; false when it has over DEC_MAX digits a side, or
 * when it stands for an integer beyond 64 bits whose text is not known for sure. */
static bool dec_of(js_ctx_t *c, json_t *x, dec_t *d)
{
    memset(d, 0, sizeof *d);
    if (json_is_real(x) && c->bigints && fabs(json_real_value(x)) >= 9e18) {
        const char *text = NULL; /* the one big integer text this real was read from */
        size_t i;
        json_t *b;
        json_array_foreach(c->bigints, i, b)
        {
            const char *t = json_string_value(b);
            if (strtod(t, NULL) != json_real_value(x))
                continue;
            if (text && strcmp(text, t) != 0)
                return false;
            text = t;
        }
        if (text) {
            d->neg = text[0] == '-';
            if (strlen(text + d->neg) > DEC_MAX)
                return false;
            snprintf(d->ip, sizeof d->ip, "%s", text + d->neg);
            return true;
        }
    }
    if (json_is_integer(x)) {
        long long v = json_integer_value(x);
        d->neg = v < 0;
        snprintf(d->ip, sizeof d->ip, "%llu",
                 v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v);
        return true;
    }
    double v = json_real_value(x);
    char e[40], digits[24];
    int p;
    for (p = 1; p <= 17; p++) { /* the shortest digits that read back as v */
        snprintf(e, sizeof e, "%.*e", p - 1, v);
        if (strtod(e, NULL) == v)
            break;
    }
    size_t nd = 0;
    const char *q = e + (e[0] == '-');
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9')
            digits[nd++] = *q;
    int ex = atoi(q + 1); /* value: 0.digits * 10^(ex + 1) */
    if (ex >= DEC_MAX || -ex >= DEC_MAX - 20)
        return false;
    d->neg = v < 0;
    char all[2 * DEC_MAX + 64]; /* the digits with the point at position pt */
    int pt = ex + 1, lead = pt < 0 ? -pt : 0;
    memset(all, '0', sizeof all);
    memcpy(all + lead, digits, nd);
    pt += lead;
    size_t len = (size_t)(pt > (int)(lead + nd) ? pt : (int)(lead + nd));
    memcpy(d->ip, all, (size_t)pt);
    d->ip[pt] = 0;
    memcpy(d->fp, all + pt, len - (size_t)pt);
    d->fp[len - (size_t)pt] = 0;
    size_t i = 0;
    while (d->ip[i] == '0' && d->ip[i + 1])
        i++;
    memmove(d->ip, d->ip + i, strlen(d->ip + i) + 1);
    if (!d->ip[0])
        strcpy(d->ip, "0");
    for (size_t n = strlen(d->fp); n > 0 && d->fp[n - 1] == '0'; n--)
        d->fp[n - 1] = 0;
    if (is_zero(d))
        d->neg = false;
    return true;
}

/* Strings of exactly strlen(lo) digits between lo and hi (same length, lo <= hi). */
static void same_len(tdm_buf_t *b, const char *lo, const char *hi)
{
    while (lo[0] && lo[0] == hi[0]) {
        tdm_buf_printf(b, "\"%c\" ", lo[0]);
        lo++;
        hi++;
    }
    size_t n = strlen(lo);
    if (n == 0)
        return;
    bool lo_zeros = strspn(lo + 1, "0") == n - 1, hi_nines = strspn(hi + 1, "9") == n - 1;
    char first = lo_zeros ? lo[0] : (char)(lo[0] + 1);
    char last = hi_nines ? hi[0] : (char)(hi[0] - 1);
    int alts = 0;
    tdm_buf_puts(b, "( ");
    if (first != lo[0]) {
        tdm_buf_printf(b, "\"%c\" ", lo[0]);
        same_len(b, lo + 1, nines(n - 1));
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
        same_len(b, zeros(n - 1), hi + 1);
    }
    tdm_buf_puts(b, ") ");
}

/* Decimal integers (no leading zeros) from lo to hi (magnitudes, lo <= hi); hi NULL: no upper
 * bound. */
static void uint_range(tdm_buf_t *b, const char *lo, const char *hi)
{
    size_t dl = strlen(lo), dh = hi ? strlen(hi) : dl;
    char a[DEC_MAX + 3], z[DEC_MAX + 3];
    tdm_buf_puts(b, "( ");
    for (size_t len = dl; len <= dh; len++) {
        if (len == dl)
            snprintf(a, sizeof a, "%s", lo);
        else
            snprintf(a, sizeof a, "1%s", zeros(len - 1));
        snprintf(z, sizeof z, "%s", hi && len == dh ? hi : nines(len));
        tdm_buf_puts(b, len > dl ? "| " : "");
        same_len(b, a, z);
    }
    if (!hi)
        tdm_buf_printf(b, "| [1-9] [0-9]{%zu,} ", dl);
    tdm_buf_puts(b, ")");
}

/* Non-empty digit strings D with 0.D >= 0.s (> when excl); s non-empty. */
static void frac_ge(tdm_buf_t *b, const char *s, bool excl)
{
    tdm_buf_puts(b, "( ");
    if (s[0] < '9')
        tdm_buf_printf(b, "[%c-9] [0-9]* | ", s[0] + 1);
    tdm_buf_printf(b, "\"%c\" ", s[0]);
    if (s[1])
        frac_ge(b, s + 1, excl);
    else
        tdm_buf_puts(b, excl ? "[0-9]* [1-9] [0-9]*" : "[0-9]*");
    tdm_buf_puts(b, " )");
}

/* Non-empty digit strings D with 0.D <= 0.s (< when excl); s non-empty, no trailing zeros
 * (so a one-digit s is not "0" and there is always a string). */
static void frac_le(tdm_buf_t *b, const char *s, bool excl)
{
    int alts = 0;
    tdm_buf_puts(b, "( ");
    if (s[0] > '0')
        tdm_buf_printf(b, "%s[0-%c] [0-9]*", alts++ ? " | " : "", s[0] - 1);
    if (s[1]) {
        tdm_buf_printf(b, "%s\"%c\" ", alts++ ? " | " : "", s[0]);
        frac_le(b, s + 1, excl);
        tdm_buf_puts(b, "?");
    } else if (!excl) {
        tdm_buf_printf(b, "%s\"%c\" \"0\"*", alts++ ? " | " : "", s[0]);
    }
    tdm_buf_puts(b, " )");
}

/* Non-empty digit strings D with 0.l (<=, < when le) 0.D (<=, < when he) 0.h, where 0.l < 0.h
 * (l may be empty: zero). */
static void frac_between(tdm_buf_t *b, const char *l, bool le, const char *h, bool he)
{
    size_t nl = strlen(l), k = 0;
    while ((k < nl ? l[k] : '0') == h[k])
        k++;
    char lk = k < nl ? l[k] : '0';
    size_t m = nl > 1 ? nl : 1;
    int alts = 0;
    tdm_buf_puts(b, "( ");
    if (!le && k >= m) { /* l itself, with up to k - m zeros */
        tdm_buf_printf(b, "\"%.*s\" \"0\"{0,%zu}", (int)m, h, k - m);
        alts++;
    }
    tdm_buf_printf(b, "%s\"%.*s%c\" ", alts++ ? " | " : "", (int)k, h, lk);
    if (nl > k + 1)
        frac_ge(b, l + k + 1, le);
    else
        tdm_buf_puts(b, le ? "[0-9]* [1-9] [0-9]*" : "[0-9]*");
    if (lk + 1 <= h[k] - 1)
        tdm_buf_printf(b, " | \"%.*s\" [%c-%c] [0-9]*", (int)k, h, lk + 1, h[k] - 1);
    if (h[k + 1]) {
        tdm_buf_printf(b, " | \"%.*s\" ", (int)k + 1, h);
        frac_le(b, h + k + 1, he);
        tdm_buf_puts(b, "?");
    } else if (!he) {
        tdm_buf_printf(b, " | \"%.*s\" \"0\"*", (int)k + 1, h);
    }
    tdm_buf_puts(b, " )");
}

/* Non-negative decimal numbers x with lo (<, <=) x (<, <=) hi, written intpart [frac] [exp];
 * hi_inf: no upper bound (then a positive exponent is allowed). Appends nothing and returns
 * false when no such number exists. */
static bool side(tdm_buf_t *b, const dec_t *lo, bool lo_excl, const dec_t *hi, bool hi_excl,
                 bool hi_inf)
{
    static const char any[] = " ( \".\" [0-9]+ )?", pos[] = " \".\" [0-9]* [1-9] [0-9]*";
    const char *exp = hi_inf ? " ( [eE] \"+\"? [0-9]+ )?" : "";
    int alts = 0, c = hi_inf ? -1 : mag_cmp(lo->ip, hi->ip);
    char a[DEC_MAX + 3], z[DEC_MAX + 3];
    snprintf(a, sizeof a, "%s", lo->ip);
    mag_inc(a);
    snprintf(z, sizeof z, "%s", hi_inf ? "0" : hi->ip);
    if (!hi_inf && strcmp(z, "0") != 0)
        mag_dec(z);
    tdm_buf_puts(b, "( ");
    if (hi_inf || (strcmp(hi->ip, "0") != 0 && mag_cmp(a, z) <= 0)) { /* (lo.ip, hi.ip) */
        uint_range(b, a, hi_inf ? NULL : z);
        tdm_buf_printf(b, "%s%s", any, exp);
        alts++;
    }
    if (c < 0) { /* int part lo.ip: fraction above lo's */
        tdm_buf_printf(b, "%s\"%s\"", alts++ ? " | " : "", lo->ip);
        if (!lo->fp[0]) {
            tdm_buf_puts(b, lo_excl ? pos : any);
        } else {
            tdm_buf_puts(b, " \".\" ");
            frac_ge(b, lo->fp, lo_excl);
        }
        tdm_buf_puts(b, exp);
    }
    if (c < 0 && !hi_inf && !(hi_excl && !hi->fp[0])) { /* int part hi.ip: fraction below hi's */
        tdm_buf_printf(b, "%s\"%s\"", alts++ ? " | " : "", hi->ip);
        if (!hi->fp[0]) {
            tdm_buf_puts(b, " ( \".\" \"0\"+ )?");
        } else {
            tdm_buf_puts(b, " ( \".\" ");
            frac_le(b, hi->fp, hi_excl);
            tdm_buf_puts(b, " )?");
        }
    }
    int f = c == 0 ? strcmp(lo->fp, hi->fp) : 1;
    if (c == 0 && f == 0 && !lo_excl && !hi_excl) { /* one value */
        tdm_buf_printf(b, "%s\"%s\"", alts++ ? " | " : "", lo->ip);
        if (lo->fp[0])
            tdm_buf_printf(b, " \".%s\" \"0\"*", lo->fp);
        else
            tdm_buf_puts(b, " ( \".\" \"0\"+ )?");
    } else if (c == 0 && f < 0) {           /* both in one integer */
        bool bare = !lo->fp[0] && !lo_excl; /* lo is that integer itself */
        tdm_buf_printf(b, "%s\"%s\" %s\".\" ", alts++ ? " | " : "", lo->ip, bare ? "( " : "");
        frac_between(b, lo->fp, lo_excl, hi->fp, hi_excl);
        tdm_buf_puts(b, bare ? " )?" : "");
    }
    tdm_buf_puts(b, " )");
    return alts > 0;
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
        dec_t v;
        if (!dec_of(c, x, &v))
            return js_fail(c, ptr, keys[k], "bounds of more than %d digits not supported", DEC_MAX);
        bool excl = k % 2 == 1;
        int cmp = b->set ? dec_cmp(&v, &b->v) : 0;
        /* the tighter of two bounds on one side wins */
        if (!b->set || (k < 2 ? cmp > 0 : cmp < 0) || (cmp == 0 && excl)) {
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

/* The least integer above (or at, unless excl) d, into *r (fp empty). */
static void int_lower(const dec_t *d, bool excl, dec_t *r)
{
    *r = *d;
    r->fp[0] = 0;
    if (!d->neg && (excl || d->fp[0]))
        mag_inc(r->ip);
    else if (d->neg && excl && !d->fp[0])
        mag_dec(r->ip);
    r->neg = d->neg && strcmp(r->ip, "0") != 0;
}

/* The greatest integer below (or at, unless excl) d, into *r (fp empty). */
static void int_upper(const dec_t *d, bool excl, dec_t *r)
{
    *r = *d;
    r->fp[0] = 0;
    if (d->neg && (excl || d->fp[0])) {
        mag_inc(r->ip);
    } else if (!d->neg && excl && !d->fp[0]) {
        if (strcmp(r->ip, "0") == 0) {
            strcpy(r->ip, "1");
            r->neg = true;
        } else {
            mag_dec(r->ip);
        }
    }
}

int js_integer(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    if (json_object_get(s, "multipleOf"))
        return js_multiple(c, s, ptr, name);
    bound_t lo, hi;
    int rc = read_bounds(c, s, ptr, &lo, &hi);
    if (rc != 0)
        return rc;
    if (!lo.set && !hi.set)
        return js_prim(c, JS_PRIM_INTEGER, name);
    dec_t a, z;
    if (lo.set)
        int_lower(&lo.v, lo.excl, &a);
    if (hi.set)
        int_upper(&hi.v, hi.excl, &z);
    if (lo.set && hi.set && dec_cmp(&a, &z) > 0)
        return js_fail_unsat(c, ptr, "minimum", "no integer within the bounds");
    tdm_buf_t body = TDM_BUF_INIT;
    int alts = 0;
    if (!lo.set || a.neg) { /* negatives: "-" magnitude in [max(1, -z), -a] */
        tdm_buf_puts(&body, "\"-\" ");
        uint_range(&body, hi.set && z.neg ? z.ip : "1", lo.set ? a.ip : NULL);
        alts++;
    }
    if (!hi.set || !z.neg) {
        tdm_buf_puts(&body, alts ? " | " : "");
        uint_range(&body, lo.set && !a.neg ? a.ip : "0", hi.set ? z.ip : NULL);
    }
    js_new_name(c, name);
    rc = body.oom ? js_oom(c) : js_emit_rule(c, name, body.data);
    tdm_buf_free(&body);
    return rc;
}

int js_number(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    if (json_object_get(s, "multipleOf"))
        return js_multiple(c, s, ptr, name);
    bound_t lo, hi;
    int rc = read_bounds(c, s, ptr, &lo, &hi);
    if (rc != 0)
        return rc;
    if (!lo.set && !hi.set)
        return js_prim(c, JS_PRIM_NUMBER, name);
    tdm_buf_t body = TDM_BUF_INIT, part = TDM_BUF_INIT;
    static const dec_t zero = {.ip = "0"};
    int alts = 0;
    if (!lo.set || lo.v.neg) { /* x = -m: m above -hi (or 0, exclusive), up to -lo */
        dec_t m_lo = hi.set && hi.v.neg ? hi.v : zero, m_hi = lo.set ? lo.v : zero;
        m_lo.neg = m_hi.neg = false;
        if (side(&part, &m_lo, !(hi.set && hi.v.neg) || hi.excl, &m_hi, lo.excl, !lo.set)) {
            tdm_buf_printf(&body, "\"-\" %s", part.data);
            alts++;
        }
    }
    tdm_buf_clear(&part);
    if (!hi.set || !hi.v.neg) {
        bool from_lo = lo.set && !lo.v.neg;
        if (side(&part, from_lo ? &lo.v : &zero, from_lo && lo.excl, hi.set ? &hi.v : &zero,
                 hi.excl, !hi.set))
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
