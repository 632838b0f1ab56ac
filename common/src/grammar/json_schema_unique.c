/* json_schema_unique.c - `uniqueItems: true` over arrays whose items come from a finite set of
 * scalar values (`enum` / `const`, `boolean`, `null`), compiled exactly: one rule per set of
 * values already used, each offering only the unused ones next, so no value can repeat. 2^k
 * rules for k values, so k is bounded (JS_UNIQUE_MAX); other item schemas are refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"

#define JS_UNIQUE_MAX 10 /* distinct item values: 1,024 rules at most */

static bool has_type(json_t *t, const char *name)
{
    if (json_is_string(t))
        return strcmp(json_string_value(t), name) == 0;
    size_t i;
    json_t *e;
    json_array_foreach(t, i, e) if (json_is_string(e) &&
                                    strcmp(json_string_value(e), name) == 0) return true;
    return false;
}

/* Whether scalar v is of a type t allows (t NULL: all). */
static bool type_allows(json_t *t, json_t *v)
{
    if (!t)
        return true;
    if (json_is_string(v))
        return has_type(t, "string");
    if (json_is_boolean(v))
        return has_type(t, "boolean");
    if (json_is_null(v))
        return has_type(t, "null");
    if (has_type(t, "number"))
        return true;
    double d = json_number_value(v);
    return has_type(t, "integer") && (json_is_integer(v) || d == (double)(long long)d);
}

static bool same_value(json_t *a, json_t *b)
{
    if (json_is_number(a) && json_is_number(b))
        return json_number_value(a) == json_number_value(b);
    return json_equal(a, b);
}

/* The item values of items schema it (resolved) into vals (at most JS_UNIQUE_MAX + 1). */
static int item_values(js_ctx_t *c, json_t *it, const char *ip, json_t **vals, size_t *n)
{
    const char *key;
    json_t *v, *t = json_object_get(it, "type"), *en = json_object_get(it, "enum");
    json_t *cn = json_object_get(it, "const"), *all = json_array();
    if (!all || json_array_append_new(c->keep, all) != 0)
        return js_oom(c);
    json_object_foreach(it, key, v)
    {
        if (strcmp(key, "type") && strcmp(key, "enum") && strcmp(key, "const") &&
            js_keyword_constrains(key))
            return js_fail(c, ip, key, "not supported beside uniqueItems");
    }
    if (cn)
        json_array_append(all, cn);
    else if (json_is_array(en))
        json_array_extend(all, en);
    else if (t && !has_type(t, "string") && !has_type(t, "number") && !has_type(t, "integer") &&
             !has_type(t, "object") && !has_type(t, "array")) {
        json_t *fixed = json_pack("[bbn]", 1, 0);
        if (!fixed || json_array_extend(all, fixed) != 0) {
            json_decref(fixed);
            return js_oom(c);
        }
        json_decref(fixed);
    } else
        return js_fail(c, ip, NULL,
                       "uniqueItems: items must be an enum, a const, booleans or null");
    size_t i;
    *n = 0;
    json_array_foreach(all, i, v)
    {
        bool dup = (cn && en && !json_equal(v, cn)) || !type_allows(t, v);
        for (size_t k = 0; k < *n && !dup; k++)
            dup = same_value(vals[k], v);
        if (dup)
            continue;
        if (json_is_object(v) || json_is_array(v))
            return js_fail(c, ip, NULL, "uniqueItems: object and array values not supported");
        if (*n == JS_UNIQUE_MAX)
            return js_fail(c, ip, NULL, "uniqueItems: more than %d distinct values not supported",
                           JS_UNIQUE_MAX);
        vals[(*n)++] = v;
    }
    return 0;
}

static int popcount(unsigned x)
{
    int n = 0;
    for (; x; x &= x - 1)
        n++;
    return n;
}

/* The rules: after the set used of values, a comma and an unused value, or the end. */
static int unique_rules(js_ctx_t *c, char (*lit)[JS_NAME_MAX], size_t k, size_t lo, size_t hi,
                        const char *ws, char (*r)[JS_NAME_MAX])
{
    tdm_buf_t b = TDM_BUF_INIT;
    int rc = 0;
    for (unsigned s = 0; s < (1u << k) && rc == 0; s++) {
        size_t used = (size_t)popcount(s);
        if (used > hi)
            continue;
        tdm_buf_clear(&b);
        for (size_t i = 0; i < k && used < hi; i++)
            if (!(s & (1u << i)))
                tdm_buf_printf(&b, "%s%s%s %s %s %s", b.len ? " | " : "", s ? "\",\" " : "",
                               s ? ws : "", lit[i], ws, r[s | (1u << i)]);
        if (used >= lo)
            tdm_buf_printf(&b, "%s\"]\"", b.len ? " | " : "");
        if (b.len == 0)
            continue; /* cannot end and cannot go on: unreachable from a live start */
        rc = b.oom ? js_oom(c) : js_emit_rule(c, r[s], b.data);
    }
    tdm_buf_free(&b);
    return rc;
}

int js_array_unique(js_ctx_t *c, json_t *s, const char *ptr, size_t lo, size_t hi, char *name)
{
    json_t *items = json_object_get(s, "items"), *vals[JS_UNIQUE_MAX + 1];
    if (json_object_get(s, "prefixItems") || json_is_array(items))
        return js_fail(c, ptr, "uniqueItems", "not supported beside tuple items");
    char ip[JS_PTR_MAX], ws[JS_NAME_MAX];
    js_ptr_join(ip, ptr, "items");
    json_t *it = items;
    size_t k = 0;
    int rc = items ? js_resolve_top(c, items, ip, &it) : 0;
    if (rc == 0 && !json_is_object(it))
        return js_fail(c, ptr, "uniqueItems", "items must be an enum, a const, booleans or null");
    rc = rc ? rc : item_values(c, it, ip, vals, &k);
    rc = rc ? rc : js_prim(c, JS_PRIM_WS, ws);
    if (rc != 0)
        return rc;
    hi = hi < k ? hi : k;
    if (lo > hi)
        return js_fail_unsat(c, ptr, "minItems", "more items than distinct values");
    char(*lit)[JS_NAME_MAX] = calloc(k + 1, JS_NAME_MAX);
    char(*r)[JS_NAME_MAX] = calloc((size_t)1 << k, JS_NAME_MAX);
    tdm_buf_t b = TDM_BUF_INIT;
    rc = lit && r ? 0 : js_oom(c);
    for (size_t i = 0; i < k && rc == 0; i++) {
        tdm_buf_clear(&b);
        rc = js_literal(c, vals[i], &b);
        js_new_name(c, lit[i]);
        rc = rc ? rc : b.oom ? js_oom(c) : js_emit_rule(c, lit[i], b.data);
    }
    for (unsigned m = 0; rc == 0 && m < (1u << k); m++)
        js_new_name(c, r[m]);
    rc = rc ? rc : unique_rules(c, lit, k, lo, hi, ws, r);
    if (rc == 0) {
        tdm_buf_clear(&b);
        tdm_buf_printf(&b, "\"[\" %s %s", ws, r[0]);
        js_new_name(c, name);
        rc = b.oom ? js_oom(c) : js_emit_rule(c, name, b.data);
    }
    tdm_buf_free(&b);
    free(lit);
    free(r);
    return rc;
}
