/* json_schema_merge.c - the intersection of two schemas as one schema: allOf, and the
 * sibling keywords of $ref / anyOf / oneOf. What cannot be merged exactly is refused, naming
 * the pointer of the allOf (or anyOf) branch: two different patterns or formats, two anyOf,
 * two prefixItems, additionalProperties beside different property sets, differing draft-4
 * boolean exclusives.
 *
 * Merged properties, items and additionalProperties become {"allOf": [a, b]}, compiled (and
 * merged) when the compiler gets to them, so recursive schemas merge lazily.
 */
#include <math.h>
#include <string.h>

#include "json_schema_internal.h"

static const char *const k_lower[] = {"minimum", "exclusiveMinimum", "minLength", "minItems",
                                      NULL};
static const char *const k_upper[] = {"maximum", "exclusiveMaximum", "maxLength", "maxItems",
                                      NULL};

static bool in(const char *const *list, const char *key)
{
    for (; *list; list++)
        if (strcmp(*list, key) == 0)
            return true;
    return false;
}

static json_t *all_of2(json_t *a, json_t *b)
{
    return json_pack("{s:[OO]}", "allOf", a, b);
}

/* type: the intersection of the two type sets ("integer" within "number"). */
static json_t *merge_type(json_t *a, json_t *b)
{
    json_t *out = json_array(), *x, *y;
    size_t i, j;
    json_t *la = json_is_array(a) ? json_incref(a) : json_pack("[O]", a);
    json_t *lb = json_is_array(b) ? json_incref(b) : json_pack("[O]", b);
    json_array_foreach(la, i, x)
    {
        json_array_foreach(lb, j, y)
        {
            const char *p = json_string_value(x), *q = json_string_value(y);
            if (!p || !q)
                continue;
            if (strcmp(p, q) == 0 || (strcmp(p, "integer") == 0 && strcmp(q, "number") == 0))
                json_array_append(out, x);
            else if (strcmp(p, "number") == 0 && strcmp(q, "integer") == 0)
                json_array_append(out, y);
        }
    }
    json_decref(la);
    json_decref(lb);
    return out;
}

/* enum: the values in both. */
static json_t *merge_enum(json_t *a, json_t *b)
{
    json_t *out = json_array(), *x, *y;
    size_t i, j;
    json_array_foreach(a, i, x)
    {
        json_array_foreach(b, j, y)
        {
            if (json_equal(x, y)) {
                json_array_append(out, x);
                break;
            }
        }
    }
    return out;
}

/* properties: the union, with common names as allOf. */
static json_t *merge_props(json_t *a, json_t *b)
{
    json_t *out = json_copy(a), *v;
    const char *key;
    json_object_foreach(b, key, v)
    {
        json_t *x = json_object_get(a, key);
        json_object_set_new(out, key, x ? all_of2(x, v) : json_incref(v));
    }
    return out;
}

static json_t *merge_required(json_t *a, json_t *b)
{
    json_t *out = json_copy(a), *v;
    size_t i;
    json_array_foreach(b, i, v)
    {
        bool seen = false;
        json_t *w;
        size_t j;
        json_array_foreach(a, j, w) seen = seen || json_equal(v, w);
        if (!seen)
            json_array_append(out, v);
    }
    return out;
}

/* Whether two property objects define the same names. */
static bool same_names(json_t *a, json_t *b)
{
    const char *key;
    json_t *v;
    if (json_object_size(a) != json_object_size(b))
        return false;
    json_object_foreach(a, key, v)
    {
        if (!json_object_get(b, key))
            return false;
    }
    return true;
}

static const char *const k_must_equal[] = {"pattern", "format", "prefixItems", "additionalItems",
                                           "$ref", NULL};

