/* json_schema_merge.c - the intersection of two schemas as one schema: allOf, and the
 * sibling keywords of $ref / anyOf / oneOf. What cannot be merged exactly is refused, naming
 * the pointer of the allOf (or anyOf) branch: two different patterns or formats, two anyOf,
 * two prefixItems, differing draft-4 boolean exclusives. additionalProperties merges exactly:
 * a property one side defines must also satisfy the other side's additionalProperties.
 *
 * Merged properties, items and additionalProperties become {"allOf": [a, b]}, compiled (and
 * merged) when the compiler gets to them, so recursive schemas merge lazily.
 *
 * Merged properties come in document order (llguidance's rule): each name at the position of
 * its first definition in the document among the merged schemas, whichever side of the merge
 * it came from; a schema's properties written after its additionalProperties count as written
 * where additionalProperties stands. Positions are counted once per compile, in a walk of the
 * whole document (jansson keeps members in the order of the text).
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"

static const char *const k_lower[] = {"minimum",  "exclusiveMinimum", "minLength",
                                      "minItems", "minProperties",    NULL};
static const char *const k_upper[] = {"maximum",  "exclusiveMaximum", "maxLength",
                                      "maxItems", "maxProperties",    NULL};

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

static const char *const k_must_equal[] = {
    "pattern",      "format", "prefixItems", "additionalItems", "$ref", "dependentRequired",
    "dependencies", "not",    "multipleOf",  "contains",        NULL};

/* The values (kind "enum": enum and const) or the type names (kind "type") of a `not`'s schema
 * x that has only that kind of keyword beside annotations, appended to out; false for any
 * other form. */
static bool not_values(json_t *x, const char *kind, json_t *out)
{
    const char *key;
    json_t *v;
    bool any = false;
    if (!json_is_object(x))
        return false;
    json_object_foreach(x, key, v)
    {
        bool mine = strcmp(kind, "type") == 0
                        ? strcmp(key, "type") == 0
                        : strcmp(key, "enum") == 0 || strcmp(key, "const") == 0;
        if (!mine && js_keyword_constrains(key))
            return false;
        if (mine && strcmp(key, "const") == 0)
            json_array_append(out, v);
        else if (mine && json_is_array(v))
            json_array_extend(out, v);
        else if (mine && json_is_string(v))
            json_array_append(out, v);
        else if (mine)
            return false;
        any = any || mine;
    }
    return any;
}

/* not A and not B as one `not`: A's and B's values (or types) together; NULL for other forms. */
static json_t *merge_nots(json_t *x, json_t *y)
{
    static const char *const kinds[] = {"enum", "type"};
    for (int k = 0; k < 2; k++) {
        json_t *u = json_array();
        if (u && not_values(x, kinds[k], u) && not_values(y, kinds[k], u))
            return json_pack("{s:o}", kinds[k], u);
        json_decref(u);
    }
    return NULL;
}

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
        if (*out && json_array_size(x) > 0 && json_array_size(y) > 0 &&
            json_array_size(*out) == 0) {
            json_decref(*out);
            *out = NULL;
            return js_fail_unsat(c, ptr, NULL, "allOf: the enums have no value in common");
        }
    } else if (strcmp(key, "format") == 0 && (js_format_custom(x) || js_format_custom(y))) {
        *out = json_incref(js_format_custom(x) ? y : x); /* a custom format constrains nothing */
    } else if (strcmp(key, "not") == 0 && !json_equal(x, y) && (*out = merge_nots(x, y))) {
        /* not A and not B: not (A or B), for two enum forms or two type forms */
    } else if (strcmp(key, "uniqueItems") == 0) {
        *out = json_incref(json_is_true(x) ? x : y); /* true on either side constrains */
    } else if (strcmp(key, "allOf") == 0 && json_is_array(x) && json_is_array(y)) {
        *out = json_copy(x);
        json_array_extend(*out, y);
    } else if (strcmp(key, "items") == 0 && json_is_object(x) && json_is_object(y)) {
        *out = all_of2(x, y);
    } else if (json_equal(x, y) ||
               !(in(k_must_equal, key) || in(k_lower, key) || in(k_upper, key) ||
                 strcmp(key, "const") == 0 || strcmp(key, "anyOf") == 0 ||
                 strcmp(key, "oneOf") == 0 || strcmp(key, "items") == 0)) {
        *out = json_incref(x); /* equal, or an annotation / unknown keyword: the first one's */
    } else {
        return js_fail(c, ptr, NULL, "allOf: two different '%s' cannot be merged", key);
    }
    return *out ? 0 : js_oom(c);
}

