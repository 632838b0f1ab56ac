/* json_schema_negate.c - the complement of a schema as a union of schemas, and what is built
 * from it: `oneOf` whose branches may overlap (each branch with the complements of the others),
 * `if` / `then` / `else` (if and then, or the complement of if and else), and the general
 * `not`. Every construction is exact; a schema whose complement cannot be written this way is
 * refused with the pointer of the keyword.
 *
 * The complement of a schema is the union, over its keywords, of the values each keyword
 * rejects, and a keyword that applies to one type rejects only values of that type:
 * not {type: T} is the other types, not {minLength: n} the strings shorter than n, not
 * {required: [k]} the objects without k, not {properties: {p: S}} the objects with p whose value
 * is in the complement of S, not {allOf} the union of the branches' complements, not {not: S}
 * is S. Combinations that allow no value (a branch of type object with a case of type string)
 * are found by the merge and left out.
 */
#include <stdio.h>
#include <string.h>

#include "json_schema_internal.h"

#define JS_MAX_COMBOS 256 /* alternatives one oneOf may expand into */

static const char *const k_types[] = {"null", "boolean", "object", "array", "number", "string"};

static int add_case(js_ctx_t *c, json_t *out, json_t *v)
{
    if (!v || json_array_append_new(out, v) != 0)
        return js_oom(c);
    return 0;
}

/* {type: t, key: v} for a keyword's failing values of its type. */
static int typed_case(js_ctx_t *c, json_t *out, const char *t, const char *key, json_t *v)
{
    json_t *s = json_pack("{s:s,s:O}", "type", t, key, v);
    return add_case(c, out, s);
}

/* not {type: X}: the other types (with integer but not number in X: the other numbers too). */
static int negate_type(js_ctx_t *c, json_t *t, const char *ptr, json_t *out)
{
    bool has[6] = {false}, integer = false;
    json_t *list = json_is_array(t) ? t : json_pack("[O]", t), *e;
    size_t i;
    json_array_foreach(list, i, e)
    {
        const char *n = json_string_value(e);
        integer = integer || (n && strcmp(n, "integer") == 0);
        for (int k = 0; n && k < 6; k++)
            has[k] = has[k] || strcmp(n, k_types[k]) == 0;
    }
    if (list != t)
        json_decref(list);
    json_t *rest = json_array();
    for (int k = 0; rest && k < 6; k++)
        if (!has[k] && !(k == 4 && integer))
            json_array_append_new(rest, json_string(k_types[k]));
    /* the numbers that are not integers: kept as not {type: integer}, which leaves nothing
     * beside an integer and is refused beside every number (without_not) */
    if (integer && !has[4]) {
        int rc = add_case(c, out,
                          json_pack("{s:s,s:{s:s}}", "type", "number", "not", "type", "integer"));
        if (rc != 0) {
            json_decref(rest);
            return rc;
        }
    }
    if (json_array_size(rest) == 0) {
        json_decref(rest);
        return rest ? 0 : js_oom(c);
    }
    return add_case(c, out, json_pack("{s:o}", "type", rest));
}

