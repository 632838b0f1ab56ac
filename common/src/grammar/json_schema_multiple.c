/* json_schema_multiple.c - `multipleOf` with a positive integer k on integers (and on numbers,
 * whose multiples of an integer are written as integers), compiled exactly: the decimal digits
 * read left to right through the automaton of the remainder modulo k (r -> (10 r + d) mod k),
 * accepting at remainder 0; with both bounds and at most JS_MULT_ENUM multiples between them,
 * the multiples themselves. A decimal k (0.01) is refused: validators compare it in floating
 * point (0.07 / 0.01 is not an integer there), so no grammar agrees with all of them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"

#define JS_MULT_MAX_K 1000u  /* remainder rules at most */
#define JS_MULT_ENUM 1000    /* multiples listed between two bounds */
#define JS_MULT_EXACT 9.0e15 /* bounds beyond this are not exact doubles of integers */

/* The integer bound of keyword key (inclusive, rounded inward); false when absent. */
static bool int_bound(json_t *s, bool lower, double *v)
{
    json_t *m = json_object_get(s, lower ? "minimum" : "maximum");
    json_t *x = json_object_get(s, lower ? "exclusiveMinimum" : "exclusiveMaximum");
    bool set = false;
    double b = 0;
    if (json_is_number(m)) {
        double t = json_number_value(m);
        b = lower ? ceil(t) : floor(t);
        if (json_is_true(x) && t == b) /* draft 4: exclusive flag on the bound */
            b += lower ? 1 : -1;
        set = true;
    }
    if (json_is_number(x)) {
        double t = json_number_value(x), e = lower ? floor(t) + 1 : ceil(t) - 1;
        b = !set ? e : lower ? fmax(b, e) : fmin(b, e);
        set = true;
    }
    *v = b;
    return set;
}

/* The positive multiples of k as rules: P_r, the digits so far at remainder r. */
static int positive_rules(js_ctx_t *c, unsigned k, char *name)
{
    char(*r)[JS_NAME_MAX] = calloc(k, JS_NAME_MAX);
    tdm_buf_t b = TDM_BUF_INIT;
    int rc = r ? 0 : js_oom(c);
    for (unsigned i = 0; i < k && rc == 0; i++)
        js_new_name(c, r[i]);
    for (unsigned i = 0; i <= k && rc == 0; i++) { /* i == k: the first digit, 1-9 */
        tdm_buf_clear(&b);
        bool done[10] = {false};
        for (unsigned d = i == k ? 1 : 0; d < 10; d++) {
            if (done[d])
                continue;
            unsigned t = i == k ? d % k : (10 * i + d) % k;
            tdm_buf_printf(&b, "%s[", b.len ? " | " : "");
            for (unsigned e = d; e < 10; e++) {
                unsigned u = i == k ? e % k : (10 * i + e) % k;
                if (u == t && !done[e]) {
                    tdm_buf_printf(&b, "%u", e);
                    done[e] = true;
                }
            }
            tdm_buf_printf(&b, "] %s", r[t]);
        }
        if (i == 0)
            tdm_buf_puts(&b, " | \"\"");
        if (i == k)
            js_new_name(c, name);
        rc = b.oom ? js_oom(c) : js_emit_rule(c, i == k ? name : r[i], b.data);
    }
    tdm_buf_free(&b);
    free(r);
    return rc;
}

/* The multiples of k in [lo, hi] as literals into body. */
static int listed(js_ctx_t *c, double k, double lo, double hi, tdm_buf_t *body)
{
    json_t *arr = json_array();
    if (!arr || json_array_append_new(c->keep, arr) != 0)
        return js_oom(c);
    for (double m = ceil(lo / k) * k; m <= hi; m += k)
        if (json_array_append_new(arr, json_integer((json_int_t)m)) != 0)
            return js_oom(c);
    size_t n = json_array_size(arr);
    json_t **vals = calloc(n + 1, sizeof *vals);
    if (!vals)
        return js_oom(c);
    for (size_t i = 0; i < n; i++)
        vals[i] = json_array_get(arr, i);
    int rc = js_enum_expr(c, vals, n, body);
    free(vals);
    return rc;
}

int js_multiple(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    json_t *mo = json_object_get(s, "multipleOf");
    double k = json_number_value(mo), lo = 0, hi = 0;
    if (!json_is_number(mo) || k <= 0)
        return js_fail(c, ptr, "multipleOf", "must be a positive number");
    if (k != floor(k) || k > JS_MULT_MAX_K)
        return js_fail(c, ptr, "multipleOf",
                       "not supported (only integers up to %u; a decimal one is compared in "
                       "floating point by validators)",
                       JS_MULT_MAX_K);
    bool has_lo = int_bound(s, true, &lo), has_hi = int_bound(s, false, &hi);
    if ((has_lo && fabs(lo) > JS_MULT_EXACT) || (has_hi && fabs(hi) > JS_MULT_EXACT))
        return js_fail(c, ptr, "multipleOf", "not supported beside bounds beyond 9e15");
    tdm_buf_t body = TDM_BUF_INIT;
    char pos[JS_NAME_MAX];
    int rc = 0;
    double first = has_lo ? ceil(lo / k) * k : 0, last = has_hi ? floor(hi / k) * k : 0;
    if (has_lo && has_hi && first > last)
        return js_fail_unsat(c, ptr, "multipleOf", "no multiple within the bounds");
    if (has_lo && has_hi && (last - first) / k < JS_MULT_ENUM) {
        rc = listed(c, k, lo, hi, &body);
    } else if (has_hi || (has_lo && lo > k)) {
        return js_fail(c, ptr, "multipleOf",
                       "not supported beside these bounds (more than %d multiples, or a lower "
                       "bound above multipleOf)",
                       JS_MULT_ENUM);
    } else if ((rc = positive_rules(c, (unsigned)k, pos)) == 0) {
        /* lo unset: every multiple; lo <= 0: 0 and the positive ones (and the negative ones
         * down to lo, listed); 0 < lo <= k: the positive ones */
        tdm_buf_printf(&body, "%s%s", pos, !has_lo || lo <= 0 ? " | \"0\"" : "");
        if (!has_lo)
            tdm_buf_printf(&body, " | \"-\" %s", pos);
        else if (lo <= -k && (-lo) / k < JS_MULT_ENUM) {
            tdm_buf_puts(&body, " | ");
            rc = listed(c, k, lo, -k, &body);
        } else if (lo <= -k) {
            rc = js_fail(c, ptr, "multipleOf", "not supported beside this lower bound");
        }
    }
    if (rc == 0) {
        js_new_name(c, name);
        rc = body.oom ? js_oom(c) : js_emit_rule(c, name, body.data);
    }
    tdm_buf_free(&body);
    return rc;
}