/* The merged value of one keyword both schemas have (*out new reference), or an error. */
static int merge_key(js_ctx_t *c, const char *key, json_t *x, json_t *y, const char *ptr,
                     json_t **out)
{
    *out = NULL;
    bool both_num = json_is_number(x) && json_is_number(y);
    if ((in(k_lower, key) || in(k_upper, key)) && both_num) {
        double p = json_number_value(x), q = json_number_value(y);
        *out = json_incref((in(k_lower, key) ? p >= q : p <= q) ? x : y);
    } else if (strcmp(key, "type") == 0) {
        *out = merge_type(x, y);
        if (*out && json_array_size(*out) == 0) {
            json_decref(*out);
            return js_fail_unsat(c, ptr, NULL, "allOf: the types do not intersect");
        }
    } else if (strcmp(key, "properties") == 0 && json_is_object(x) && json_is_object(y)) {
        *out = merge_props(x, y);
    } else if (strcmp(key, "required") == 0 && json_is_array(x) && json_is_array(y)) {
        *out = merge_required(x, y);
    } else if (strcmp(key, "enum") == 0 && json_is_array(x) && json_is_array(y)) {
        *out = merge_enum(x, y);
    } else if (strcmp(key, "allOf") == 0 && json_is_array(x) && json_is_array(y)) {
        *out = json_copy(x);
        json_array_extend(*out, y);
    } else if (strcmp(key, "items") == 0 && json_is_object(x) && json_is_object(y)) {
        *out = all_of2(x, y);
    } else if (json_equal(x, y) || !(in(k_must_equal, key) || in(k_lower, key) ||
                                     in(k_upper, key) || strcmp(key, "const") == 0 ||
                                     strcmp(key, "anyOf") == 0 || strcmp(key, "oneOf") == 0 ||
                                     strcmp(key, "items") == 0)) {
        *out = json_incref(x); /* equal, or an annotation / unknown keyword: the first one's */
    } else {
        return js_fail(c, ptr, NULL, "allOf: two different '%s' cannot be merged", key);
    }
    return *out ? 0 : js_oom(c);
}

/* additionalProperties of the merge: exact only over the same property names. */
static int merge_additional(js_ctx_t *c, json_t *a, json_t *b, const char *ptr, json_t *out)
{
    json_t *x = json_object_get(a, "additionalProperties");
    json_t *y = json_object_get(b, "additionalProperties");
    bool xt = !x || json_is_true(x), yt = !y || json_is_true(y);
    if (xt && yt)
        return 0;
    json_t *pa = json_object_get(a, "properties"), *pb = json_object_get(b, "properties");
    json_t *e = json_object();
    bool same = same_names(pa ? pa : e, pb ? pb : e);
    json_decref(e);
    if (!same)
        return js_fail(c, ptr, NULL,
                       "allOf: additionalProperties beside different properties not supported");
    json_t *v = xt                                         ? json_incref(y)
                : yt                                       ? json_incref(x)
                : (json_is_false(x) || json_is_false(y)) ? json_false()
                                                           : all_of2(x, y);
    return json_object_set_new(out, "additionalProperties", v) == 0 ? 0 : js_oom(c);
}

int js_merge(js_ctx_t *c, json_t *a, json_t *b, const char *ptr, json_t **out)
{
    int rc = js_resolve_top(c, a, ptr, &a);
    rc = rc ? rc : js_resolve_top(c, b, ptr, &b);
    if (rc != 0)
        return rc;
    if (json_is_false(a) || json_is_false(b))
        return js_fail_unsat(c, ptr, NULL, "allOf: the schema false allows no value");
    if (json_is_true(a) || (json_is_object(a) && json_object_size(a) == 0)) {
        *out = b;
        return 0;
    }
    if (json_is_true(b) || (json_is_object(b) && json_object_size(b) == 0)) {
        *out = a;
        return 0;
    }
    if (!json_is_object(a) || !json_is_object(b))
        return js_fail(c, ptr, NULL, "a schema must be an object or a boolean");
    json_t *m = json_object();
    if (!m || json_array_append_new(c->keep, m) != 0)
        return js_oom(c);
    const char *key;
    json_t *x, *v;
    json_object_foreach(a, key, x)
    {
        json_t *y = json_object_get(b, key);
        if (strcmp(key, "additionalProperties") == 0)
            continue;
        if (!y) {
            v = json_incref(x);
        } else if ((rc = merge_key(c, key, x, y, ptr, &v)) != 0) {
            return rc;
        }
        if (json_object_set_new(m, key, v) != 0)
            return js_oom(c);
    }
    json_object_foreach(b, key, v)
    {
        if (!json_object_get(a, key) && strcmp(key, "additionalProperties") != 0 &&
            json_object_set(m, key, v) != 0)
            return js_oom(c);
    }
    rc = merge_additional(c, a, b, ptr, m);
    *out = m;
    return rc;
}