/* s (a property's schema) also constrained by the other side's additionalProperties ap. */
static json_t *and_additional(json_t *s, json_t *ap)
{
    if (!ap || json_is_true(ap))
        return json_incref(s);
    return json_is_false(ap) ? json_false() : all_of2(s, ap);
}

/* additionalProperties of the merge, exact: a property only one side defines must also
 * satisfy the other side's additionalProperties, and the merged additionalProperties is both
 * sides' (false when either is). Rewrites out's "properties" (a fresh copy). */
static int merge_additional(js_ctx_t *c, json_t *a, json_t *b, json_t *out)
{
    json_t *x = json_object_get(a, "additionalProperties");
    json_t *y = json_object_get(b, "additionalProperties");
    bool xt = !x || json_is_true(x), yt = !y || json_is_true(y);
    if (xt && yt)
        return 0;
    json_t *pa = json_object_get(a, "properties"), *pb = json_object_get(b, "properties");
    json_t *props = json_copy(json_object_get(out, "properties"));
    if (!props)
        props = json_object();
    const char *key;
    json_t *v;
    json_object_foreach(pa, key, v)
    {
        if (!json_object_get(pb, key))
            json_object_set_new(props, key, and_additional(v, y));
    }
    json_object_foreach(pb, key, v)
    {
        if (!json_object_get(pa, key))
            json_object_set_new(props, key, and_additional(v, x));
    }
    json_t *ap = xt                                       ? json_incref(y)
                 : yt                                     ? json_incref(x)
                 : (json_is_false(x) || json_is_false(y)) ? json_false()
                                                          : all_of2(x, y);
    int rc = json_object_set_new(out, "additionalProperties", ap);
    rc |= json_object_set_new(out, "properties", props);
    return rc == 0 ? 0 : js_oom(c);
}

/* ---- property order ---- */

/* Positions advance by this much a node, so the names of a $ref's target fit between the
 * $ref and the next node (ranks past it tie, and ties keep the merged object's order). */
#define JS_POS_STEP ((json_int_t)1 << 16)

/* The key of object o in c->prop_pos. */
static void pos_key(const json_t *o, char key[32])
{
    snprintf(key, 32, "%p", (const void *)o);
}

/* The key of the position of the $ref member of schema s in c->prop_pos. */
static void ref_key(const json_t *s, char key[32])
{
    snprintf(key, 32, "r%p", (const void *)s);
}

/* Walks node (a "properties" object when props), recording for every properties object the
 * position of each name: the count of nodes visited before it. A schema whose
 * additionalProperties comes before its properties has the properties walked there, as if
 * written at that place (llguidance 1.9.1 orders them so: the object keywords are read where
 * the first of the two stands). Returns 0 or -1 (out of memory). Recursion is bounded by
 * jansson's parse depth. */
static int index_node(json_t *pos, json_t *node, bool props, json_int_t *counter)
{
    json_t *map = NULL, *v;
    const char *key;
    size_t i;
    *counter += JS_POS_STEP;
    if (json_is_array(node)) {
        json_array_foreach(node, i, v)
        {
            if (index_node(pos, v, false, counter) != 0)
                return -1;
        }
        return 0;
    }
    if (!json_is_object(node))
        return 0;
    if (props) {
        char k[32];
        pos_key(node, k);
        if (!(map = json_object()) || json_object_set_new(pos, k, map) != 0)
            return -1;
    }
    /* a schema's properties written after its additionalProperties count from there */
    json_t *own = props ? NULL : json_object_get(node, "properties");
    bool own_done = false;
    json_object_foreach(node, key, v)
    {
        if (map && json_object_set_new(map, key, json_integer(*counter)) != 0)
            return -1;
        bool is_own = own && strcmp(key, "properties") == 0;
        if (!props && strcmp(key, "$ref") == 0 && json_is_string(v)) {
            char k[32];
            ref_key(node, k);
            if (json_object_set_new(pos, k, json_integer(*counter)) != 0)
                return -1;
        }
        if (is_own && own_done)
            continue;
        if (own && !own_done && strcmp(key, "additionalProperties") == 0) {
            if (index_node(pos, own, true, counter) != 0)
                return -1;
            own_done = true;
        }
        own_done = own_done || is_own;
        if (index_node(pos, v, is_own, counter) != 0)
            return -1;
    }
    return 0;
}