/* not {required: R}: for each name, the objects without it. */
static int negate_required(js_ctx_t *c, json_t *r, json_t *out)
{
    size_t i;
    json_t *k;
    json_array_foreach(r, i, k)
    {
        if (!json_is_string(k))
            continue;
        int rc = add_case(
            c, out,
            json_pack("{s:s,s:{s:b}}", "type", "object", "properties", json_string_value(k), 0));
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* not {properties: P}: the objects with some p whose value is in the complement of P[p]. */
static int negate_properties(js_ctx_t *c, json_t *props, const char *ptr, json_t *out)
{
    const char *key;
    json_t *sub;
    char pp[JS_PTR_MAX];
    js_ptr_join(pp, ptr, "properties");
    json_object_foreach(props, key, sub)
    {
        char kp[JS_PTR_MAX];
        js_ptr_join(kp, pp, key);
        json_t *cases = json_array();
        if (!cases || json_array_append_new(c->keep, cases) != 0)
            return js_oom(c);
        int rc = js_negate(c, sub, kp, cases);
        size_t i;
        json_t *v;
        json_array_foreach(cases, i, v)
        {
            if (rc != 0)
                break; /* nothing more is packed, so nothing is left unowned */
            rc = add_case(c, out,
                          json_pack("{s:s,s:[s],s:{s:O}}", "type", "object", "required", key,
                                    "properties", key, v));
        }
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* not {items: S}: the arrays with an item in the complement of S (contains). */
static int negate_items(js_ctx_t *c, json_t *items, const char *ptr, json_t *out)
{
    char ip[JS_PTR_MAX];
    js_ptr_join(ip, ptr, "items");
    json_t *cases = json_array(), *v;
    if (!cases || json_array_append_new(c->keep, cases) != 0)
        return js_oom(c);
    int rc = js_negate(c, items, ip, cases);
    size_t i;
    json_array_foreach(cases, i, v)
    {
        if (rc == 0)
            rc = add_case(c, out, json_pack("{s:s,s:O}", "type", "array", "contains", v));
    }
    return rc;
}

/* A bound keyword's complement: the values of its type on the other side. */
static int negate_bound(js_ctx_t *c, const char *key, json_t *v, const char *ptr, json_t *out)
{
    static const char *const pairs[][3] = {{"minimum", "exclusiveMaximum", "number"},
                                           {"maximum", "exclusiveMinimum", "number"},
                                           {"exclusiveMinimum", "maximum", "number"},
                                           {"exclusiveMaximum", "minimum", "number"},
                                           {"minLength", "maxLength", "string"},
                                           {"maxLength", "minLength", "string"},
                                           {"minItems", "maxItems", "array"},
                                           {"maxItems", "minItems", "array"},
                                           {"minProperties", "maxProperties", "object"},
                                           {"maxProperties", "minProperties", "object"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        if (strcmp(pairs[i][0], key) != 0)
            continue;
        if (!json_is_number(v))
            return js_fail(c, ptr, key, "not supported in a negation (not a number)");
        if (i < 4)
            return typed_case(c, out, pairs[i][2], pairs[i][1], v);
        json_int_t n = json_is_integer(v) ? json_integer_value(v) : -1;
        if (n < 0)
            return js_fail(c, ptr, key, "not supported in a negation (not a count)");
        bool min = i % 2 == 0;
        if (min && n == 0)
            return 0; /* every value passes minLength 0 */
        json_t *m = json_integer(min ? n - 1 : n + 1);
        int rc = m ? typed_case(c, out, pairs[i][2], pairs[i][1], m) : js_oom(c);
        json_decref(m);
        return rc;
    }
    return 1; /* not a bound */
}

static bool is_annotation_or_unknown(const char *key)
{
    static const char *const k_validation[] = {"type",
                                               "enum",
                                               "const",
                                               "properties",
                                               "required",
                                               "allOf",
                                               "not",
                                               "minimum",
                                               "maximum",
                                               "exclusiveMinimum",
                                               "exclusiveMaximum",
                                               "minLength",
                                               "maxLength",
                                               "minItems",
                                               "maxItems",
                                               "additionalProperties",
                                               "items",
                                               "prefixItems",
                                               "additionalItems",
                                               "anyOf",
                                               "oneOf",
                                               "$ref",
                                               "pattern",
                                               "format",
                                               "minProperties",
                                               "maxProperties",
                                               "patternProperties",
                                               "dependentRequired",
                                               "dependencies",
                                               "dependentSchemas",
                                               "propertyNames",
                                               "if",
                                               "then",
                                               "else",
                                               "uniqueItems",
                                               "contains",
                                               "minContains",
                                               "maxContains",
                                               "multipleOf",
                                               "unevaluatedProperties",
                                               "unevaluatedItems",
                                               "$dynamicRef",
                                               "$recursiveRef",
                                               NULL};
    for (const char *const *k = k_validation; *k; k++)
        if (strcmp(*k, key) == 0)
            return false;
    return true;
}

/* not {anyOf: [A, B, ...]}: the values no branch matches, (not A) and (not B) and ...: every
 * combination of one case of each branch's complement, their allOf; not {oneOf: ...} adds the
 * values two branches match, A and B for each pair. At most JS_MAX_COMBOS cases. */
static int negate_any_one(js_ctx_t *c, const char *key, json_t *v, const char *ptr, json_t *out)
{
    char kp[JS_PTR_MAX], bp[JS_PTR_MAX];
    js_ptr_join(kp, ptr, key);
    json_t *acc = json_pack("[b]", 1), *b, *x, *y;
    if (!acc || json_array_append_new(c->keep, acc) != 0)
        return js_oom(c);
    size_t i, j, k;
    json_array_foreach(v, i, b)
    {
        json_t *cases = json_array(), *next = json_array();
        if (!cases || json_array_append_new(c->keep, cases) != 0 || !next ||
            json_array_append_new(c->keep, next) != 0)
            return js_oom(c);
        js_ptr_index(bp, kp, i);
        int rc = js_negate(c, b, bp, cases);
        if (rc != 0)
            return rc;
        json_array_foreach(acc, j, x) json_array_foreach(cases, k, y)
        {
            if (json_array_size(next) >= JS_MAX_COMBOS)
                return js_fail(c, ptr, key, "not supported in a negation (over %d cases)",
                               JS_MAX_COMBOS);
            rc = add_case(c, next,
                          json_is_true(x) ? json_incref(y) : json_pack("{s:[OO]}", "allOf", x, y));
            if (rc != 0)
                return rc;
        }
        acc = next;
    }
    json_array_foreach(acc, j, x)
    {
        int rc = add_case(c, out, json_incref(x));
        if (rc != 0)
            return rc;
    }
    if (strcmp(key, "oneOf") != 0)
        return 0;
    for (i = 0; i < json_array_size(v); i++)
        for (j = i + 1; j < json_array_size(v); j++) {
            if (json_array_size(out) >= 4 * JS_MAX_COMBOS)
                return js_fail(c, ptr, key, "not supported in a negation (over %d cases)",
                               4 * JS_MAX_COMBOS);
            int rc = add_case(
                c, out, json_pack("{s:[OO]}", "allOf", json_array_get(v, i), json_array_get(v, j)));
            if (rc != 0)
                return rc;
        }
    return 0;
}

/* One keyword of a schema being negated: its failing values appended to out. */
static int negate_key(js_ctx_t *c, json_t *s, const char *key, json_t *v, const char *ptr,
                      json_t *out)
{
    if (is_annotation_or_unknown(key) || strcmp(key, "then") == 0 || strcmp(key, "else") == 0)
        return 0;
    if (strcmp(key, "type") == 0)
        return negate_type(c, v, ptr, out);
    if (strcmp(key, "enum") == 0 || strcmp(key, "const") == 0) {
        json_t *vals = strcmp(key, "enum") == 0 ? json_incref(v) : json_pack("[O]", v);
        return add_case(c, out, json_pack("{s:{s:o}}", "not", "enum", vals));
    }
    if (strcmp(key, "required") == 0)
        return negate_required(c, v, out);
    if (strcmp(key, "properties") == 0 && json_is_object(v))
        return negate_properties(c, v, ptr, out);
    if (strcmp(key, "additionalProperties") == 0 && json_is_true(v))
        return 0;
    if (strcmp(key, "uniqueItems") == 0 && json_is_false(v))
        return 0;
    if (strcmp(key, "not") == 0)
        return add_case(c, out, json_incref(v));
    if (strcmp(key, "items") == 0 && (json_is_object(v) || json_is_boolean(v)) &&
        !json_object_get(s, "prefixItems"))
        return negate_items(c, v, ptr, out);
    if (strcmp(key, "contains") == 0) { /* arrays none of whose items match: items not it */
        json_t *cases = json_array();
        char cp[JS_PTR_MAX];
        js_ptr_join(cp, ptr, "contains");
        if (!cases || json_array_append_new(c->keep, cases) != 0)
            return js_oom(c);
        int rc = js_negate(c, v, cp, cases);
        return rc ? rc
                  : add_case(c, out,
                             json_pack("{s:s,s:{s:O}}", "type", "array", "items", "anyOf", cases));
    }
    if (strcmp(key, "format") == 0 && js_format_custom(v))
        return 0; /* an annotation: rejects nothing */
    if (strcmp(key, "pattern") == 0 || strcmp(key, "format") == 0) {
        tdm_buf_t rx = TDM_BUF_INIT; /* a format without a regex form stays refused */
        bool ok =
            json_is_string(v) && (key[0] == 'p' || js_format_regex(json_string_value(v), &rx) == 0);
        tdm_buf_free(&rx);
        if (ok) /* the strings it does not match (js_string, through the automaton) */
            return add_case(c, out, json_pack("{s:s,s:{s:O}}", "type", "string", "not", key, v));
    }
    if ((strcmp(key, "anyOf") == 0 || strcmp(key, "oneOf") == 0) && json_is_array(v) &&
        json_array_size(v) > 0)
        return negate_any_one(c, key, v, ptr, out);
    if (strcmp(key, "allOf") == 0 && json_is_array(v)) {
        char ap[JS_PTR_MAX];
        js_ptr_join(ap, ptr, "allOf");
        size_t i;
        json_t *b;
        json_array_foreach(v, i, b)
        {
            char bp[JS_PTR_MAX];
            js_ptr_index(bp, ap, i);
            int rc = js_negate(c, b, bp, out);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
    int rc = negate_bound(c, key, v, ptr, out);
    if (rc <= 0)
        return rc;
    (void)s;
    return js_fail(c, ptr, key, "not supported in a negation (oneOf, if, not)");
}

int js_negate(js_ctx_t *c, json_t *s, const char *ptr, json_t *out)
{
    int rc = js_resolve_top(c, s, ptr, &s);
    if (rc != 0)
        return rc;
    if (json_is_false(s))
        return add_case(c, out, json_true());
    if (json_is_true(s))
        return 0;
    if (!json_is_object(s))
        return js_fail(c, ptr, NULL, "a schema must be an object or a boolean");
    if (++c->depth > JS_MAX_DEPTH) {
        c->depth--;
        return js_fail(c, ptr, NULL, "subschemas nested too deep (over %d)", JS_MAX_DEPTH);
    }
    const char *key;
    json_t *v;
    json_object_foreach(s, key, v)
    {
        if ((rc = negate_key(c, s, key, v, ptr, out)) != 0)
            break;
    }
    if (rc == 0 && json_object_get(s, "if")) /* if without then/else constrains nothing */
        rc = json_object_get(s, "then") || json_object_get(s, "else")
                 ? js_fail(c, ptr, "if", "not supported in a negation (oneOf, if, not)")
                 : 0;
    c->depth--;
    return rc;
}

/* ---- unions of merged cases ---- */

/* acc merged with each schema of parts[n] (NULL entries skipped) into *out; 1 when the merge
 * allows no value (nothing kept), 0, or an error. */
static int merge_all(js_ctx_t *c, json_t *acc, json_t *const *parts, size_t n, const char *ptr,
                     json_t **out)
{
    js_mark_t m;
    js_mark_set(c, &m);
    for (size_t i = 0; i < n; i++) {
        if (!parts[i])
            continue;
        int rc = js_merge(c, acc, parts[i], ptr, &acc);
        if (rc == TDM_EINVALID && c->unsat) {
            js_mark_undo(c, &m);
            return 1;
        }
        if (rc != 0)
            return rc;
    }
    *out = acc;
    return 0;
}

int js_union_add(js_ctx_t *c, json_t *s, const char *ptr, tdm_buf_t *body)
{
    js_mark_t m;
    js_mark_set(c, &m);
    char sub[JS_NAME_MAX];
    int rc = js_compile(c, s, ptr, sub);
    if (rc == TDM_EINVALID && c->unsat) {
        js_mark_undo(c, &m);
        return 0;
    }
    if (rc == 0)
        tdm_buf_printf(body, "%s%s", body->len ? " | " : "", sub);
    return rc;
}

int js_union_emit(js_ctx_t *c, tdm_buf_t *body, const char *ptr, const char *key, char *name)
{
    if (body->len == 0)
        return js_fail_unsat(c, ptr, key, "no value allowed");
    js_new_name(c, name);
    return body->oom ? js_oom(c) : js_emit_rule(c, name, body->data);
}

int js_compile_union(js_ctx_t *c, json_t *base, json_t *cases, const char *ptr, const char *key,
                     char *name)
{
    tdm_buf_t body = TDM_BUF_INIT;
    size_t i;
    json_t *v, *m;
    int rc = 0;
    json_array_foreach(cases, i, v)
    {
        rc = merge_all(c, base, &v, 1, ptr, &m);
        rc = rc == 1 ? 0 : rc ? rc : js_union_add(c, m, ptr, &body);
        if (rc != 0)
            break;
    }
    rc = rc ? rc : js_union_emit(c, &body, ptr, key, name);
    tdm_buf_free(&body);
    return rc;
}

int js_compile_negated(js_ctx_t *c, json_t *base, json_t *n, const char *ptr, char *name)
{
    char np[JS_PTR_MAX];
    js_ptr_join(np, ptr, "not");
    json_t *cases = json_array();
    if (!cases || json_array_append_new(c->keep, cases) != 0)
        return js_oom(c);
    int rc = js_negate(c, n, np, cases);
    return rc ? rc : js_compile_union(c, base, cases, ptr, "not", name);
}

int js_compile_if(js_ctx_t *c, json_t *base, json_t *s, const char *ptr, char *name)
{
    char ip[JS_PTR_MAX];
    js_ptr_join(ip, ptr, "if");
    json_t *cond = json_object_get(s, "if"), *then = json_object_get(s, "then");
    json_t *els = json_object_get(s, "else"), *cases = json_array(), *m, *v;
    if (!cases || json_array_append_new(c->keep, cases) != 0)
        return js_oom(c);
    int rc = js_negate(c, cond, ip, cases);
    tdm_buf_t body = TDM_BUF_INIT;
    json_t *yes[2] = {cond, then};
    if (rc == 0)
        rc = merge_all(c, base, yes, 2, ptr, &m);
    rc = rc == 1 ? 0 : rc ? rc : js_union_add(c, m, ptr, &body);
    size_t i;
    json_array_foreach(cases, i, v)
    {
        json_t *no[2] = {v, els};
        if (rc != 0)
            break;
        rc = merge_all(c, base, no, 2, ptr, &m);
        rc = rc == 1 ? 0 : rc ? rc : js_union_add(c, m, ptr, &body);
    }
    rc = rc ? rc : js_union_emit(c, &body, ptr, "if", name);
    tdm_buf_free(&body);
    return rc;
}

/* The alternatives of branch i: it merged with one case of the complement of every other
 * branch it may overlap (neg[j] NULL: disjoint from i), each combination in turn. */
static int one_of_branch(js_ctx_t *c, json_t *branches, json_t *const *neg, size_t i,
                         const char *bp, tdm_buf_t *body, size_t *budget)
{
    size_t n = json_array_size(branches), idx[64] = {0};
    json_t *parts[64];
    for (;;) {
        bool empty = false;
        for (size_t j = 0; j < n; j++) {
            parts[j] = NULL;
            if (j != i && neg[j]) {
                empty = empty || json_array_size(neg[j]) == 0;
                parts[j] = json_array_get(neg[j], idx[j]);
            }
        }
        if (empty)
            return 0; /* a branch that accepts everything i accepts: i never matches alone */
        if ((*budget)-- == 0)
            return js_fail(c, bp, NULL, "oneOf: more than %d cases not supported", JS_MAX_COMBOS);
        json_t *m;
        int rc = merge_all(c, json_array_get(branches, i), parts, n, bp, &m);
        rc = rc == 1 ? 0 : rc ? rc : js_union_add(c, m, bp, body);
        if (rc != 0)
            return rc;
        size_t j = 0; /* next combination, odometer order */
        for (; j < n; j++) {
            if (j == i || !neg[j])
                continue;
            if (++idx[j] < json_array_size(neg[j]))
                break;
            idx[j] = 0;
        }
        if (j == n)
            return 0;
    }
}

int js_compile_one_of(js_ctx_t *c, json_t *branches, json_t *originals, const char *ptr, char *name)
{
    size_t n = json_array_size(branches), budget = JS_MAX_COMBOS;
    if (n > 64)
        return js_fail(c, ptr, NULL, "oneOf: more than 64 branches not supported");
    json_t *neg[64] = {NULL};
    int rc = 0;
    for (size_t j = 0; j < n && rc == 0; j++) {
        char bp[JS_PTR_MAX];
        js_ptr_index(bp, ptr, j);
        neg[j] = json_array();
        if (!neg[j] || json_array_append_new(c->keep, neg[j]) != 0)
            return js_oom(c);
        rc = js_negate(c, json_array_get(originals, j), bp, neg[j]);
    }
    tdm_buf_t body = TDM_BUF_INIT;
    for (size_t i = 0; i < n && rc == 0; i++) {
        json_t *own[64];
        for (size_t j = 0; j < n; j++) {
            json_t *a, *b;
            own[j] = NULL;
            if (j == i)
                continue;
            rc = js_resolve_top(c, json_array_get(branches, i), ptr, &a);
            rc = rc ? rc : js_resolve_top(c, json_array_get(branches, j), ptr, &b);
            if (rc != 0)
                break;
            own[j] = js_disjoint(a, b) ? NULL : neg[j];
        }
        char bp[JS_PTR_MAX];
        js_ptr_index(bp, ptr, i);
        rc = rc ? rc : one_of_branch(c, branches, own, i, bp, &body, &budget);
    }
    rc = rc ? rc : js_union_emit(c, &body, ptr, NULL, name);
    tdm_buf_free(&body);
    return rc;
}
