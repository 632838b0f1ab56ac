/* json_schema.c - JSON Schema to GBNF: the entry points, the keyword check, `type`
 * dispatch, `$ref`, `anyOf` / `oneOf` / `allOf`, `enum` / `const`, and the shared primitives.
 *
 * Keywords fall in four sets: the ones compiled (below and in json_schema_*.c), annotations
 * (ignored: they constrain nothing), the validation keywords of drafts 4 to 2020-12 that are
 * not supported (refused with their JSON pointer: never a silently weaker grammar), and every
 * other name, which JSON Schema itself ignores ("unknown keywords": x-*, javaType, ...), so
 * this compiler ignores them too. oneOf compiles as anyOf when its branches are provably
 * disjoint (so exclusivity holds by construction), and is refused otherwise.
 */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"
#include "tandem/grammar.h"
#include "tandem/json_schema.h"

static const char *const k_supported[] = {"type",
                                          "properties",
                                          "required",
                                          "additionalProperties",
                                          "items",
                                          "prefixItems",
                                          "additionalItems",
                                          "minItems",
                                          "maxItems",
                                          "enum",
                                          "const",
                                          "anyOf",
                                          "oneOf",
                                          "allOf",
                                          "$ref",
                                          "$defs",
                                          "definitions",
                                          "minLength",
                                          "maxLength",
                                          "pattern",
                                          "format",
                                          "minimum",
                                          "maximum",
                                          "exclusiveMinimum",
                                          "exclusiveMaximum",
                                          "minProperties",
                                          "maxProperties",
                                          "patternProperties",
                                          "dependentRequired",
                                          "dependencies",
                                          "not",
                                          "dependentSchemas",
                                          "uniqueItems",
                                          "multipleOf",
                                          "contains",
                                          "if",
                                          "then",
                                          "else",
                                          NULL};

/* Annotations ($schema, $id, id, title, description, examples, default, $comment, deprecated,
 * readOnly, writeOnly, content*, $anchor, $vocabulary) and unknown keywords are not listed:
 * both are ignored. */
static const char *const k_refused[] = {
    "propertyNames",         "minContains",      "maxContains",

    "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor",
    "$recursiveRef",         "$recursiveAnchor", NULL};

static bool in_list(const char *const *list, const char *key)
{
    for (; *list; list++)
        if (strcmp(*list, key) == 0)
            return true;
    return false;
}

#define JS_PTR_SHOWN 48 /* characters of each end of a long pointer in a message */

/* ---- errors, names, pointers ---- */

static int vfail(js_ctx_t *c, bool unsat, const char *ptr, const char *key, const char *fmt,
                 va_list ap) __attribute__((format(printf, 5, 0)));