/* The document position of name in the properties object props, or LLONG_MAX (unknown). */
static json_int_t position(js_ctx_t *c, json_t *props, const char *name)
{
    char k[32];
    pos_key(props, k);
    json_t *p = json_object_get(json_object_get(c->prop_pos, k), name);
    return json_is_integer(p) ? json_integer_value(p) : LLONG_MAX;
}

typedef struct named_pos {
    const char *name;
    json_t *value;
    json_int_t pos; /* document position (LLONG_MAX: unknown) */
    size_t i;       /* index in the merged object (ties) */
} named_pos_t;

static int cmp_pos(const void *x, const void *y)
{
    const named_pos_t *a = x, *b = y;
    if (a->pos != b->pos)
        return a->pos < b->pos ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

/* The merged properties (v[n], from names) as a new object in document order, recorded in
 * c->prop_pos; NULL on out of memory. */
static json_t *sorted_props(js_ctx_t *c, named_pos_t *v, size_t n)
{
    json_t *sorted = json_object(), *map = json_object();
    char k[32];
    bool ok = sorted && map;
    qsort(v, n, sizeof *v, cmp_pos);
    for (size_t i = 0; i < n && ok; i++) {
        ok = json_object_set(sorted, v[i].name, v[i].value) == 0;
        if (ok && v[i].pos != LLONG_MAX)
            ok = json_object_set_new(map, v[i].name, json_integer(v[i].pos)) == 0;
    }
    if (ok) {
        pos_key(sorted, k);
        ok = json_object_set_new(c->prop_pos, k, map) == 0;
        map = NULL;
    }
    json_decref(map);
    if (!ok)
        json_decref(sorted);
    return ok ? sorted : NULL;
}

/* Puts m's properties, merged from pa and pb, in document order (see the file comment). */
/* Builds c->prop_pos on first use. Returns 0 or TDM_ERESOURCE. */
static int index_positions(js_ctx_t *c)
{
    if (c->prop_pos)
        return 0;
    json_int_t counter = 0;
    c->prop_pos = json_object();
    if (!c->prop_pos || index_node(c->prop_pos, c->root, false, &counter) != 0)
        return js_oom(c);
    return 0;
}

int js_merge_at_ref(js_ctx_t *c, json_t *s, json_t **t)
{
    static const char *const merging[] = {
        "anyOf", "oneOf", "allOf", "$ref", "if", "not", "dependentSchemas", "dependencies", NULL};
    json_t *props = json_object_get(*t, "properties"), *v;
    if (!json_is_object(props) || json_object_size(props) == 0 ||
        !json_is_object(json_object_get(s, "properties")))
        return 0;
    for (const char *const *k = merging; *k; k++)
        if (json_object_get(*t, *k))
            return 0; /* merges inside the target compare with its own positions */
    if (index_positions(c) != 0)
        return TDM_ERESOURCE;
    char k[32];
    ref_key(s, k);
    json_t *at = json_object_get(c->prop_pos, k);
    if (!json_is_integer(at))
        return 0; /* a schema built by a merge: its target keeps its own positions */
    json_t *copy = json_copy(*t), *pc = json_copy(props), *map = json_object();
    bool ok = copy && pc && map && json_array_append(c->keep, copy) == 0;
    const char *name;
    json_int_t rank = 0;
    json_object_foreach(pc, name, v)
    {
        json_int_t off = rank < JS_POS_STEP - 1 ? ++rank : JS_POS_STEP - 1;
        ok = ok && json_object_set_new(map, name, json_integer(json_integer_value(at) + off)) == 0;
    }
    pos_key(pc, k);
    ok = ok && json_object_set(copy, "properties", pc) == 0 &&
         json_object_set(c->prop_pos, k, map) == 0;
    json_decref(copy);
    json_decref(pc);
    json_decref(map);
    if (!ok)
        return js_oom(c);
    *t = copy;
    return 0;
}

int js_merge_alias(js_ctx_t *c, json_t *copy, json_t *orig)
{
    char kc[32], ko[32];
    int rc = index_positions(c);
    if (rc != 0 || !json_is_object(orig))
        return rc;
    pos_key(copy, kc);
    pos_key(orig, ko);
    json_t *map = json_object_get(c->prop_pos, ko);
    if (map && json_object_set(c->prop_pos, kc, map) != 0)
        return js_oom(c);
    return 0;
}

static int order_props(js_ctx_t *c, json_t *m, json_t *pa, json_t *pb)
{
    json_t *props = json_object_get(m, "properties"), *v;
    size_t n = json_object_size(props), i = 0;
    const char *key;
    if (!json_is_object(pa) || !json_is_object(pb) || n < 2)
        return 0;
    if (index_positions(c) != 0)
        return TDM_ERESOURCE;
    named_pos_t *list = calloc(n, sizeof *list);
    if (!list)
        return js_oom(c);
    json_object_foreach(props, key, v)
    {
        json_int_t p = position(c, pa, key), q = position(c, pb, key);
        list[i] = (named_pos_t){key, v, p < q ? p : q, i};
        i++;
    }
    json_t *sorted = sorted_props(c, list, n);
    free(list);
    if (!sorted || json_object_set_new(m, "properties", sorted) != 0)
        return js_oom(c);
    return 0;
}

void js_merge_free(js_ctx_t *c)
{
    json_decref(c->prop_pos);
    c->prop_pos = NULL;
}

/* Whether a has patternProperties and b says anything about which names are allowed (their
 * merge is not built: it would need the patterns' intersections and complements). */
static bool patterns_clash(json_t *a, json_t *b)
{
    return json_object_get(a, "patternProperties") &&
           (json_object_get(b, "properties") || json_object_get(b, "additionalProperties") ||
            json_object_get(b, "patternProperties"));
}

/* Whether a has positional items (prefixItems, draft 4-7 array items) and b an items schema
 * for every position (items, additionalItems) of its own: merged, b's items would apply only
 * after a's positions, while each side's applies to all of its own (not exact). */
static bool tuple_clash(json_t *a, json_t *b)
{
    json_t *ai = json_object_get(a, "items"), *bi = json_object_get(b, "items");
    bool a_tuple = json_object_get(a, "prefixItems") || json_is_array(ai);
    bool b_tuple = json_object_get(b, "prefixItems") || json_is_array(bi);
    bool b_rest = (bi && !json_is_array(bi)) || json_object_get(b, "additionalItems");
    return a_tuple && !b_tuple && b_rest;
}

/* s (kept by c->keep when copied) without `then` / `else` when it has no `if` (they constrain
 * nothing there), and, when other has an `if` too (two conditionals are not one), with its
 * own `if` / `then` / `else` moved into an allOf entry, so both conditions hold. */
static int own_conditional(js_ctx_t *c, json_t **s, const json_t *other)
{
    json_t *x = *s;
    bool has_if = json_object_get(x, "if") != NULL, both = has_if && json_object_get(other, "if");
    if (!both && (has_if || (!json_object_get(x, "then") && !json_object_get(x, "else"))))
        return 0;
    json_t *t = json_copy(x), *cond = json_object(), *all;
    if (!t || !cond || json_array_append_new(c->keep, t) != 0) {
        json_decref(cond);
        return js_oom(c);
    }
    static const char *const keys[] = {"if", "then", "else"};
    for (int i = 0; i < 3 && both; i++)
        if (json_object_get(x, keys[i]))
            json_object_set(cond, keys[i], json_object_get(x, keys[i]));
    for (int i = 0; i < 3; i++)
        json_object_del(t, keys[i]);
    if (both) {
        all = json_is_array(json_object_get(x, "allOf")) ? json_copy(json_object_get(x, "allOf"))
                                                         : json_array();
        if (!all || json_array_append(all, cond) != 0) {
            json_decref(all);
            json_decref(cond);
            return js_oom(c);
        }
        if (json_object_set_new(t, "allOf", all) != 0) { /* frees all */
            json_decref(cond);
            return js_oom(c);
        }
    }
    json_decref(cond);
    *s = t;
    return 0;
}

int js_merge(js_ctx_t *c, json_t *a, json_t *b, const char *ptr, json_t **out)
{
    int rc = js_resolve_top(c, a, ptr, &a);
    rc = rc ? rc : js_resolve_top(c, b, ptr, &b);
    if (rc == 0 && json_is_object(a) && json_is_object(b)) {
        rc = own_conditional(c, &a, b);
        rc = rc ? rc : own_conditional(c, &b, a);
    }
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
    if (tuple_clash(a, b) || tuple_clash(b, a))
        return js_fail(c, ptr, NULL, "allOf: positional items cannot be merged with items");
    if (patterns_clash(a, b) || patterns_clash(b, a))
        return js_fail(c, ptr, NULL, "allOf: patternProperties cannot be merged with properties");
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
    rc = merge_additional(c, a, b, m);
    if (rc == 0)
        rc = order_props(c, m, json_object_get(a, "properties"), json_object_get(b, "properties"));
    *out = m;
    return rc;
}

/* ---- disjointness (oneOf) ---- */

/* Type bits of a JSON value or a type name: null 1, boolean 2, object 4, array 8, string 16,
 * integer 32, non-integral number 64 ("number" is 32 | 64). */
static int name_bits(const char *t)
{
    static const char *const names[] = {"null", "boolean", "object", "array", "string"};
    for (int i = 0; i < 5; i++)
        if (strcmp(t, names[i]) == 0)
            return 1 << i;
    return strcmp(t, "integer") == 0 ? 32 : strcmp(t, "number") == 0 ? 96 : 0;
}

static int value_bits(json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_NULL: return 1;
    case JSON_TRUE:
    case JSON_FALSE: return 2;
    case JSON_OBJECT: return 4;
    case JSON_ARRAY: return 8;
    case JSON_STRING: return 16;
    case JSON_INTEGER: return 32;
    case JSON_REAL: return json_real_value(v) == floor(json_real_value(v)) ? 32 : 64;
    }
    return 0;
}

