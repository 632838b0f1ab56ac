/* json_schema_object.c - JSON Schema objects (properties, required, additionalProperties)
 * and arrays (items, prefixItems, draft-4 tuple items with additionalItems, minItems,
 * maxItems).
 *
 * Objects: the defined properties come in definition order, each required one present, each
 * optional one possibly left out; the additional properties (allowed unless
 * additionalProperties is false; their values follow additionalProperties when it is a
 * schema) come after all the defined ones, with keys that are none of the defined names (a
 * key written with \u escapes is compared as written). A required name that `properties`
 * does not define is a defined property whose value follows additionalProperties, placed
 * after the others. minProperties 1 (the only count supported besides 0) asks for at least
 * one member.
 *
 * Whitespace: the primitive `ws` (at most one space, or one newline and up to 20 spaces or
 * tabs) after every `{ [ , :` and after every member value, so compact and pretty-printed JSON
 * both pass and the output cannot grow whitespace without bound.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"
#include "regex_internal.h"
#include "tandem/grammar.h"
#include "tandem/json_schema.h"

typedef struct prop {
    const char *key;
    char rule[JS_NAME_MAX]; /* the value's rule */
    bool required;
} prop_t;

typedef struct objspec {
    prop_t *props;
    size_t n;
    const char **names; /* every name excluded from the additional properties */
    size_t n_names;
    bool extras;
    char extra_key[JS_NAME_MAX], extra_value[JS_NAME_MAX];
    char extra_member[JS_NAME_MAX]; /* when set: one whole extra member (patternProperties) */
    char ws[JS_NAME_MAX];
} objspec_t;

/* The patterns read into one automaton with the names the object defines or requires (tag bit
 * n): a key's tag says which patterns it matches and whether it is a defined name. */
typedef struct pctx {
    js_dfa_t *dfa;
    size_t n;
    const char *pats[JS_DFA_MAX_PATTERNS];
    json_t *schemas[JS_DFA_MAX_PATTERNS];
    char ptr[JS_PTR_MAX]; /* of patternProperties */
} pctx_t;

static int compile_named(js_ctx_t *c, const pctx_t *p, const char *key, json_t *base,
                         const char *kp, char *rule);

/* The key rule of the additional properties: any string but the defined names. With no names,
 * any JSON string (every spelling). Otherwise the names' automaton (regex_dfa.c) with the names
 * excluded, each key in json.dumps's spelling only: an escaped spelling of a defined name
 * (`"\u0061"` for `a`) must not pass as an additional key, and a name that itself needs escapes
 * (`"foo\nbar"`) is excluded like any other. */
static int extra_key(js_ctx_t *c, objspec_t *o)
{
    if (o->n_names == 0)
        return js_prim(c, JS_PRIM_STRING, o->extra_key);
    js_dfa_t *d = NULL;
    size_t bad;
    tdm_error_t e;
    char rest[JS_NAME_MAX];
    int rc = js_dfa_get(c, NULL, 0, o->names, o->n_names, &d, &bad, &e);
    if (rc == TDM_ERESOURCE)
        return js_oom(c);
    if (rc != 0)
        return js_fail(c, "", NULL, "%s", e.msg);
    rc = js_dfa_emit(c, d, 0, 0, JS_LEN_INF, rest);
    js_dfa_release(c, &d);
    if (rc != 0)
        return rc;
    char body[2 * JS_NAME_MAX + 16];
    snprintf(body, sizeof body, "\"\\\"\" %s \"\\\"\"", rest);
    js_new_name(c, o->extra_key);
    return js_emit_rule(c, o->extra_key, body);
}

static bool is_required(json_t *req, const char *key)
{
    size_t i;
    json_t *r;
    json_array_foreach(req, i, r)
    {
        if (json_is_string(r) && strcmp(json_string_value(r), key) == 0)
            return true;
    }
    return false;
}

/* properties: the defined properties (compiled) and the excluded names. A property whose
 * schema allows no value is left out unless required. */