static int vfail(js_ctx_t *c, bool unsat, const char *ptr, const char *key, const char *fmt,
                 va_list ap)
{
    char msg[TDM_ERRMSG_MAX], p[JS_PTR_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (key)
        js_ptr_join(p, ptr, key);
    else
        snprintf(p, sizeof p, "%s", ptr);
    c->unsat = unsat;
    /* a deep pointer keeps its start and end, so the reason still fits the message */
    size_t n = strlen(p);
    if (n + 4 >= JS_PTR_MAX) /* cut while it was built: its end is not known */
        return tdm_error_set(c->err, TDM_EINVALID,
                             "%.*s... (a pointer of more than %d "
                             "characters): %s",
                             2 * JS_PTR_SHOWN, p, JS_PTR_MAX - 5, msg);
    if (n > 2 * JS_PTR_SHOWN + 3)
        return tdm_error_set(c->err, TDM_EINVALID, "%.*s...%s: %s", JS_PTR_SHOWN, p,
                             p + n - JS_PTR_SHOWN, msg);
    return tdm_error_set(c->err, TDM_EINVALID, "%s: %s", *p ? p : "/", msg);
}

int js_fail(js_ctx_t *c, const char *ptr, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vfail(c, false, ptr, key, fmt, ap);
    va_end(ap);
    return rc;
}

int js_fail_unsat(js_ctx_t *c, const char *ptr, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vfail(c, true, ptr, key, fmt, ap);
    va_end(ap);
    return rc;
}

int js_oom(js_ctx_t *c)
{
    return tdm_error_set(c->err, TDM_ERESOURCE, "out of memory");
}

void js_mark_set(const js_ctx_t *c, js_mark_t *m)
{
    m->out_len = c->out->len;
    m->n_refs = c->n_refs;
    memcpy(m->prims, c->prim_done, sizeof m->prims);
}

void js_mark_undo(js_ctx_t *c, const js_mark_t *m)
{
    if (c->out->data && !c->out->oom) {
        c->out->len = m->out_len;
        c->out->data[m->out_len] = 0;
    }
    for (size_t i = m->n_refs; i < c->n_refs; i++)
        free(c->refs[i].ref);
    c->n_refs = m->n_refs;
    memcpy(c->prim_done, m->prims, sizeof m->prims);
    tdm_error_clear(c->err);
    c->unsat = false;
}

int js_compile_or_none(js_ctx_t *c, json_t *s, const char *ptr, char *name, bool *none)
{
    js_mark_t m;
    js_mark_set(c, &m);
    *none = false;
    int rc = js_compile(c, s, ptr, name);
    if (rc == TDM_EINVALID && c->unsat) {
        js_mark_undo(c, &m);
        *none = true;
        name[0] = 0;
        return 0;
    }
    return rc;
}

void js_ptr_join(char *out, const char *ptr, const char *key)
{
    size_t n = (size_t)snprintf(out, JS_PTR_MAX, "%s/", ptr);
    for (const char *k = key; *k && n + 3 < JS_PTR_MAX; k++) {
        if (*k == '~' || *k == '/') {
            out[n++] = '~';
            out[n++] = *k == '~' ? '0' : '1';
        } else {
            out[n++] = *k;
        }
    }
    out[n < JS_PTR_MAX ? n : JS_PTR_MAX - 1] = 0;
}

void js_ptr_index(char *out, const char *ptr, size_t i)
{
    if (snprintf(out, JS_PTR_MAX, "%s/%zu", ptr, i) >= JS_PTR_MAX)
        out[JS_PTR_MAX - 1] = 0; /* a long pointer is cut (messages only) */
}

void js_new_name(js_ctx_t *c, char *name)
{
    /* what snprintf(name, JS_NAME_MAX, "%s-%u", prefix, n) writes, without its cost per rule */
    char digits[16];
    size_t nd = 0, np = strnlen(c->prefix, JS_NAME_MAX - 1);
    for (unsigned v = c->next_rule++; nd == 0 || v > 0; v /= 10)
        digits[nd++] = (char)('0' + v % 10);
    size_t at = np;
    memcpy(name, c->prefix, np);
    if (at < JS_NAME_MAX - 1)
        name[at++] = '-';
    while (nd > 0 && at < JS_NAME_MAX - 1)
        name[at++] = digits[--nd];
    name[at] = 0;
}

int js_emit_rule(js_ctx_t *c, const char *name, const char *body)
{
    tdm_buf_puts(c->out, name);
    tdm_buf_puts(c->out, " ::= ");
    tdm_buf_puts(c->out, body);
    tdm_buf_puts(c->out, "\n");
    return c->out->oom ? js_oom(c) : 0;
}

/* ---- repetition ---- */

/* x{n}, with counts over JS_REP_CHUNK written as (x{JS_REP_CHUNK}){q} x{r}. */
static void rep_exact(tdm_buf_t *b, const char *x, size_t n)
{
    if (n >= JS_REP_CHUNK)
        tdm_buf_printf(b, "( %s{%u} ){%zu} ", x, JS_REP_CHUNK, n / JS_REP_CHUNK);
    if (n % JS_REP_CHUNK)
        tdm_buf_printf(b, "%s{%zu} ", x, n % JS_REP_CHUNK);
}

void js_rep(tdm_buf_t *b, const char *x, size_t lo, size_t hi)
{
    if (hi == JS_LEN_INF) {
        if (lo <= 1) {
            tdm_buf_printf(b, "%s%s", x, lo ? "+" : "*");
            return;
        }
        if (lo <= JS_REP_CHUNK) {
            tdm_buf_printf(b, "%s{%zu,}", x, lo);
            return;
        }
        rep_exact(b, x, lo);
        tdm_buf_printf(b, "%s*", x);
        return;
    }
    if (hi <= JS_REP_CHUNK) {
        if (lo == hi)
            tdm_buf_printf(b, "%s{%zu}", x, lo);
        else
            tdm_buf_printf(b, "%s{%zu,%zu}", x, lo, hi);
        return;
    }
    /* x{lo} then x{0,d}: d = JS_REP_CHUNK q + r is (x{C}){0,q-1} x{0,C-1} | (x{C}){q} x{0,r} */
    size_t d = hi - lo, q = d / JS_REP_CHUNK, r = d % JS_REP_CHUNK;
    tdm_buf_puts(b, "( ");
    rep_exact(b, x, lo);
    if (q == 0) {
        tdm_buf_printf(b, "%s{0,%zu} )", x, r);
        return;
    }
    tdm_buf_printf(b, "( ( %s{%u} ){0,%zu} %s{0,%u} | ( %s{%u} ){%zu} %s{0,%zu} ) )", x,
                   JS_REP_CHUNK, q - 1, x, JS_REP_CHUNK - 1, x, JS_REP_CHUNK, q, x, r);
}

/* ---- primitives ---- */

static const struct {
    const char *suffix, *body; /* body: %1$s is the prefix */
} k_prims[JS_PRIM_COUNT] = {
    [JS_PRIM_WS] = {"ws", "( \" \" | \"\\n\" [ \\t]{0,20} )?"},
    [JS_PRIM_CHAR] = {"char", "[^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" "
                              "[0-9a-fA-F]{4} )"},
    [JS_PRIM_STRING] = {"string", "\"\\\"\" %1$s-char* \"\\\"\""},
    [JS_PRIM_INTEGER] = {"integer", "\"-\"? ( \"0\" | [1-9] [0-9]* )"},
    [JS_PRIM_NUMBER] = {"number", "\"-\"? ( \"0\" | [1-9] [0-9]* ) ( \".\" [0-9]+ )? ( [eE] "
                                  "[-+]? [0-9]+ )?"},
    [JS_PRIM_BOOLEAN] = {"boolean", "\"true\" | \"false\""},
    [JS_PRIM_NULL] = {"null", "\"null\""},
    [JS_PRIM_VALUE] = {"value", "%1$s-object | %1$s-array | %1$s-string | %1$s-number | "
                                "%1$s-boolean | %1$s-null"},
    [JS_PRIM_OBJECT] = {"object", "\"{\" %1$s-ws ( %1$s-string %1$s-ws \":\" %1$s-ws "
                                  "%1$s-value %1$s-ws ( \",\" %1$s-ws %1$s-string %1$s-ws "
                                  "\":\" %1$s-ws %1$s-value %1$s-ws )* )? \"}\""},
    [JS_PRIM_ARRAY] = {"array", "\"[\" %1$s-ws ( %1$s-value %1$s-ws ( \",\" %1$s-ws "
                                "%1$s-value %1$s-ws )* )? \"]\""},
};

/* The primitives each one uses. */
static const js_prim_t k_prim_deps[JS_PRIM_COUNT][6] = {
    [JS_PRIM_STRING] = {JS_PRIM_CHAR},
    [JS_PRIM_VALUE] = {JS_PRIM_OBJECT, JS_PRIM_ARRAY, JS_PRIM_STRING, JS_PRIM_NUMBER,
                       JS_PRIM_BOOLEAN, JS_PRIM_NULL},
    [JS_PRIM_OBJECT] = {JS_PRIM_WS, JS_PRIM_STRING, JS_PRIM_VALUE},
    [JS_PRIM_ARRAY] = {JS_PRIM_WS, JS_PRIM_VALUE},
};

int js_prim(js_ctx_t *c, js_prim_t p, char *name)
{
    snprintf(name, JS_NAME_MAX, "%s-%s", c->prefix, k_prims[p].suffix);
    if (c->prim_done[p])
        return 0;
    c->prim_done[p] = true;
    tdm_buf_printf(c->out, "%s ::= ", name);
    /* The bodies use only %1$s; expand it by hand (no positional printf needed). */
    for (const char *b = k_prims[p].body; *b; b++) {
        if (strncmp(b, "%1$s", 4) == 0) {
            tdm_buf_puts(c->out, c->prefix);
            b += 3;
        } else {
            tdm_buf_append(c->out, b, 1);
        }
    }
    tdm_buf_puts(c->out, "\n");
    for (int i = 0; i < 6 && k_prim_deps[p][i]; i++) {
        char dep[JS_NAME_MAX];
        js_prim(c, k_prim_deps[p][i], dep);
    }
    return c->out->oom ? js_oom(c) : 0;
}

/* ---- keywords ---- */

/* Refuses the unsupported vocabulary keywords of s; sets *has_constraints when s has any
 * keyword besides annotations and $defs / definitions. */
static int check_keywords(js_ctx_t *c, json_t *s, const char *ptr, bool *has_constraints)
{
    const char *key;
    json_t *v;
    *has_constraints = false;
    json_object_foreach(s, key, v)
    {
        if (in_list(k_refused, key)) {
            return js_fail(c, ptr, key, "not supported");
        }
        if (in_list(k_supported, key) && strcmp(key, "$defs") != 0 &&
            strcmp(key, "definitions") != 0)
            *has_constraints = true;
    }
    return 0;
}

bool js_keyword_constrains(const char *key)
{
    return (in_list(k_supported, key) || in_list(k_refused, key)) && strcmp(key, "$defs") != 0 &&
           strcmp(key, "definitions") != 0;
}

/* A copy of s without the named keys (owned by c->keep). */
static json_t *without(js_ctx_t *c, json_t *s, const char *k1, const char *k2)
{
    json_t *t = json_copy(s);
    if (!t || json_array_append_new(c->keep, t) != 0)
        return NULL;
    json_object_del(t, k1);
    if (k2)
        json_object_del(t, k2);
    return t;
}

/* ---- $ref ---- */

/* Decodes one JSON pointer token (~0 ~1, %XX) of ref[0..n) into tok[cap]. */
static bool ptr_token(const char *p, size_t n, char *tok, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n && k + 1 < cap; i++) {
        char ch = p[i];
        if (ch == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1'))
            ch = p[++i] == '0' ? '~' : '/';
        else if (ch == '%' && i + 2 < n) {
            unsigned v;
            if (sscanf(p + i + 1, "%2x", &v) == 1) {
                ch = (char)v;
                i += 2;
            }
        }
        tok[k++] = ch;
    }
    tok[k] = 0;
    return k + 1 < cap || n == 0;
}

/* ---- plain-name anchors ($ref "#name") ---- */

/* The keywords whose values are data, not schemas: an "$anchor" there names nothing. */
static const char *const k_data[] = {"enum", "const", "default", "examples", NULL};

typedef struct anchor_find {
    const char *name;     /* the anchor looked for */
    json_t *found;        /* the schema it names (the first) */
    int n_found;          /* schemas naming it */
    bool other_resource;  /* a schema below the root has an $id / id of another resource */
    char ptr[JS_PTR_MAX]; /* the JSON pointer of the node being searched */
    char found_ptr[JS_PTR_MAX];
} anchor_find_t;

/* True when schema object s declares the plain-name anchor name: "$anchor" or "$dynamicAnchor"
 * (2019-09 and later; a $ref names a dynamic anchor statically), or an "$id" / "id" that is
 * the bare fragment "#name" (drafts 4 to 7). Notes an $id / id naming another resource. */
static bool declares_anchor(anchor_find_t *f, const json_t *s, bool is_root)
{
    bool hit = false;
    const char *keys[] = {"$anchor", "$dynamicAnchor", "$id", "id"};
    for (int k = 0; k < 4; k++) {
        const char *v = json_string_value(json_object_get(s, keys[k]));
        if (!v)
            continue;
        if (k < 2)
            hit = hit || strcmp(v, f->name) == 0;
        else if (v[0] == '#')
            hit = hit || strcmp(v + 1, f->name) == 0;
        else if (!is_root)
            f->other_resource = true; /* anchors below it are that resource's */
    }
    return hit;
}

/* Appends "/" and key (~ and / escaped) to the pointer ptr[JS_PTR_MAX] of length len, cut at
 * the buffer's end (it names the schema in messages only); returns the new length. */
static size_t ptr_append(char *ptr, size_t len, const char *key)
{
    size_t n = len;
    if (n + 1 < JS_PTR_MAX)
        ptr[n++] = '/';
    for (const char *p = key; *p && n + 2 < JS_PTR_MAX; p++) {
        if (*p == '~' || *p == '/') {
            ptr[n++] = '~';
            ptr[n++] = *p == '~' ? '0' : '1';
        } else {
            ptr[n++] = *p;
        }
    }
    ptr[n] = 0;
    return n;
}

/* Searches node (at f->ptr, of length len) and everything below it that can be a schema. */
static void anchor_search(anchor_find_t *f, json_t *node, size_t len, int depth)
{
    if (depth > 2 * JS_MAX_DEPTH) {
        f->other_resource = true; /* too deep to search: refuse rather than guess */
        return;
    }
    if (json_is_object(node) && declares_anchor(f, node, depth == 0) && f->n_found++ == 0) {
        f->found = node;
        memcpy(f->found_ptr, f->ptr, len + 1);
    }
    const char *key;
    json_t *v;
    size_t i;
    if (json_is_array(node)) {
        json_array_foreach(node, i, v)
        {
            char tok[24];
            snprintf(tok, sizeof tok, "%zu", i);
            anchor_search(f, v, ptr_append(f->ptr, len, tok), depth + 1);
            f->ptr[len] = 0;
        }
        return;
    }
    json_object_foreach(node, key, v)
    {
        if (in_list(k_data, key) || (!json_is_object(v) && !json_is_array(v)))
            continue;
        size_t n = ptr_append(f->ptr, len, key);
        anchor_search(f, v, n, depth + 1);
        f->ptr[len] = 0;
    }
}

/* The schema "#name" names: the one schema of the document declaring that anchor, with no $id
 * of another resource below the root (whose anchors would be scoped to it). NULL (refused,
 * naming the reason) otherwise; *target gets its JSON pointer. */
static json_t *resolve_anchor(js_ctx_t *c, const char *ref, const char *ptr, char *target)
{
    anchor_find_t *f = calloc(1, sizeof *f);
    if (!f) {
        js_oom(c);
        return NULL;
    }
    f->name = ref + 1;
    anchor_search(f, c->root, 0, 0);
    json_t *t = NULL;
    if (f->other_resource)
        js_fail(c, ptr, "$ref",
                "'%s' not supported (an anchor in a document with embedded resources, $id)", ref);
    else if (f->n_found == 0)
        js_fail(c, ptr, "$ref", "'%s' not found (no $anchor or id of that name)", ref);
    else if (f->n_found > 1)
        js_fail(c, ptr, "$ref", "'%s' is ambiguous (%d schemas declare that anchor)", ref,
                f->n_found);
    else
        t = f->found;
    if (t && target)
        snprintf(target, JS_PTR_MAX, "%s", f->found_ptr);
    free(f);
    return t;
}

/* True when ref is "#" followed by a plain name (an anchor: a letter or '_', then letters,
 * digits, '-', '_', '.', ':'). */
static bool is_anchor_ref(const char *ref)
{
    if (ref[0] != '#' || !(isalpha((unsigned char)ref[1]) || ref[1] == '_'))
        return false;
    for (const char *p = ref + 2; *p; p++)
        if (!isalnum((unsigned char)*p) && !strchr("-_.:", *p))
            return false;
    return true;
}

/* The schema ref names and its JSON pointer in target[JS_PTR_MAX] (may be NULL). */
static json_t *resolve_ref_at(js_ctx_t *c, const char *ref, const char *ptr, char *target)
{
    if (is_anchor_ref(ref))
        return resolve_anchor(c, ref, ptr, target);
    json_t *t = js_resolve_ref(c, ref, ptr);
    if (t && target)
        snprintf(target, JS_PTR_MAX, "%s", ref + 1);
    return t;
}

json_t *js_resolve_ref(js_ctx_t *c, const char *ref, const char *ptr)
{
    if (is_anchor_ref(ref))
        return resolve_anchor(c, ref, ptr, NULL);
    if (ref[0] != '#' || (ref[1] != 0 && ref[1] != '/')) {
        js_fail(c, ptr, "$ref",
                "'%s' not supported (only JSON pointers and anchors within the document)", ref);
        return NULL;
    }
    json_t *t = c->root;
    for (const char *p = ref + 1; *p == '/' && t;) {
        const char *end = strchr(p + 1, '/');
        size_t n = end ? (size_t)(end - p - 1) : strlen(p + 1);
        char tok[256];
        if (!ptr_token(p + 1, n, tok, sizeof tok))
            t = NULL;
        else if (json_is_object(t))
            t = json_object_get(t, tok);
        else if (json_is_array(t))
            t = json_array_get(t, (size_t)strtoul(tok, NULL, 10));
        else
            t = NULL;
        p += n + 1;
    }
    if (!t)
        js_fail(c, ptr, "$ref", "'%s' not found", ref);
    return t;
}

/* The memo entry for a $ref text or a schema node, or NULL. */
static const js_ref_t *memo_find(const js_ctx_t *c, const char *ref, const json_t *node)
{
    for (size_t i = 0; i < c->n_refs; i++) {
        const js_ref_t *r = &c->refs[i];
        if (ref ? (r->ref && strcmp(r->ref, ref) == 0) : r->node == node)
            return r;
    }
    return NULL;
}

/* Records a new rule name for ref (or node) in the memo and returns it in name. */
static int memo_add(js_ctx_t *c, const char *ref, const json_t *node, char *name)
{
    if (c->n_refs == c->cap_refs) {
        size_t cap = c->cap_refs ? 2 * c->cap_refs : 16;
        js_ref_t *r = realloc(c->refs, cap * sizeof *r);
        if (!r)
            return js_oom(c);
        c->refs = r;
        c->cap_refs = cap;
    }
    js_ref_t *r = &c->refs[c->n_refs];
    r->node = node;
    r->ref = NULL;
    if (ref && !(r->ref = tdm_strdup(ref)))
        return js_oom(c);
    js_new_name(c, r->name);
    c->n_refs++;
    snprintf(name, JS_NAME_MAX, "%s", r->name);
    return 0;
}

/* The rule of the schema a $ref names: compiled once, under a name chosen before compiling
 * it, so recursive references close the loop. */
static int compile_ref(js_ctx_t *c, const char *ref, const char *ptr, char *name)
{
    const js_ref_t *known = memo_find(c, ref, NULL);
    if (known) {
        snprintf(name, JS_NAME_MAX, "%s", known->name);
        return 0;
    }
    char target[JS_PTR_MAX];
    json_t *t = resolve_ref_at(c, ref, ptr, target);
    int rc = t ? memo_add(c, ref, NULL, name) : TDM_EINVALID;
    char target_name[JS_NAME_MAX];
    if (rc == 0)
        rc = js_compile(c, t, target, target_name);
    return rc != 0 ? rc : js_emit_rule(c, name, target_name);
}

/* s with its top-level $ref replaced by the target merged with the siblings (so allOf and
 * sibling merging see real keywords). */
int js_resolve_top(js_ctx_t *c, json_t *s, const char *ptr, json_t **out)
{
    json_t *ref = json_is_object(s) ? json_object_get(s, "$ref") : NULL;
    if (!ref) {
        *out = s;
        return 0;
    }
    if (!json_is_string(ref))
        return js_fail(c, ptr, "$ref", "must be a string");
    if (++c->depth > JS_MAX_DEPTH)
        return js_fail(c, ptr, "$ref", "references nested too deep to merge");
    json_t *t = js_resolve_ref(c, json_string_value(ref), ptr), *rest;
    int rc = !t ? TDM_EINVALID : 0;
    if (rc == 0)
        rc = js_resolve_top(c, t, ptr, &t);
    if (rc == 0)
        rc = js_merge_at_ref(c, s, &t);
    if (rc == 0 && !(rest = without(c, s, "$ref", NULL)))
        rc = js_oom(c);
    if (rc == 0)
        rc = js_merge(c, t, rest, ptr, out);
    c->depth--;
    return rc;
}

/* ---- anyOf / oneOf / allOf ---- */

/* allOf: the branches merged with each other and with the siblings, then compiled. */
static int compile_all_of(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    char p[JS_PTR_MAX];
    js_ptr_join(p, ptr, "allOf");
    json_t *all = json_object_get(s, "allOf");
    if (!json_is_array(all) || json_array_size(all) == 0)
        return js_fail(c, ptr, "allOf", "must be a non-empty array");
    json_t *acc = without(c, s, "allOf", NULL), *b;
    if (!acc)
        return js_oom(c);
    size_t i;
    json_array_foreach(all, i, b)
    {
        char bp[JS_PTR_MAX];
        js_ptr_index(bp, p, i);
        int rc = js_resolve_top(c, b, bp, &b);
        if (rc == 0)
            rc = js_merge(c, acc, b, bp, &acc);
        if (rc != 0)
            return rc;
    }
    return js_compile(c, acc, p, name);
}

/* Branch i of anyOf / oneOf as compiled: merged with the sibling keywords when there are
 * any (rest), else as written. */
static int branch(js_ctx_t *c, json_t *b, json_t *rest, bool rest_constrains, const char *bp,
                  json_t **m)
{
    *m = b;
    if (!rest_constrains)
        return 0;
    int rc = js_resolve_top(c, b, bp, m);
    return rc != 0 ? rc : js_merge(c, rest, *m, bp, m);
}

/* oneOf compiles as anyOf when no two branches can match the same value (different types,
 * different enum / const values, or a required property with different constants): then
 * exactly one matches whenever any does. *disjoint false: some pair may overlap (then each
 * branch is compiled with the complements of the others, js_compile_one_of). */
static int one_of_disjoint(js_ctx_t *c, json_t *branches, const char *ptr, bool *disjoint)
{
    size_t n = json_array_size(branches);
    *disjoint = true;
    for (size_t i = 0; i < n && *disjoint; i++) {
        for (size_t j = i + 1; j < n && *disjoint; j++) {
            json_t *a, *b;
            char bp[JS_PTR_MAX];
            js_ptr_index(bp, ptr, j);
            int rc = js_resolve_top(c, json_array_get(branches, i), ptr, &a);
            rc = rc ? rc : js_resolve_top(c, json_array_get(branches, j), bp, &b);
            if (rc != 0)
                return rc;
            *disjoint = js_disjoint(a, b);
        }
    }
    return 0;
}

/* anyOf / oneOf: one alternative per branch; sibling keywords are merged into each branch. */
static int compile_any_of(js_ctx_t *c, json_t *s, const char *ptr, const char *key, char *name)
{
    char p[JS_PTR_MAX];
    js_ptr_join(p, ptr, key);
    json_t *any = json_object_get(s, key), *b, *m;
    if (!json_is_array(any) || json_array_size(any) == 0)
        return js_fail(c, ptr, key, "must be a non-empty array");
    json_t *rest = without(c, s, key, NULL), *branches = json_array();
    if (!rest || !branches || json_array_append_new(c->keep, branches) != 0)
        return js_oom(c);
    bool rest_constrains;
    int rc = check_keywords(c, rest, ptr, &rest_constrains);
    size_t i;
    json_array_foreach(any, i, b)
    {
        char bp[JS_PTR_MAX];
        js_ptr_index(bp, p, i);
        rc = rc ? rc : branch(c, b, rest, rest_constrains, bp, &m);
        if (rc == 0 && json_array_append(branches, m) != 0)
            rc = js_oom(c);
    }
    if (rc == 0 && strcmp(key, "oneOf") == 0) {
        bool disjoint = false;
        rc = one_of_disjoint(c, branches, p, &disjoint);
        if (rc == 0 && !disjoint)
            return js_compile_one_of(c, branches, any, p, name);
    }
    tdm_buf_t body = TDM_BUF_INIT; /* a branch no value fits is left out */
    json_array_foreach(branches, i, m)
    {
        char bp[JS_PTR_MAX];
        js_ptr_index(bp, p, i);
        rc = rc ? rc : js_union_add(c, m, bp, &body);
    }
    rc = rc ? rc : js_union_emit(c, &body, ptr, key, name);
    tdm_buf_free(&body);
    return rc;
}

/* ---- types ---- */

enum {
    T_NULL = 1,
    T_BOOLEAN = 2,
    T_OBJECT = 4,
    T_ARRAY = 8,
    T_NUMBER = 16,
    T_INTEGER = 32,
    T_STRING = 64,
    T_ALL = 127
};

static const char *const k_type_names[] = {"null",   "boolean", "object", "array",
                                           "number", "integer", "string"};

static int type_bit(const char *t)
{
    for (int i = 0; i < 7; i++)
        if (strcmp(t, k_type_names[i]) == 0)
            return 1 << i;
    return 0;
}

/* The set of types `type` allows (all when absent). */
static int type_set(js_ctx_t *c, json_t *s, const char *ptr, int *types)
{
    json_t *t = json_object_get(s, "type"), *e;
    if (!t) {
        *types = T_ALL;
        return 0;
    }
    *types = json_is_string(t) ? type_bit(json_string_value(t)) : 0;
    if (json_is_string(t) && !*types)
        return js_fail(c, ptr, "type", "unknown type '%s'", json_string_value(t));
    if (json_is_array(t)) {
        size_t i;
        json_array_foreach(t, i, e)
        {
            int bit = json_is_string(e) ? type_bit(json_string_value(e)) : 0;
            if (!bit)
                return js_fail(c, ptr, "type", "entry %zu is not a type name", i);
            *types |= bit;
        }
    }
    if (!*types)
        return js_fail(c, ptr, "type", "must be a type name or a non-empty array of them");
    if (*types & T_NUMBER)
        *types &= ~T_INTEGER; /* number includes the integers */
    return 0;
}

/* Whether the JSON value v is of one of the types. */
static bool value_has_type(json_t *v, int types)
{
    switch (json_typeof(v)) {
    case JSON_NULL: return types & T_NULL;
    case JSON_TRUE:
    case JSON_FALSE: return types & T_BOOLEAN;
    case JSON_OBJECT: return types & T_OBJECT;
    case JSON_ARRAY: return types & T_ARRAY;
    case JSON_STRING: return types & T_STRING;
    case JSON_INTEGER: return types & (T_NUMBER | T_INTEGER);
    case JSON_REAL: {
        double d = json_real_value(v);
        return (types & T_NUMBER) || ((types & T_INTEGER) && d == (double)(long long)d);
    }
    }
    return false;
}

/* Whether v holds a real that may stand for an integer beyond 64 bits (read as a real). */
static bool has_big(json_t *v)
{
    size_t i;
    const char *k;
    json_t *x;
    if (json_is_real(v))
        return fabs(json_real_value(v)) >= 9e18;
    json_array_foreach(v, i, x)
    {
        if (has_big(x))
            return true;
    }
    json_object_foreach(v, k, x)
    {
        if (has_big(x))
            return true;
    }
    return false;
}

/* Whether array v has two equal items (uniqueItems; numbers compared as doubles, others as
 * jansson compares them). */
static bool has_duplicates(json_t *v)
{
    for (size_t i = 0; i < json_array_size(v); i++)
        for (size_t j = i + 1; j < json_array_size(v); j++) {
            json_t *a = json_array_get(v, i), *b = json_array_get(v, j);
            if (json_is_number(a) && json_is_number(b)
                    ? json_number_value(a) == json_number_value(b)
                    : json_equal(a, b))
                return true;
        }
    return false;
}

/* Whether JSON values a and b are equal as JSON Schema compares them (1 equals 1.0). */
static bool values_equal(json_t *a, json_t *b)
{
    if (json_is_number(a) && json_is_number(b)) /* equal values give equal doubles */
        return json_number_value(a) == json_number_value(b);
    return json_equal(a, b);
}

/* The values of s's `not: {enum}` / `not: {const}` (NULL: none of that form). */
static json_t *not_values(json_t *s, json_t **one)
{
    json_t *n = json_object_get(s, "not");
    *one = json_object_get(n, "const");
    return json_object_get(n, "enum");
}

/* Whether v is one of the values s's `not: {enum / const}` excludes. */
static bool excluded_by_not(json_t *s, json_t *v)
{
    json_t *one, *vals = not_values(s, &one), *e;
    size_t i;
    if (one && values_equal(one, v))
        return true;
    json_array_foreach(vals, i, e) if (values_equal(e, v)) return true;
    return false;
}

/* Whether n (a `not`'s schema) is `{enum}` or `{const}` beside annotations. */
static bool not_enum_form(json_t *n)
{
    const char *key;
    json_t *v;
    bool any = false;
    if (!json_is_object(n))
        return false;
    json_object_foreach(n, key, v)
    {
        bool e = strcmp(key, "enum") == 0 || strcmp(key, "const") == 0;
        if (!e && (in_list(k_supported, key) || in_list(k_refused, key)))
            return false;
        any = any || e;
    }
    return any && (!json_object_get(n, "enum") || json_is_array(json_object_get(n, "enum")));
}

/* Whether every value `not: {enum / const}` lists is a string. */
static bool not_strings_only(json_t *n)
{
    json_t *one = json_object_get(n, "const"), *vals = json_object_get(n, "enum"), *e;
    size_t i;
    if (one && !json_is_string(one))
        return false;
    json_array_foreach(vals, i, e) if (!json_is_string(e)) return false;
    return true;
}

/* Whether n (a `not`'s schema) is one `pattern` or one `format` with a regex form beside
 * annotations: over strings, js_string excludes its matches through the automaton. */
static bool not_string_form(json_t *n)
{
    const char *key;
    json_t *v;
    int found = 0;
    if (!json_is_object(n))
        return false;
    json_object_foreach(n, key, v)
    {
        bool p = strcmp(key, "pattern") == 0 && json_is_string(v);
        bool f = strcmp(key, "format") == 0 && json_is_string(v) && !js_format_custom(v);
        if (f) {
            tdm_buf_t rx = TDM_BUF_INIT;
            f = js_format_regex(json_string_value(v), &rx) == 0;
            tdm_buf_free(&rx);
        }
        if (!p && !f && (in_list(k_supported, key) || in_list(k_refused, key)))
            return false;
        found += p || f;
    }
    return found == 1 || (found == 0 && not_strings_only(n) && not_enum_form(n));
}

/* Whether n is `{type}` beside annotations (or has no validation keyword at all). */
static bool not_type_form(json_t *n)
{
    const char *key;
    json_t *v;
    if (!json_is_object(n))
        return true;
    json_object_foreach(n, key, v)
    {
        if (strcmp(key, "type") != 0 && (in_list(k_supported, key) || in_list(k_refused, key)))
            return false;
    }
    return true;
}

/* ---- enum / const beside other keywords: each value checked against them ---- */

/* The JSON type a keyword applies to (T_*), or 0 for one that applies to every value. */
static int keyword_type(const char *key)
{
    static const char *const str[] = {"minLength", "maxLength", "pattern", "format", NULL};
    static const char *const num[] = {"minimum",          "maximum",    "exclusiveMinimum",
                                      "exclusiveMaximum", "multipleOf", NULL};
    static const char *const arr[] = {"items",    "prefixItems", "additionalItems", "minItems",
                                      "maxItems", "uniqueItems", "contains",        NULL};
    if (in_list(str, key))
        return T_STRING;
    if (in_list(num, key))
        return T_NUMBER | T_INTEGER;
    if (in_list(arr, key))
        return T_ARRAY;
    static const char *const obj[] = {"properties",           "required",
                                      "additionalProperties", "patternProperties",
                                      "minProperties",        "maxProperties",
                                      "dependentRequired",    "dependencies",
                                      "dependentSchemas",     NULL};
    return in_list(obj, key) ? T_OBJECT : 0;
}

/* The number of code points of UTF-8 text s. */
static size_t utf8_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/* x (a number keyword's value) against the value d: the comparison key asks for. */
static bool number_ok(const char *key, json_t *x, json_t *v, json_t *s)
{
    double d = json_number_value(v), b = json_number_value(x);
    bool both_int = json_is_integer(v) && json_is_integer(x);
    json_int_t iv = json_integer_value(v), ib = json_integer_value(x);
    if (json_is_boolean(x)) /* draft 4: exclusiveMinimum / exclusiveMaximum beside the bound */
        return true;
    bool strict_min = json_is_true(json_object_get(s, "exclusiveMinimum"));
    bool strict_max = json_is_true(json_object_get(s, "exclusiveMaximum"));
    if (strcmp(key, "minimum") == 0)
        return both_int ? (strict_min ? iv > ib : iv >= ib) : (strict_min ? d > b : d >= b);
    if (strcmp(key, "maximum") == 0)
        return both_int ? (strict_max ? iv < ib : iv <= ib) : (strict_max ? d < b : d <= b);
    if (strcmp(key, "exclusiveMinimum") == 0)
        return both_int ? iv > ib : d > b;
    return both_int ? iv < ib : d < b; /* exclusiveMaximum */
}

/* Whether value v satisfies the keyword key: x of s: 1 yes, 0 no; TDM_EINVALID (refused with
 * the keyword's pointer) for a keyword this check does not evaluate. */
static int value_meets(js_ctx_t *c, json_t *s, const char *key, json_t *x, json_t *v,
                       const char *ptr)
{
    if (json_is_string(v) && (strcmp(key, "minLength") == 0 || strcmp(key, "maxLength") == 0) &&
        json_is_integer(x)) {
        json_int_t n = (json_int_t)utf8_chars(json_string_value(v));
        return key[1] == 'i' ? n >= json_integer_value(x) : n <= json_integer_value(x);
    }
    if (json_is_number(v) && json_is_number(x) && strcmp(key, "multipleOf") != 0)
        return number_ok(key, x, v, s);
    if (json_is_number(v) && json_is_boolean(x))
        return 1; /* draft 4's exclusive flags: read with the bound */
    if (json_is_integer(v) && json_is_integer(x) && json_integer_value(x) > 0 &&
        strcmp(key, "multipleOf") == 0)
        return json_integer_value(v) % json_integer_value(x) == 0;
    bool items = strcmp(key, "minItems") == 0 || strcmp(key, "maxItems") == 0;
    bool props = strcmp(key, "minProperties") == 0 || strcmp(key, "maxProperties") == 0;
    if ((items && json_is_array(v)) || (props && json_is_object(v))) {
        json_int_t n = (json_int_t)(items ? json_array_size(v) : json_object_size(v));
        return json_is_integer(x) &&
               (key[1] == 'i' ? n >= json_integer_value(x) : n <= json_integer_value(x));
    }
    if (strcmp(key, "required") == 0 && json_is_object(v) && json_is_array(x)) {
        size_t i;
        json_t *k;
        json_array_foreach(x, i, k) if (!json_is_string(k) ||
                                        !json_object_get(v, json_string_value(k))) return 0;
        return 1;
    }
    if (strcmp(key, "uniqueItems") == 0)
        return 1; /* checked by compile_enum */
    if (strcmp(key, "format") == 0 && js_format_custom(x))
        return 1; /* an annotation */
    return js_fail(c, ptr, key,
                   "not supported beside enum / const (values not checked against it)");
}

/* Whether enum value v satisfies the other keywords of s that apply to its type (type, not
 * and uniqueItems are checked by compile_enum): 1, 0, or TDM_EINVALID with the refusal. */
static int value_fits(js_ctx_t *c, json_t *s, json_t *v, const char *ptr)
{
    const char *key;
    json_t *x;
    int vt = json_is_string(v)   ? T_STRING
             : json_is_number(v) ? T_NUMBER | T_INTEGER
             : json_is_array(v)  ? T_ARRAY
             : json_is_object(v) ? T_OBJECT
                                 : T_NULL | T_BOOLEAN;
    json_object_foreach(s, key, x)
    {
        static const char *const skip[] = {"type",  "enum",        "const", "not",
                                           "$defs", "definitions", NULL};
        if (!in_list(k_supported, key) || in_list(skip, key))
            continue;
        int kt = keyword_type(key);
        if (kt != 0 && !(kt & vt))
            continue; /* applies to another type */
        int rc = value_meets(c, s, key, x, v, ptr);
        if (rc != 1)
            return rc;
    }
    return 1;
}

static int compile_enum(js_ctx_t *c, json_t *s, const char *ptr, int types, char *name)
{
    json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const"), *v;
    bool unique = json_is_true(json_object_get(s, "uniqueItems"));
    if (en && (!json_is_array(en) || json_array_size(en) == 0))
        return js_fail(c, ptr, "enum", "must be a non-empty array");
    size_t i, n = 0, count = en ? json_array_size(en) : 1;
    json_t **vals = calloc(count, sizeof *vals);
    if (!vals)
        return js_oom(c);
    int rc = 0;
    for (i = 0; i < count && rc == 0; i++) {
        v = en ? json_array_get(en, i) : cn;
        if (value_has_type(v, types) && !(en && cn && !json_equal(v, cn)) &&
            !excluded_by_not(s, v) && !(unique && json_is_array(v) && has_duplicates(v))) {
            rc = value_fits(c, s, v, ptr);
            if (rc == 1)
                vals[n++] = v;
            rc = rc == 1 || rc == 0 ? 0 : rc;
        }
    }
    tdm_buf_t body = TDM_BUF_INIT;
    for (i = 0; i < n && c->bigints; i++)
        if (has_big(vals[i]))
            rc = js_fail(c, ptr, en ? "enum" : "const",
                         "integers beyond 64 bits in values not supported");
    if (rc == 0 && n == 0)
        rc =
            js_fail_unsat(c, ptr, en ? "enum" : "const", "no value allowed (type, enum and const)");
    else if (rc == 0)
        rc = js_enum_expr(c, vals, n, &body);
    if (rc == 0) {
        js_new_name(c, name);
        rc = js_emit_rule(c, name, body.data);
    }
    tdm_buf_free(&body);
    free(vals);
    return rc;
}

/* One alternative per allowed type, each compiled with the keywords that apply to it. A type
 * no value of which fits the keywords is left out (JSON Schema's keywords constrain only the
 * values of their own type: `{"minimum": 2, "maximum": 0}` allows every non-number); none
 * left: refused as allowing no value, with the first type's reason. */
static int compile_types(js_ctx_t *c, json_t *s, const char *ptr, int types, char *name)
{
    tdm_buf_t body = TDM_BUF_INIT;
    int rc = 0, n = 0;
    char sub[JS_NAME_MAX], first[JS_NAME_MAX] = "";
    tdm_error_t why = {0};
    for (int bit = 1; bit < T_ALL && rc == 0; bit <<= 1) {
        if (!(types & bit))
            continue;
        js_mark_t m;
        js_mark_set(c, &m);
        switch (bit) {
        case T_NULL: rc = js_prim(c, JS_PRIM_NULL, sub); break;
        case T_BOOLEAN: rc = js_prim(c, JS_PRIM_BOOLEAN, sub); break;
        case T_OBJECT: rc = js_object(c, s, ptr, sub); break;
        case T_ARRAY: rc = js_array(c, s, ptr, sub); break;
        case T_NUMBER: rc = js_number(c, s, ptr, sub); break;
        case T_INTEGER: rc = js_integer(c, s, ptr, sub); break;
        default: rc = js_string(c, s, ptr, sub); break;
        }
        if (rc == TDM_EINVALID && c->unsat) { /* no value of this type */
            if (why.code == 0 && c->err)
                why = *c->err;
            why.code = TDM_EINVALID;
            js_mark_undo(c, &m);
            rc = 0;
            continue;
        }
        if (rc != 0)
            break; /* refused: sub was not written */
        if (n == 0)
            snprintf(first, sizeof first, "%s", sub);
        tdm_buf_printf(&body, "%s%s", n++ ? " | " : "", sub);
    }
    if (rc == 0 && n == 0) {
        if (c->err)
            *c->err = why;
        c->unsat = true;
        rc = TDM_EINVALID;
    } else if (rc == 0 && n == 1) {
        snprintf(name, JS_NAME_MAX, "%s", first);
    } else if (rc == 0) {
        js_new_name(c, name);
        rc = body.oom ? js_oom(c) : js_emit_rule(c, name, body.data);
    }
    tdm_buf_free(&body);
    return rc;
}

/* Whether s has a compiled keyword besides skip (and $defs / definitions). */
static bool has_siblings(json_t *s, const char *skip)
{
    const char *key;
    json_t *v;
    json_object_foreach(s, key, v)
    {
        if (strcmp(key, skip) != 0 && in_list(k_supported, key) && strcmp(key, "$defs") != 0 &&
            strcmp(key, "definitions") != 0)
            return true;
    }
    return false;
}

/* One alternative per schema of the array cases, each compiled at ptr (they are cases of the
 * schema there, not subschemas of their own). */
static int compile_cases(js_ctx_t *c, json_t *cases, const char *ptr, char *name)
{
    tdm_buf_t body = TDM_BUF_INIT;
    char sub[JS_NAME_MAX];
    size_t i;
    json_t *v;
    int rc = 0;
    json_array_foreach(cases, i, v)
    {
        if ((rc = js_compile(c, v, ptr, sub)) != 0)
            break;
        tdm_buf_printf(&body, "%s%s", i ? " | " : "", sub);
    }
    if (rc == 0) {
        js_new_name(c, name);
        rc = body.oom ? js_oom(c) : js_emit_rule(c, name, body.data);
    }
    tdm_buf_free(&body);
    return rc;
}

/* `not`: s without it, when the excluded set is expressible: `not: {type: ...}` (beside
 * annotations) removes those types from the ones s allows (`integer` only where s does not
 * allow all numbers: the numbers that are not integers are not written as a grammar);
 * `not: false` excludes nothing; `not: true` or `{}` excludes everything. *out is owned by
 * c->keep. */
static int without_not(js_ctx_t *c, json_t *s, const char *ptr, json_t **out)
{
    json_t *n = json_object_get(s, "not"), *v;
    const char *key;
    char np[JS_PTR_MAX];
    int types, excluded = 0, rc;
    js_ptr_join(np, ptr, "not");
    if (json_is_object(n)) {
        json_object_foreach(n, key, v)
        {
            if (strcmp(key, "type") != 0 && (in_list(k_supported, key) || in_list(k_refused, key)))
                return js_fail(c, ptr, "not", "not supported (only not: {type: ...})");
        }
        if (!json_object_get(n, "type"))
            return js_fail_unsat(c, ptr, "not", "excludes every value");
        if ((rc = type_set(c, n, np, &excluded)) != 0)
            return rc;
    } else if (json_is_true(n)) {
        return js_fail_unsat(c, ptr, "not", "excludes every value");
    } else if (!json_is_false(n)) {
        return js_fail(c, ptr, "not", "must be a schema");
    }
    if ((rc = type_set(c, s, ptr, &types)) != 0)
        return rc;
    if (excluded & T_NUMBER)
        excluded |= T_INTEGER;
    if ((excluded & T_INTEGER) && (types & T_NUMBER) && !(excluded & T_NUMBER))
        return js_fail(c, ptr, "not", "not supported: 'integer' excluded from 'number'");
    types &= ~excluded;
    if (!types)
        return js_fail_unsat(c, ptr, "not", "excludes every type allowed");
    json_t *t = json_copy(s), *names = json_array();
    if (!t || json_array_append_new(c->keep, t) != 0) {
        json_decref(names);
        return js_oom(c);
    }
    for (int i = 0; names && i < 7; i++)
        if ((types & (1 << i)) && json_array_append_new(names, json_string(k_type_names[i])) != 0)
            break;
    json_object_del(t, "not");
    if (!names || json_object_set_new(t, "type", names) != 0)
        return js_oom(c);
    *out = t;
    return 0;
}

/* s with `not: {enum / const}` and no enum of its own: the types the listed values do not
 * touch, the other boolean, and the strings but the listed ones (js_string), each merged with
 * s without `not`. Numbers, objects and arrays among the values are refused where s allows
 * their type. */
static int not_enum_cases(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    json_t *n = json_object_get(s, "not"), *one = json_object_get(n, "const");
    json_t *vals = json_pack("[]"), *strs = json_pack("[]"), *cases = json_pack("[]"), *e;
    json_t *base = without(c, s, "not", NULL);
    int types, seen = 0, rc = type_set(c, s, ptr, &types);
    if (!vals || !strs || !cases || !base || json_array_append_new(c->keep, vals) ||
        json_array_append_new(c->keep, strs) || json_array_append_new(c->keep, cases))
        return js_oom(c);
    if (one)
        json_array_append(vals, one);
    json_array_extend(vals, json_object_get(n, "enum"));
    size_t i;
    bool bools[2] = {false, false};
    json_array_foreach(vals, i, e)
    {
        if (json_is_string(e))
            json_array_append(strs, e);
        else if (json_is_boolean(e))
            bools[json_is_true(e)] = true;
        seen |= json_is_null(e)      ? T_NULL
                : json_is_boolean(e) ? 0
                : json_is_string(e)  ? T_STRING
                : json_is_object(e)  ? T_OBJECT
                : json_is_array(e)   ? T_ARRAY
                                     : T_NUMBER | T_INTEGER;
    }
    if (rc == 0 && (seen & types & (T_OBJECT | T_ARRAY | T_NUMBER | T_INTEGER)))
        return js_fail(c, ptr, "not",
                       "not supported (not: {enum} with numbers, objects or arrays)");
    int rest = types & ~seen & ~((bools[0] || bools[1]) ? T_BOOLEAN : 0);
    json_t *names = json_array();
    for (int k = 0; names && k < 7; k++)
        if (rest & (1 << k))
            json_array_append_new(names, json_string(k_type_names[k]));
    if (json_array_size(names) > 0)
        json_array_append_new(cases, json_pack("{s:O}", "type", names));
    json_decref(names);
    if ((types & T_BOOLEAN) && bools[0] != bools[1])
        json_array_append_new(cases, json_pack("{s:b}", "const", bools[0]));
    if ((types & T_STRING) && json_array_size(strs) > 0)
        json_array_append_new(cases,
                              json_pack("{s:s,s:{s:O}}", "type", "string", "not", "enum", strs));
    return rc ? rc : js_compile_union(c, base, cases, ptr, "not", name);
}

/* The body of js_compile for an object schema whose keywords passed the check. */
static int compile_object_schema(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    json_t *n = json_object_get(s, "not");
    if (n && not_type_form(n)) {
        json_t *t = NULL;
        int rc = without_not(c, s, ptr, &t);
        return rc != 0 ? rc : js_compile(c, t, ptr, name);
    }
    int types;
    int rc = type_set(c, s, ptr, &types);
    if (rc != 0)
        return rc;
    bool string_not = n && types == T_STRING && not_string_form(n); /* js_string's */
    if (n && !not_enum_form(n) && !string_not) {
        json_t *base = without(c, s, "not", NULL);
        return base ? js_compile_negated(c, base, n, ptr, name) : js_oom(c);
    }
    if (json_object_get(s, "if")) {
        json_t *base = without(c, s, "if", "then");
        if (base)
            json_object_del(base, "else");
        return base ? js_compile_if(c, base, s, ptr, name) : js_oom(c);
    }
    json_t *ref = json_object_get(s, "$ref");
    if (ref && has_siblings(s, "$ref")) {
        json_t *m;
        rc = js_resolve_top(c, s, ptr, &m);
        return rc != 0 ? rc : js_compile(c, m, ptr, name);
    }
    if (ref) {
        if (!json_is_string(ref))
            return js_fail(c, ptr, "$ref", "must be a string");
        return compile_ref(c, json_string_value(ref), ptr, name);
    }
    json_t *cases;
    rc = js_expand_dependent(c, s, ptr, &cases);
    if (rc != 0 || cases)
        return rc != 0 ? rc : compile_cases(c, cases, ptr, name);
    if (json_object_get(s, "allOf"))
        return compile_all_of(c, s, ptr, name);
    bool any = json_object_get(s, "anyOf") != NULL, one = json_object_get(s, "oneOf") != NULL;
    if (any && one)
        return js_fail(c, ptr, "oneOf", "not supported together with anyOf");
    if (any || one)
        return compile_any_of(c, s, ptr, any ? "anyOf" : "oneOf", name);
    if (json_object_get(s, "enum") || json_object_get(s, "const"))
        return compile_enum(c, s, ptr, types, name); /* drops the values a `not` excludes */
    if (n && !string_not && !(types == T_STRING && not_strings_only(n)))
        return not_enum_cases(c, s, ptr, name);
    return compile_types(c, s, ptr, types, name); /* strings: js_string excludes them */
}

int js_compile(js_ctx_t *c, json_t *s, const char *ptr, char *name)
{
    if (json_is_true(s))
        return js_prim(c, JS_PRIM_VALUE, name);
    if (json_is_false(s))
        return js_fail_unsat(c, ptr, NULL, "the schema false allows no value");
    if (!json_is_object(s))
        return js_fail(c, ptr, NULL, "a schema must be an object or a boolean");
    bool constrains;
    int rc = check_keywords(c, s, ptr, &constrains);
    if (rc != 0)
        return rc;
    if (!constrains)
        return js_prim(c, JS_PRIM_VALUE, name);
    /* Nodes that merge (allOf, siblings of $ref / anyOf) are compiled once each: a recursive
     * schema that merges at every level closes its loop here, as $ref does. */
    bool merges = json_object_get(s, "allOf") || json_object_get(s, "anyOf") ||
                  json_object_get(s, "oneOf") || json_object_get(s, "$ref");
    const js_ref_t *known = merges ? memo_find(c, NULL, s) : NULL;
    if (known) {
        snprintf(name, JS_NAME_MAX, "%s", known->name);
        return 0;
    }
    if (++c->depth > JS_MAX_DEPTH) {
        c->depth--;
        return js_fail(c, ptr, NULL, "subschemas nested too deep (over %d)", JS_MAX_DEPTH);
    }
    char body[JS_NAME_MAX];
    size_t before = c->out->len;
    rc = merges ? memo_add(c, NULL, s, name) : 0;
    if (rc == 0)
        rc = compile_object_schema(c, s, ptr, merges ? body : name);
    if (rc == 0 && merges)
        rc = js_emit_rule(c, name, body);
    if (rc == 0 && c->out->len - before > TDM_GRAMMAR_MAX_TEXT_BYTES) /* the innermost culprit */
        rc = js_fail(c, ptr, NULL, "compiles to %zu bytes of grammar, over the limit of %u",
                     c->out->len - before, TDM_GRAMMAR_MAX_TEXT_BYTES);
    c->depth--;
    return rc;
}

/* ---- entry points ---- */

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

/* json[len] with every integer of more than 18 digits outside strings written as a real
 * ("N.0") into t, its text appended to bigints. Returns 0 or -1 (out of memory). */
static int big_as_real(const char *json, size_t len, tdm_buf_t *t, json_t *bigints)
{
    bool in_str = false;
    for (size_t i = 0; i < len;) {
        char ch = json[i];
        if (in_str || !(ch == '-' || (ch >= '0' && ch <= '9'))) {
            if (in_str && ch == '\\' && i + 1 < len) {
                tdm_buf_append(t, json + i, 2);
                i += 2;
                continue;
            }
            in_str = ch == '"' ? !in_str : in_str;
            tdm_buf_append(t, json + i++, 1);
            continue;
        }
        size_t j = i;
        bool integer = true;
        while (j < len && strchr("0123456789+-.eE", json[j]) && json[j]) {
            integer = integer && strchr(".eE", json[j]) == NULL;
            j++;
        }
        tdm_buf_append(t, json + i, j - i);
        if (integer && j - i - (ch == '-') > 18) {
            tdm_buf_puts(t, ".0");
            if (json_array_append_new(bigints, json_stringn(json + i, j - i)) != 0)
                return -1;
        }
        i = j;
    }
    return t->oom ? -1 : 0;
}

/* Compiles the parsed document root into out under rule (bigints: the texts of the integers
 * beyond 64 bits it holds as reals, or NULL). */
static int compile_document(json_t *root, json_t *bigints, const char *rule, tdm_buf_t *out,
                            tdm_error_t *err)
{
    js_ctx_t c;
    memset(&c, 0, sizeof c);
    c.root = root;
    c.bigints = bigints;
    c.out = out;
    c.err = err;
    snprintf(c.prefix, sizeof c.prefix, "%s", rule);
    c.keep = json_array();
    if (!c.keep)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    size_t start = out->len;
    char top[JS_NAME_MAX];
    int rc = js_compile(&c, root, "", top);
    if (rc == 0)
        rc = js_emit_rule(&c, rule, top);
    if (rc != 0 && out->data && !out->oom) {
        out->len = start; /* nothing half-written stays behind */
        out->data[start] = 0;
    }
    for (size_t i = 0; i < c.n_refs; i++)
        free(c.refs[i].ref);
    free(c.refs);
    js_merge_free(&c);
    js_dfa_memo_free(&c);
    json_decref(c.keep);
    return rc;
}

int tdm_json_schema_to_gbnf_rule(const char *json, size_t len, const char *rule, tdm_buf_t *out,
                                 tdm_error_t *err)
{
    if (!rule_name_ok(rule))
        return tdm_error_set(err, TDM_EINVALID, "rule name '%s' is not [a-zA-Z0-9-]+",
                             rule ? rule : "(null)");
    const size_t flags = JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL;
    json_error_t je;
    json_t *root = json_loadb(json, len, flags, &je), *bigints = NULL;
    if (!root && strstr(je.text, "too big")) { /* integers beyond 64 bits: read them as reals */
        tdm_buf_t t = TDM_BUF_INIT;
        bigints = json_array();
        if (!bigints || big_as_real(json, len, &t, bigints) != 0) {
            tdm_buf_free(&t);
            json_decref(bigints);
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        }
        root = json_loadb(t.data, t.len, flags, &je);
        tdm_buf_free(&t);
    }
    if (!root) {
        json_decref(bigints);
        return tdm_error_set(err, TDM_EINVALID, "invalid JSON at line %d, column %d: %s", je.line,
                             je.column, je.text);
    }
    int rc = compile_document(root, bigints, rule, out, err);
    json_decref(root);
    json_decref(bigints);
    return rc;
}

int tdm_json_schema_to_gbnf(const char *json, size_t len, tdm_buf_t *out, tdm_error_t *err)
{
    return tdm_json_schema_to_gbnf_rule(json, len, "root", out, err);
}

int tdm_json_object_gbnf(tdm_buf_t *out, tdm_error_t *err)
{
    return tdm_json_schema_to_gbnf("{\"type\":\"object\"}", 17, out, err);
}
