/* constraint.c - the constraint compiler (client source -> canonical GBNF + hash) and the
 * nodes' LRU cache of compiled grammars (see tandem/constraint.h).
 *
 * The cache is a list, most recently used first; lookups scan it (a node holds tens of
 * grammars, each compiled once per text, so a scan costs nothing next to a forward pass).
 * Entries carry a count of holders: only unheld entries are evicted, least recently used first.
 */
#include "tandem/constraint.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tandem/json_schema.h"
#include "tandem/list.h"

/* ---- compiling ---- */

const char *tdm_constraint_kind_name(int kind)
{
    switch (kind) {
    case TDM_CONSTRAINT_NONE: return "none";
    case TDM_CONSTRAINT_JSON_SCHEMA: return "json_schema";
    case TDM_CONSTRAINT_JSON_OBJECT: return "json_object";
    case TDM_CONSTRAINT_GRAMMAR: return "grammar";
    case TDM_CONSTRAINT_REGEX: return "regex";
    case TDM_CONSTRAINT_CHOICE: return "choice";
    }
    return "?";
}

uint64_t tdm_constraint_hash(const char *gbnf, size_t len)
{
    return XXH3_64bits(gbnf, len);
}

/* CHOICE: text is a JSON array of strings (1..TDM_CONSTRAINT_MAX_CHOICES of them, no NUL
 * inside); the output is exactly one of them (tdm_choice_to_gbnf). */
static int choice_to_gbnf(const char *text, size_t len, tdm_buf_t *out, tdm_error_t *err)
{
    json_error_t jerr;
    json_t *a = json_loadb(text, len, 0, &jerr);
    size_t n = json_is_array(a) ? json_array_size(a) : 0;
    const char **choices = n && n <= TDM_CONSTRAINT_MAX_CHOICES ? calloc(n, sizeof *choices) : NULL;
    int rc = TDM_OK;
    if (!a)
        rc = tdm_error_set(err, TDM_EINVALID, "choice: not JSON: %s (line %d, column %d)",
                           jerr.text, jerr.line, jerr.column);
    else if (n == 0 || n > TDM_CONSTRAINT_MAX_CHOICES)
        rc = tdm_error_set(err, TDM_EINVALID, "choice: must be a JSON array of 1..%u strings",
                           TDM_CONSTRAINT_MAX_CHOICES);
    else if (!choices)
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; rc == TDM_OK && i < n; i++) {
        json_t *v = json_array_get(a, i);
        choices[i] = json_string_value(v);
        if (!choices[i] || strlen(choices[i]) != json_string_length(v))
            rc = tdm_error_set(err, TDM_EINVALID, "choice[%zu]: must be a string without NUL", i);
    }
    if (rc == TDM_OK)
        rc = tdm_choice_to_gbnf(choices, n, out, err);
    free(choices);
    json_decref(a);
    return rc;
}

/* The kind's compiler: source -> GBNF appended to *out. */
static int to_gbnf(int kind, const char *text, size_t len, tdm_buf_t *out, tdm_error_t *err)
{
    switch (kind) {
    case TDM_CONSTRAINT_JSON_SCHEMA: return tdm_json_schema_to_gbnf(text, len, out, err);
    case TDM_CONSTRAINT_JSON_OBJECT: return tdm_json_object_gbnf(out, err);
    case TDM_CONSTRAINT_REGEX: return tdm_regex_to_gbnf_rule(text, len, "root", out, err);
    case TDM_CONSTRAINT_CHOICE: return choice_to_gbnf(text, len, out, err);
    case TDM_CONSTRAINT_GRAMMAR:
        if (tdm_buf_append(out, text, len) != TDM_OK)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return TDM_OK;
    }
    return tdm_error_set(err, TDM_EINVALID,
                         "kind %d is not a constraint (json_schema, "
                         "json_object, grammar, regex or choice)",
                         kind);
}

int tdm_constraint_compile(int kind, const char *text, size_t len, tdm_buf_t *gbnf, uint64_t *hash,
                           tdm_error_t *err)
{
    if (kind != TDM_CONSTRAINT_JSON_OBJECT && !text)
        return tdm_error_set(err, TDM_EINVALID, "%s: the constraint has no text",
                             tdm_constraint_kind_name(kind));
    size_t start = gbnf->len;
    int rc = to_gbnf(kind, text, len, gbnf, err);
    if (rc != TDM_OK)
        return rc;
    if (gbnf->oom)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    const char *g = gbnf->data + start;
    size_t n = gbnf->len - start;
    if (n > TDM_GRAMMAR_MAX_TEXT_BYTES)
        return tdm_error_set(err, TDM_EINVALID,
                             "%s: the grammar it compiles to is %zu bytes, at most %u allowed",
                             tdm_constraint_kind_name(kind), n, TDM_GRAMMAR_MAX_TEXT_BYTES);
    tdm_grammar_t *parsed = tdm_grammar_parse(g, n, NULL, err);
    if (!parsed)
        return err ? err->code : TDM_EINVALID;
    /* the admission check (work units, never time): a grammar too big or too ambiguous for the
     * matcher is the client's error here, not a node's failure later */
    tdm_grammar_limits_t lim;
    tdm_grammar_limits_default(&lim);
    lim.max_states = TDM_CONSTRAINT_CHECK_STATES;
    lim.max_steps = TDM_CONSTRAINT_CHECK_STATES * 256u;
    rc = tdm_grammar_check(parsed, &lim, err);
    tdm_grammar_destroy(&parsed);
    if (rc == TDM_EINVALID)
        return tdm_error_prefix(err, rc, "%s: ", tdm_constraint_kind_name(kind));
    if (rc != TDM_OK)
        return rc;
    *hash = tdm_constraint_hash(g, n);
    return TDM_OK;
}