/* The values enum / const allow (a new array), or NULL when neither is there. */
static json_t *value_set(json_t *s)
{
    json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (cn)
        return json_pack("[O]", cn);
    return json_is_array(en) ? json_incref(en) : NULL;
}

static int type_bits(json_t *s)
{
    json_t *vals = value_set(s), *t = json_object_get(s, "type"), *e;
    int bits = 0;
    size_t i;
    if (vals) {
        json_array_foreach(vals, i, e) bits |= value_bits(e);
        json_decref(vals);
        return bits;
    }
    if (json_is_string(t))
        return name_bits(json_string_value(t));
    json_array_foreach(t, i, e) bits |= json_is_string(e) ? name_bits(json_string_value(e)) : 0;
    return t ? bits : 127;
}

static bool values_disjoint(json_t *a, json_t *b)
{
    json_t *va = value_set(a), *vb = value_set(b);
    json_t *common = va && vb ? merge_enum(va, vb) : NULL;
    bool disjoint = common && json_array_size(common) == 0;
    json_decref(common);
    json_decref(va);
    json_decref(vb);
    return disjoint;
}

static bool required_by(json_t *s, const char *key)
{
    json_t *r;
    size_t i;
    json_array_foreach(json_object_get(s, "required"), i, r)
    {
        if (json_is_string(r) && strcmp(json_string_value(r), key) == 0)
            return true;
    }
    return false;
}