static int collect_props(js_ctx_t *c, json_t *s, const char *ptr, json_t *req, objspec_t *o,
                         const pctx_t *pc)
{
    json_t *props = json_object_get(s, "properties"), *sub;
    const char *key;
    if (props && !json_is_object(props))
        return js_fail(c, ptr, "properties", "must be an object");
    char pp[JS_PTR_MAX];
    js_ptr_join(pp, ptr, "properties");
    json_object_foreach(props, key, sub)
    {
        o->names[o->n_names++] = key;
        bool required = is_required(req, key);
        if (json_is_false(sub)) {
            if (required)
                return js_fail_unsat(c, pp, key, "required but the schema false allows no value");
            continue;
        }
        prop_t *p = &o->props[o->n++];
        p->key = key;
        p->required = required;
        char kp[JS_PTR_MAX];
        js_ptr_join(kp, pp, key);
        js_mark_t m;
        js_mark_set(c, &m);
        int rc = pc ? compile_named(c, pc, key, sub, kp, p->rule) : js_compile(c, sub, kp, p->rule);
        if (rc == TDM_EINVALID && c->unsat && !required) {
            js_mark_undo(c, &m); /* no value fits: the property cannot appear */
            o->n--;
            continue;
        }
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* required names that properties does not define: defined properties valued by
 * additionalProperties (or refused when that is false). */
static int collect_required_extras(js_ctx_t *c, json_t *s, const char *ptr, json_t *req,
                                   objspec_t *o, const pctx_t *pc)
{
    json_t *props = json_object_get(s, "properties"), *r;
    size_t i;
    json_array_foreach(req, i, r)
    {
        if (!json_is_string(r))
            return js_fail(c, ptr, "required", "entry %zu is not a string", i);
        const char *key = json_string_value(r);
        if (json_object_get(props, key))
            continue;
        bool dup = false;
        for (size_t k = 0; k < o->n_names && !dup; k++)
            dup = strcmp(o->names[k], key) == 0;
        if (dup)
            continue;
        bool matched = pc && (js_dfa_tag(pc->dfa, key, strlen(key)) & ((1u << pc->n) - 1));
        if (!o->extras && !matched)
            return js_fail_unsat(c, ptr, "required",
                                 "'%s' is not in properties and additionalProperties is false",
                                 key);
        o->names[o->n_names++] = key;
        prop_t *p = &o->props[o->n++];
        p->key = key;
        p->required = true;
        snprintf(p->rule, JS_NAME_MAX, "%s", o->extra_value);
        if (matched) {
            char kp[JS_PTR_MAX];
            js_ptr_join(kp, ptr, "required");
            int rc = compile_named(c, pc, key, NULL, kp, p->rule);
            if (rc != 0)
                return rc;
        }
    }
    return 0;
}

/* "key" ws ":" ws value ws, for property p. */
static void kv_text(tdm_buf_t *b, const objspec_t *o, const prop_t *p)
{
    js_json_string_literal(p->key, strlen(p->key), true, b);
    tdm_buf_printf(b, " %s \":\" %s %s %s", o->ws, o->ws, p->rule, o->ws);
}

/* One additional member, `key ws ":" ws value ws`, into xkv[6 * JS_NAME_MAX]. */
static void extra_text(const objspec_t *o, char *xkv)
{
    if (o->extra_member[0])
        snprintf(xkv, 6 * JS_NAME_MAX, "%s", o->extra_member);
    else
        snprintf(xkv, 6 * JS_NAME_MAX, "%s %s \":\" %s %s %s", o->extra_key, o->ws, o->ws,
                 o->extra_value, o->ws);
}

/* Rules for the members from property k on: *first (nothing written before; "" when there
 * is nothing that can come) and *after (something written before; "" when empty). */
static int emit_chain(js_ctx_t *c, const objspec_t *o, char (*first)[JS_NAME_MAX],
                      char (*after)[JS_NAME_MAX])
{
    tdm_buf_t b = TDM_BUF_INIT;
    char xkv[6 * JS_NAME_MAX];
    extra_text(o, xkv);
    first[o->n][0] = after[o->n][0] = 0;
    int rc = 0;
    if (o->extras) {
        js_new_name(c, after[o->n]);
        tdm_buf_printf(&b, "( \",\" %s %s )*", o->ws, xkv);
        rc = js_emit_rule(c, after[o->n], b.data);
        js_new_name(c, first[o->n]);
        tdm_buf_clear(&b);
        tdm_buf_printf(&b, "%s %s", xkv, after[o->n]);
        rc = rc ? rc : js_emit_rule(c, first[o->n], b.data);
    }
    for (size_t k = o->n; k-- > 0 && rc == 0;) {
        const prop_t *p = &o->props[k];
        tdm_buf_clear(&b);
        tdm_buf_printf(&b, "%s\",\" %s ", p->required ? "" : "( ", o->ws);
        kv_text(&b, o, p);
        tdm_buf_printf(&b, "%s %s", p->required ? "" : " )?", after[k + 1]);
        js_new_name(c, after[k]);
        rc = js_emit_rule(c, after[k], b.data);
        tdm_buf_clear(&b);
        kv_text(&b, o, p);
        tdm_buf_printf(&b, " %s", after[k + 1]);
        if (!p->required && first[k + 1][0])
            tdm_buf_printf(&b, " | %s", first[k + 1]);
        js_new_name(c, first[k]);
        rc = rc ? rc : (b.oom ? js_oom(c) : js_emit_rule(c, first[k], b.data));
    }
    tdm_buf_free(&b);
    return rc;
}

/* Objects of at most JS_ANY_ORDER_MAX defined properties take them in any order (then the
 * additional members): one rule per set of properties written so far, 2^n of them. */
#define JS_ANY_ORDER_MAX 4u

/* The members of o in any order, nothing written yet, into first (as emit_chain's first[0]). */
static int emit_any_order(js_ctx_t *c, const objspec_t *o, char *first)
{
    uint32_t full = (1u << o->n) - 1, req = 0;
    for (size_t i = 0; i < o->n; i++)
        req |= o->props[i].required ? 1u << i : 0;
    char(*after)[JS_NAME_MAX] = calloc((size_t)full + 1, JS_NAME_MAX);
    char xkv[6 * JS_NAME_MAX], xafter[JS_NAME_MAX] = "";
    tdm_buf_t b = TDM_BUF_INIT;
    int rc = after ? 0 : js_oom(c);
    extra_text(o, xkv);
    if (rc == 0 && o->extras) { /* the additional members after the defined ones */
        tdm_buf_printf(&b, "( \",\" %s %s )*", o->ws, xkv);
        js_new_name(c, xafter);
        rc = js_emit_rule(c, xafter, b.data);
    }
    /* after[S]: the members after those of S (a superset of S is a larger number: made first) */
    for (uint32_t set = full + 1; set-- > 0 && rc == 0;) {
        bool done = (set & req) == req;
        tdm_buf_clear(&b);
        for (size_t i = 0; i < o->n; i++) {
            if (set & (1u << i))
                continue;
            tdm_buf_printf(&b, "%s", b.len ? " | " : "");
            if (set)
                tdm_buf_printf(&b, "\",\" %s ", o->ws);
            kv_text(&b, o, &o->props[i]);
            tdm_buf_printf(&b, " %s", after[set | 1u << i]);
        }
        if (set == 0) { /* the first member: a defined one, or an additional one when none is
                           required */
            if (done && o->extras)
                tdm_buf_printf(&b, " | %s %s", xkv, xafter);
        } else if (done && b.len && !o->extras) {
            tdm_buf_t t = TDM_BUF_INIT; /* or nothing more */
            tdm_buf_printf(&t, "( %s )?", b.data);
            tdm_buf_clear(&b);
            tdm_buf_puts(&b, t.oom ? "" : t.data);
            rc = t.oom ? js_oom(c) : 0;
            tdm_buf_free(&t);
        } else if (done && o->extras) {
            tdm_buf_printf(&b, "%s%s", b.len ? " | " : "", xafter);
        }
        if (rc == 0 && b.len == 0) {
            after[set][0] = 0; /* nothing more can come */
            continue;
        }
        char *name = set ? after[set] : first;
        js_new_name(c, name);
        rc = rc ? rc : (b.oom ? js_oom(c) : js_emit_rule(c, name, b.data));
    }
    tdm_buf_free(&b);
    free(after);
    return rc;
}

/* ---- minProperties / maxProperties ---- */

/* The member count bounds of an object: lo..hi members (hi JS_LEN_INF: no bound). */
typedef struct counts {
    size_t lo, hi;
    size_t cap; /* counts tracked: hi, or lo when there is no upper bound (then lo means "lo or
                   more") */
    char (*after)[JS_NAME_MAX]; /* [(n + 1) * (cap + 1)] rule of members k.. after j written */
    bool *live;                 /* [(n + 1) * (cap + 1)] whether that rule allows anything */
} counts_t;

#define JS_COUNT_RULES 4096u /* most (property, count) pairs a counted object may need */

static size_t count_next(const counts_t *k, size_t j)
{
    return k->hi == JS_LEN_INF && j + 1 > k->cap ? k->cap : j + 1;
}

/* The members from property k on after j written (j >= 1): into k->after / live. Required:
 * `"," kv` at count j + 1; optional: that or nothing; past the defined ones, the additional
 * members that bring the count into lo..hi (or nothing when there are none and j >= lo). */
static int emit_after(js_ctx_t *c, const objspec_t *o, counts_t *k, size_t i, size_t j,
                      tdm_buf_t *b)
{
    size_t at = i * (k->cap + 1) + j;
    char *name = k->after[at];
    tdm_buf_clear(b);
    if (i == o->n) {
        size_t more = k->lo > j ? k->lo - j : 0,
               room = k->hi == JS_LEN_INF ? JS_LEN_INF : k->hi - j;
        k->live[at] = o->extras ? more <= room : more == 0;
        if (!k->live[at] || (room == 0 || !o->extras)) {
            name[0] = 0; /* dead, or nothing more */
            return 0;
        }
        char xkv[6 * JS_NAME_MAX], x[8 * JS_NAME_MAX];
        extra_text(o, xkv);
        snprintf(x, sizeof x, "( \",\" %s %s )", o->ws, xkv);
        js_rep(b, x, more, room);
    } else {
        const prop_t *p = &o->props[i];
        size_t nat = (i + 1) * (k->cap + 1) + count_next(k, j), sat = at + k->cap + 1;
        bool take = j + 1 <= k->hi && k->live[nat], skip = !p->required && k->live[sat];
        k->live[at] = take || skip;
        if (!take) { /* left out, or dead: the same rule as without property i */
            snprintf(name, JS_NAME_MAX, "%s", k->live[at] ? k->after[sat] : "");
            return 0;
        }
        tdm_buf_printf(b, "%s\",\" %s ", skip && !k->after[sat][0] ? "( " : "", o->ws);
        kv_text(b, o, p);
        tdm_buf_printf(b, " %s", k->after[nat]);
        if (skip)
            tdm_buf_printf(b, "%s%s", k->after[sat][0] ? " | " : " )?", k->after[sat]);
    }
    js_new_name(c, name);
    return b->oom ? js_oom(c) : js_emit_rule(c, name, b->data);
}

/* The members of an object with count bounds (nothing written yet) into first (dead: *live
 * false): one rule per defined property and count so far, at most JS_COUNT_RULES. */
static int emit_counted(js_ctx_t *c, const objspec_t *o, counts_t *k, char *first, bool *live)
{
    tdm_buf_t b = TDM_BUF_INIT;
    int rc = 0;
    for (size_t i = o->n + 1; i-- > 0 && rc == 0;)
        for (size_t j = 1; j <= k->cap && rc == 0; j++)
            rc = emit_after(c, o, k, i, j, &b);
    /* the first member: property i (i < n) then after[i + 1][1], or an extra then after[n][1];
     * written as a chain of alternatives first_i = kv_i after | first_{i+1} */
    char next[JS_NAME_MAX] = "";
    bool next_live = false;
    for (size_t i = o->n + 1; i-- > 0 && rc == 0;) {
        size_t nat = (i == o->n ? i : i + 1) * (k->cap + 1) + count_next(k, 0);
        bool take = k->hi >= 1 && k->live[nat] && (i < o->n || o->extras);
        bool skip = i < o->n && !o->props[i].required && next_live;
        if (!take) {
            next_live = skip; /* left out: the same as from property i + 1 on */
            continue;
        }
        tdm_buf_clear(&b);
        if (i == o->n) {
            char xkv[6 * JS_NAME_MAX];
            extra_text(o, xkv);
            tdm_buf_printf(&b, "%s %s", xkv, k->after[nat]);
        } else {
            kv_text(&b, o, &o->props[i]);
            tdm_buf_printf(&b, " %s", k->after[nat]);
        }
        if (skip)
            tdm_buf_printf(&b, " | %s", next);
        char name[JS_NAME_MAX];
        js_new_name(c, name);
        rc = b.oom ? js_oom(c) : js_emit_rule(c, name, b.data);
        snprintf(next, sizeof next, "%s", name);
        next_live = true;
    }
    snprintf(first, JS_NAME_MAX, "%s", next);
    *live = next_live;
    tdm_buf_free(&b);
    return rc;
}

/* minProperties / maxProperties into lo / hi. */
static int read_counts(js_ctx_t *c, json_t *s, const char *ptr, size_t *lo, size_t *hi)
{
    const char *keys[2] = {"minProperties", "maxProperties"};
    size_t *out[2] = {lo, hi};
    *lo = 0;
    *hi = JS_LEN_INF;
    for (int i = 0; i < 2; i++) {
        json_t *x = json_object_get(s, keys[i]);
        if (!x)
            continue;
        if (!json_is_integer(x) || json_integer_value(x) < 0)
            return js_fail(c, ptr, keys[i], "must be a non-negative integer");
        *out[i] = json_integer_value(x) > JS_COUNT_MAX ? (i ? JS_LEN_INF : JS_COUNT_MAX + 1)
                                                       : (size_t)json_integer_value(x);
    }
    return 0;
}

/* The object's members counted: `"{" ws members "}"` into name, with members allowing lo..hi
 * of them. Refused when that needs over JS_COUNT_RULES rules, and when minProperties needs
 * two or more additional members (written members are counted: a key written twice would
 * count twice, and the object it parses to has fewer). */
static int object_counted(js_ctx_t *c, const objspec_t *o, const char *ptr, size_t lo, size_t hi,
                          char *name)
{
    size_t n_req = 0;
    for (size_t i = 0; i < o->n; i++)
        n_req += o->props[i].required;
    if (lo > hi)
        return js_fail_unsat(c, ptr, "minProperties", "greater than maxProperties");
    if (o->extras && lo >= n_req + 2)
        return js_fail(c, ptr, "minProperties",
                       "not supported: %zu members where %zu properties are required and the "
                       "others may be additional ones (a key written twice would count twice)",
                       lo, n_req);
    counts_t k = {.lo = lo, .hi = hi, .cap = hi == JS_LEN_INF ? lo : hi};
    if (k.cap > JS_COUNT_RULES || (o->n + 1) * (k.cap + 1) > JS_COUNT_RULES)
        return js_fail(c, ptr, hi == JS_LEN_INF ? "minProperties" : "maxProperties",
                       "not supported: counting %zu members over %zu properties needs over %u "
                       "rules",
                       k.cap, o->n, JS_COUNT_RULES);
    k.after = calloc((o->n + 1) * (k.cap + 1), JS_NAME_MAX);
    k.live = calloc((o->n + 1) * (k.cap + 1), sizeof *k.live);
    char first[JS_NAME_MAX];
    bool live = false, empty_ok = lo == 0;
    int rc = !k.after || !k.live ? js_oom(c) : emit_counted(c, o, &k, first, &live);
    for (size_t i = 0; i < o->n; i++)
        empty_ok = empty_ok && !o->props[i].required;
    if (rc == 0 && !live && !empty_ok)
        rc = js_fail_unsat(c, ptr, hi == JS_LEN_INF ? "minProperties" : "maxProperties",
                           "no object has a member count in range");
    if (rc == 0) {
        char body[2 * JS_NAME_MAX + 64];
        snprintf(body, sizeof body, "\"{\" %s %s%s \"}\"", o->ws, live ? first : "",
                 live && empty_ok ? "?" : "");
        js_new_name(c, name);
        rc = js_emit_rule(c, name, body);
    }
    free(k.after);
    free(k.live);
    return rc;
}

/* ---- patternProperties ---- */

static bool accepts_all(json_t *s)
{
    return json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0);
}

/* Whether patternProperties constrains anything: some pattern's schema does, or
 * additionalProperties is there to apply to the keys that match no pattern. */
static int patterns_apply(js_ctx_t *c, json_t *s, const char *ptr, bool *used)
{
    json_t *pp = json_object_get(s, "patternProperties"), *sub;
    json_t *ap = json_object_get(s, "additionalProperties");
    const char *pat;
    *used = false;
    if (!pp)
        return 0;
    if (!json_is_object(pp))
        return js_fail(c, ptr, "patternProperties", "must be an object");
    bool trivial = true;
    json_object_foreach(pp, pat, sub) trivial = trivial && accepts_all(sub);
    *used = json_object_size(pp) > 0 && (!trivial || (ap && !json_is_true(ap)));
    return 0;
}

/* The names of properties and required, for the automaton (caller frees the array). */
static const char **object_names(json_t *s, size_t *n)
{
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"), *r;
    const char **names = calloc(json_object_size(props) + json_array_size(req) + 1, sizeof *names);
    const char *key;
    json_t *sub;
    size_t i;
    *n = 0;
    if (!names)
        return NULL;
    json_object_foreach(props, key, sub) names[(*n)++] = key;
    json_array_foreach(req, i, r) if (json_is_string(r)) names[(*n)++] = json_string_value(r);
    return names;
}

static int patterns_setup(js_ctx_t *c, json_t *s, const char *ptr, pctx_t *p)
{
    json_t *pp = json_object_get(s, "patternProperties"), *sub;
    const char *pat;
    js_ptr_join(p->ptr, ptr, "patternProperties");
    if (json_object_size(pp) > JS_DFA_MAX_PATTERNS)
        return js_fail(c, p->ptr, NULL, "more than %d patterns not supported", JS_DFA_MAX_PATTERNS);
    json_object_foreach(pp, pat, sub)
    {
        p->pats[p->n] = pat;
        p->schemas[p->n++] = sub;
    }
    size_t n_names, bad;
    const char **names = object_names(s, &n_names);
    if (!names)
        return js_oom(c);
    tdm_error_t e;
    int rc = js_dfa_get(c, p->pats, p->n, names, n_names, &p->dfa, &bad, &e);
    free(names);
    if (rc == TDM_ERESOURCE)
        return js_oom(c);
    if (rc != 0)
        return js_fail(c, p->ptr, bad < p->n ? p->pats[bad] : NULL, "%s", e.msg);
    return 0;
}

/* The schema a value must satisfy when its key is tagged tag: base (the property's schema;
 * NULL: none) merged with the schema of every pattern the key matches. */
static int pattern_schema(js_ctx_t *c, const pctx_t *p, json_t *base, uint32_t tag, json_t **out)
{
    json_t *acc = base ? base : json_true();
    for (size_t i = 0; i < p->n; i++) {
        if (!(tag & (1u << i)))
            continue;
        char sp[JS_PTR_MAX];
        js_ptr_join(sp, p->ptr, p->pats[i]);
        int rc = js_merge(c, acc, p->schemas[i], sp, &acc);
        if (rc != 0)
            return rc;
    }
    *out = acc;
    return 0;
}

/* Compiles the value schema of the defined or required name key (base: its schema in
 * properties, NULL when it has none) with the patterns it matches. */
static int compile_named(js_ctx_t *c, const pctx_t *p, const char *key, json_t *base,
                         const char *kp, char *rule)
{
    uint32_t tag = js_dfa_tag(p->dfa, key, strlen(key)) & ((1u << p->n) - 1);
    json_t *m;
    int rc = pattern_schema(c, p, base, tag, &m);
    return rc ? rc : js_compile(c, m, kp, rule);
}

/* One member alternative for the keys tagged exactly tag (matching the patterns in it, none
 * of the defined names): `"key" ws ":" ws value ws` appended to alts; nothing when no value
 * fits (those keys cannot appear). */
static int pattern_member(js_ctx_t *c, const pctx_t *p, objspec_t *o, uint32_t tag, tdm_buf_t *alts)
{
    char value[JS_NAME_MAX], key[JS_NAME_MAX];
    js_mark_t mark;
    js_mark_set(c, &mark);
    int rc = 0;
    if (tag == 0) {
        snprintf(value, sizeof value, "%s", o->extra_value);
    } else {
        json_t *m;
        rc = pattern_schema(c, p, NULL, tag, &m);
        char vp[JS_PTR_MAX]; /* one pattern: its pointer; several: patternProperties' */
        snprintf(vp, sizeof vp, "%s", p->ptr);
        for (size_t i = 0; i < p->n && (tag & (tag - 1)) == 0; i++)
            if (tag == (1u << i))
                js_ptr_join(vp, p->ptr, p->pats[i]);
        rc = rc ? rc : js_compile(c, m, vp, value);
        if (rc == TDM_EINVALID && c->unsat) {
            js_mark_undo(c, &mark);
            return 0;
        }
    }
    if (rc != 0)
        return rc;
    rc = js_dfa_emit(c, p->dfa, tag, 0, JS_LEN_INF, key);
    if (rc == TDM_EINVALID) {
        char msg[TDM_ERRMSG_MAX];
        snprintf(msg, sizeof msg, "%s", c->err->msg);
        return js_fail(c, p->ptr, NULL, "%s", msg);
    }
    if (rc == 0 && key[0])
        tdm_buf_printf(alts, "%s\"\\\"\" %s \"\\\"\" %s \":\" %s %s %s", alts->len ? " | " : "",
                       key, o->ws, o->ws, value, o->ws);
    return rc;
}

/* The members besides the defined ones: one alternative per combination of patterns a key
 * can match (its value satisfies all their schemas), and the keys matching none valued by
 * additionalProperties (unless false). Exact: every key falls in exactly one alternative,
 * and the defined names in none. */
static int pattern_members(js_ctx_t *c, const pctx_t *p, objspec_t *o, bool ap_false)
{
    uint32_t tags[64];
    size_t nt = js_dfa_tags(p->dfa, tags, 64);
    if (nt > 64)
        return js_fail(c, p->ptr, NULL, "more than 64 combinations of patterns not supported");
    tdm_buf_t alts = TDM_BUF_INIT;
    int rc = 0;
    for (size_t i = 0; i < nt && rc == 0; i++) {
        if ((tags[i] >> p->n) != 0 || (tags[i] == 0 && ap_false))
            continue; /* a defined name, or no key of this kind allowed */
        rc = pattern_member(c, p, o, tags[i], &alts);
    }
    o->extras = rc == 0 && alts.len > 0;
    if (o->extras) {
        js_new_name(c, o->extra_member);
        rc = alts.oom ? js_oom(c) : js_emit_rule(c, o->extra_member, alts.data);
    }
    tdm_buf_free(&alts);
    return rc;
}

/* additionalProperties: o->extras and the value rule (a schema no value fits: as false). */
static int read_additional(js_ctx_t *c, json_t *s, const char *ptr, objspec_t *o)
{
    json_t *ap = json_object_get(s, "additionalProperties");
    o->extras = !json_is_false(ap);
    if (!o->extras)
        return 0;
    if (!ap || json_is_true(ap))
        return js_prim(c, JS_PRIM_VALUE, o->extra_value);
    char p[JS_PTR_MAX];
    js_ptr_join(p, ptr, "additionalProperties");
    bool none;
    int rc = js_compile_or_none(c, ap, p, o->extra_value, &none);
    o->extras = !none;
    return rc;
}

int js_object(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *ap = json_object_get(s, "additionalProperties");
    if (req && !json_is_array(req))
        return js_fail(c, ptr, "required", "must be an array of strings");
    size_t lo, hi;
    int rc0 = read_counts(c, s, ptr, &lo, &hi);
    if (rc0 != 0)
        return rc0;
    bool non_empty = lo >= 1, counted = lo >= 2 || hi != JS_LEN_INF;
    json_t *pp = json_object_get(s, "patternProperties");
    if (!props && json_array_size(req) == 0 && (!ap || json_is_true(ap)) && !non_empty &&
        !counted && (!pp || json_object_size(pp) == 0))
        return js_prim(c, JS_PRIM_OBJECT, name);
    objspec_t o;
    memset(&o, 0, sizeof o);
    size_t cap = json_object_size(props) + json_array_size(req) + 1;
    o.props = calloc(cap, sizeof *o.props);
    o.names = calloc(cap, sizeof *o.names);
    char(*first)[JS_NAME_MAX] = calloc(cap + 1, JS_NAME_MAX);
    char(*after)[JS_NAME_MAX] = calloc(cap + 1, JS_NAME_MAX);
    int rc = (!o.props || !o.names || !first || !after) ? js_oom(c) : 0;
    bool patterns = false;
    pctx_t pc;
    memset(&pc, 0, sizeof pc);
    rc = rc ? rc : js_prim(c, JS_PRIM_WS, o.ws);
    rc = rc ? rc : patterns_apply(c, s, ptr, &patterns);
    if (rc == 0 && patterns)
        rc = patterns_setup(c, s, ptr, &pc);
    rc = rc ? rc : read_additional(c, s, ptr, &o);
    rc = rc ? rc : collect_props(c, s, ptr, req, &o, patterns ? &pc : NULL);
    rc = rc ? rc : collect_required_extras(c, s, ptr, req, &o, patterns ? &pc : NULL);
    if (rc == 0 && patterns)
        rc = pattern_members(c, &pc, &o, !o.extras);
    else if (rc == 0 && o.extras)
        rc = extra_key(c, &o);
    if (rc == 0 && counted) {
        rc = object_counted(c, &o, ptr, lo, hi, name);
        goto out_free;
    }
    if (o.n >= 2 && o.n <= JS_ANY_ORDER_MAX)
        rc = rc ? rc : emit_any_order(c, &o, first[0]);
    else
        rc = rc ? rc : emit_chain(c, &o, first, after);
    if (rc == 0 && non_empty && !first[0][0])
        rc = js_fail_unsat(c, ptr, "minProperties", "no property can appear");
    if (rc == 0) {
        bool nullable = !non_empty; /* minProperties 1: at least one member */
        for (size_t k = 0; k < o.n; k++)
            nullable = nullable && !o.props[k].required;
        char body[2 * JS_NAME_MAX + 64];
        snprintf(body, sizeof body, "\"{\" %s %s%s \"}\"", o.ws, first[0],
                 first[0][0] && nullable ? "?" : "");
        js_new_name(c, name);
        rc = js_emit_rule(c, name, body);
    }
out_free:
    js_dfa_release(c, &pc.dfa);
    free(o.props);
    free(o.names);
    free(first);
    free(after);
    return rc;
}

/* ---- arrays ---- */

typedef struct arrspec {
    char (*prefix)[JS_NAME_MAX]; /* the rules of the positional items */
    size_t k;                    /* how many */
    bool rest;                   /* items after them allowed */
    char item[JS_NAME_MAX];      /* their rule */
    size_t min, max;             /* minItems, maxItems (JS_LEN_INF) */
    char ws[JS_NAME_MAX];
} arrspec_t;

static int get_items_count(js_ctx_t *c, json_t *s, const char *ptr, const char *key, size_t *v)
{
    json_t *x = json_object_get(s, key);
    if (!x)
        return 0;
    if (!json_is_integer(x) || json_integer_value(x) < 0)
        return js_fail(c, ptr, key, "must be a non-negative integer");
    if (json_integer_value(x) > JS_COUNT_MAX)
        return js_fail(c, ptr, key, "%" JSON_INTEGER_FORMAT " is above the limit of %u",
                       json_integer_value(x), JS_COUNT_MAX);
    *v = (size_t)json_integer_value(x);
    return 0;
}

/* prefixItems (or draft-4 array items) and the rule of the items after them. */
static int read_items(js_ctx_t *c, json_t *s, const char *ptr, arrspec_t *a)
{
    json_t *items = json_object_get(s, "items"), *pre = json_object_get(s, "prefixItems");
    const char *pre_key = "prefixItems", *rest_key = "items";
    if (json_is_array(items) && !pre) { /* draft 4-7 tuples */
        pre = items;
        pre_key = "items";
        rest_key = "additionalItems";
        items = json_object_get(s, "additionalItems");
    }
    if (pre && !json_is_array(pre))
        return js_fail(c, ptr, pre_key, "must be an array");
    a->k = json_array_size(pre);
    a->prefix = calloc(a->k + 1, JS_NAME_MAX);
    if (!a->prefix)
        return js_oom(c);
    char pp[JS_PTR_MAX], ip[JS_PTR_MAX];
    js_ptr_join(pp, ptr, pre_key);
    bool none = false;
    for (size_t i = 0; i < a->k; i++) {
        js_ptr_index(ip, pp, i);
        int rc = js_compile_or_none(c, json_array_get(pre, i), ip, a->prefix[i], &none);
        if (rc != 0)
            return rc;
        if (none) { /* no item fits here: the arrays end before it */
            a->k = i;
            a->rest = false;
            return 0;
        }
    }
    a->rest = !json_is_false(items);
    if (!a->rest)
        return 0;
    if (!items || json_is_true(items))
        return js_prim(c, JS_PRIM_VALUE, a->item);
    js_ptr_join(ip, ptr, rest_key);
    int rc = js_compile_or_none(c, items, ip, a->item, &none);
    a->rest = !none; /* no item fits: none after the positional ones */
    return rc;
}

/* The items after the positional ones, min..max of them (k: how many came before). */
static void rest_text(tdm_buf_t *b, const arrspec_t *a)
{
    size_t lo = a->min > a->k ? a->min - a->k : 0;
    size_t hi = a->max == JS_LEN_INF ? JS_LEN_INF : a->max - a->k;
    if (!a->rest || hi == 0)
        return;
    if (a->k > 0) {
        char x[4 * JS_NAME_MAX];
        snprintf(x, sizeof x, "( \",\" %s %s %s )", a->ws, a->item, a->ws);
        tdm_buf_puts(b, " ");
        js_rep(b, x, lo, hi);
        return;
    }
    tdm_buf_printf(b, " %s%s %s", lo ? "" : "( ", a->item, a->ws);
    if (hi != 1) {
        char x[4 * JS_NAME_MAX];
        snprintf(x, sizeof x, "( \",\" %s %s %s )", a->ws, a->item, a->ws);
        tdm_buf_puts(b, " ");
        js_rep(b, x, lo ? lo - 1 : 0, hi == JS_LEN_INF ? JS_LEN_INF : hi - 1);
    }
    tdm_buf_puts(b, lo ? "" : " )?");
}

/* contains (minContains 1): items, at least one of them also matching contains (W):
 * `[ (I ,)* W (, I)* ]`. Beside tuple items, maxItems or minItems above 1: refused. */
static int array_contains(js_ctx_t *c, json_t *s, const char *ptr, size_t min, size_t max,
                          char *name)
{
    json_t *items = json_object_get(s, "items"), *con = json_object_get(s, "contains"), *w;
    if (json_object_get(s, "prefixItems") || json_is_array(items) || max != JS_LEN_INF || min > 1)
        return js_fail(c, ptr, "contains",
                       "not supported beside tuple items, maxItems or minItems above 1");
    char ip[JS_PTR_MAX], cp[JS_PTR_MAX], ws[JS_NAME_MAX], item[JS_NAME_MAX], wit[JS_NAME_MAX];
    js_ptr_join(ip, ptr, "items");
    js_ptr_join(cp, ptr, "contains");
    int rc = js_merge(c, items ? items : json_true(), con, cp, &w);
    rc = rc ? rc : js_prim(c, JS_PRIM_WS, ws);
    rc = rc ? rc : items ? js_compile(c, items, ip, item) : js_prim(c, JS_PRIM_VALUE, item);
    rc = rc ? rc : js_compile(c, w, cp, wit);
    if (rc != 0)
        return rc;
    char body[12 * JS_NAME_MAX];
    snprintf(body, sizeof body, "\"[\" %s ( %s %s \",\" %s )* %s %s ( \",\" %s %s %s )* \"]\"", ws,
             item, ws, ws, wit, ws, ws, item, ws);
    js_new_name(c, name);
    return js_emit_rule(c, name, body);
}

int js_array(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    arrspec_t a;
    memset(&a, 0, sizeof a);
    a.max = JS_LEN_INF;
    int rc = get_items_count(c, s, ptr, "minItems", &a.min);
    rc = rc ? rc : get_items_count(c, s, ptr, "maxItems", &a.max);
    if (rc == 0 && json_is_true(json_object_get(s, "uniqueItems")) && a.max > 1 &&
        json_object_get(s, "contains"))
        return js_fail(c, ptr, "contains", "not supported beside uniqueItems");
    if (rc == 0 && json_is_true(json_object_get(s, "uniqueItems")) && a.max > 1)
        return js_array_unique(c, s, ptr, a.min, a.max, name);
    if (rc == 0 && json_object_get(s, "contains"))
        return array_contains(c, s, ptr, a.min, a.max, name);
    if (rc == 0 && !json_object_get(s, "items") && !json_object_get(s, "prefixItems") &&
        a.min == 0 && a.max == JS_LEN_INF)
        return js_prim(c, JS_PRIM_ARRAY, name);
    rc = rc ? rc : js_prim(c, JS_PRIM_WS, a.ws);
    rc = rc ? rc : read_items(c, s, ptr, &a);
    if (rc == 0 && a.min > a.max)
        rc = js_fail_unsat(c, ptr, "minItems", "greater than maxItems");
    if (rc == 0 && !a.rest && a.min > a.k)
        rc = js_fail_unsat(c, ptr, "minItems", "more items than the schema allows");
    tdm_buf_t b = TDM_BUF_INIT;
    size_t n_pos = a.k < a.max ? a.k : a.max, opened = 0;
    tdm_buf_printf(&b, "\"[\" %s", a.ws);
    for (size_t i = 0; i < n_pos && rc == 0; i++) {
        bool optional = i >= a.min;
        tdm_buf_printf(&b, " %s%s%s %s", optional ? "( " : "", i ? "\",\" " : "", i ? a.ws : "",
                       a.prefix[i]);
        tdm_buf_printf(&b, " %s", a.ws);
        opened += optional;
    }
    if (n_pos == a.k)
        rest_text(&b, &a);
    for (size_t i = 0; i < opened; i++)
        tdm_buf_puts(&b, " )?");
    tdm_buf_puts(&b, " \"]\"");
    if (rc == 0) {
        js_new_name(c, name);
        rc = b.oom ? js_oom(c) : js_emit_rule(c, name, b.data);
    }
    tdm_buf_free(&b);
    free(a.prefix);
    return rc;
}