/* ---- the cache ---- */

typedef struct centry {
    tdm_list_t link; /* on the cache's lru list, most recent first */
    uint64_t hash;
    char *text; /* [len] the GBNF the grammar was compiled from */
    size_t len;
    tdm_grammar_t *g;
    size_t bytes;     /* tdm_grammar_size_bytes + len */
    uint32_t holders; /* gets not yet released */
} centry_t;

struct tdm_grammar_cache {
    size_t max_bytes;
    tdm_list_t lru;
    tdm_grammar_cache_stats_t st;
};

tdm_grammar_cache_t *tdm_grammar_cache_new(size_t max_bytes, tdm_error_t *err)
{
    tdm_grammar_cache_t *c = calloc(1, sizeof *c);
    if (!c) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    c->max_bytes = max_bytes;
    tdm_list_init(&c->lru);
    return c;
}

static void entry_free(tdm_grammar_cache_t *c, centry_t *e)
{
    tdm_list_remove(&e->link);
    c->st.bytes -= e->bytes;
    c->st.entries--;
    tdm_grammar_destroy(&e->g);
    free(e->text);
    free(e);
}

void tdm_grammar_cache_destroy(tdm_grammar_cache_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_grammar_cache_t *c = *self_p;
    tdm_list_t *pos, *tmp;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &c->lru)
    entry_free(c, TDM_LIST_ENTRY(pos, centry_t, link));
    free(c);
    *self_p = NULL;
}

/* Evicts unheld entries, least recently used first, until `more` bytes fit the bound (or
 * nothing unheld is left). */
static void make_room(tdm_grammar_cache_t *c, size_t more)
{
    tdm_list_t *pos = c->lru.prev;
    while (pos != &c->lru && c->st.bytes + more > c->max_bytes) {
        centry_t *e = TDM_LIST_ENTRY(pos, centry_t, link);
        pos = pos->prev;
        if (e->holders == 0) {
            entry_free(c, e);
            c->st.evictions++;
        }
    }
}

/* The entry with this hash, or NULL. */
static centry_t *find_hash(const tdm_grammar_cache_t *c, uint64_t hash)
{
    for (tdm_list_t *p = c->lru.next; p != &c->lru; p = p->next) {
        centry_t *e = TDM_LIST_ENTRY(p, centry_t, link);
        if (e->hash == hash)
            return e;
    }
    return NULL;
}

/* Compiles gbnf into a new cached entry (held once). */
static int entry_add(tdm_grammar_cache_t *c, const char *gbnf, size_t len, uint64_t hash,
                     const tdm_grammar_t **g, tdm_error_t *err)
{
    centry_t *e = calloc(1, sizeof *e);
    char *text = malloc(len ? len : 1);
    if (!e || !text) {
        free(e);
        free(text);
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    e->g = tdm_grammar_parse(gbnf, len, NULL, err);
    if (!e->g) {
        free(e);
        free(text);
        return err ? err->code : TDM_EINVALID;
    }
    memcpy(text, gbnf, len);
    e->text = text;
    e->len = len;
    e->hash = hash;
    e->bytes = tdm_grammar_size_bytes(e->g) + len;
    e->holders = 1;
    make_room(c, e->bytes);
    tdm_list_push_front(&c->lru, &e->link);
    c->st.bytes += e->bytes;
    c->st.entries++;
    *g = e->g;
    return TDM_OK;
}

int tdm_grammar_cache_get(tdm_grammar_cache_t *c, const char *gbnf, size_t len, uint64_t hash,
                          const tdm_grammar_t **g, tdm_error_t *err)
{
    *g = NULL;
    if (tdm_constraint_hash(gbnf, len) != hash)
        return tdm_error_set(err, TDM_EINVALID,
                             "constraint: the hash sent does not match the grammar text");
    centry_t *e = find_hash(c, hash);
    if (e && e->len == len && memcmp(e->text, gbnf, len) == 0) {
        e->holders++;
        tdm_list_remove(&e->link);
        tdm_list_push_front(&c->lru, &e->link);
        c->st.hits++;
        *g = e->g;
        return TDM_OK;
    }
    c->st.misses++;
    if (!e)
        return entry_add(c, gbnf, len, hash, g, err);
    /* Two texts with one 64-bit hash: the newcomer runs uncached (freed on release). */
    c->st.collisions++;
    tdm_grammar_t *own = tdm_grammar_parse(gbnf, len, NULL, err);
    if (!own)
        return err ? err->code : TDM_EINVALID;
    *g = own;
    return TDM_OK;
}

void tdm_grammar_cache_release(tdm_grammar_cache_t *c, const tdm_grammar_t *g)
{
    if (!g)
        return;
    for (tdm_list_t *p = c->lru.next; p != &c->lru; p = p->next) {
        centry_t *e = TDM_LIST_ENTRY(p, centry_t, link);
        if (e->g == g) {
            TDM_ASSERT(e->holders > 0);
            if (--e->holders == 0)
                make_room(c, 0);
            return;
        }
    }
    tdm_grammar_t *own = (tdm_grammar_t *)(uintptr_t)g; /* uncached: ours to free */
    tdm_grammar_destroy(&own);
}

void tdm_grammar_cache_stats(const tdm_grammar_cache_t *c, tdm_grammar_cache_stats_t *out)
{
    *out = c->st;
}