/* Whether schema s forbids property key: its schema false, or additionalProperties false with
 * key neither defined nor possibly matched by a pattern. */
static bool forbids(json_t *s, const char *key)
{
    json_t *props = json_object_get(s, "properties"), *p = json_object_get(props, key);
    if (p)
        return json_is_false(p);
    return json_is_false(json_object_get(s, "additionalProperties")) &&
           !json_object_get(s, "patternProperties");
}

/* Whether a requires a property that b forbids, where objects are all they share (closed
 * objects with different required names: `{"required": ["a"], "additionalProperties": false}`
 * against one that does not define a). */
static bool required_forbidden(json_t *a, json_t *b)
{
    if ((type_bits(a) & type_bits(b)) != 4)
        return false; /* a shared non-object value satisfies both required and properties */
    json_t *r;
    size_t i;
    json_array_foreach(json_object_get(a, "required"), i, r)
    {
        if (json_is_string(r) && forbids(b, json_string_value(r)))
            return true;
    }
    return false;
}

bool js_disjoint(json_t *a, json_t *b)
{
    if (!json_is_object(a) || !json_is_object(b))
        return json_is_false(a) || json_is_false(b);
    if ((type_bits(a) & type_bits(b)) == 0 || values_disjoint(a, b) || required_forbidden(a, b) ||
        required_forbidden(b, a))
        return true;
    json_t *pa = json_object_get(a, "properties"), *pb = json_object_get(b, "properties"), *x;
    const char *key;
    json_object_foreach(pa, key, x)
    {
        json_t *y = json_object_get(pb, key);
        if (y && required_by(a, key) && required_by(b, key) && json_is_object(x) &&
            json_is_object(y) && values_disjoint(x, y))
            return true;
    }
    return false;
}
