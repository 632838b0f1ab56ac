/* constraint.h - a request's structured-output constraint on its way through the cluster:
 * the one compiler from what a client gives (JSON Schema, json_object, GBNF, regex, choice) to
 * the canonical GBNF text and its hash that travel to the nodes, and the nodes' cache of
 * compiled grammars by that hash (LRU, bounded in bytes).
 *
 * The router compiles a request's constraint once, at intake (errors come back before anything
 * is scheduled); `tandem generate -m` calls the same function, so a single process and the
 * cluster constrain with the same grammar text. Nodes see only GBNF (Constraint.kind GRAMMAR)
 * and compile it with tdm_grammar_parse through their cache (docs/architecture.md, "Structured
 * output").
 *
 * Threads: a cache belongs to one thread (a node's engine thread).
 */
#ifndef TANDEM_CONSTRAINT_H
#define TANDEM_CONSTRAINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/grammar.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a constraint's source text is (the values of the proto's ConstraintKind and of
 * tdm_client_constraint_t). */
typedef enum tdm_constraint_kind {
    TDM_CONSTRAINT_NONE = 0,
    TDM_CONSTRAINT_JSON_SCHEMA = 1, /* a JSON Schema (tandem/json_schema.h) */
    TDM_CONSTRAINT_JSON_OBJECT = 2, /* any JSON object; no text */
    TDM_CONSTRAINT_GRAMMAR = 3,     /* GBNF, start rule `root`, used as given */
    TDM_CONSTRAINT_REGEX = 4,  /* a regex in the documented subset (docs/structured-output.md) */
    TDM_CONSTRAINT_CHOICE = 5, /* a JSON array of strings: the output is one of them */
} tdm_constraint_kind_t;

#define TDM_CONSTRAINT_MAX_CHOICES 4096u /* strings of a CHOICE constraint at most */

/* The default of nodes[].grammar_cache_bytes: compiled grammars a node keeps (64 MiB). */
#define TDM_GRAMMAR_CACHE_DEFAULT_BYTES (64u << 20)

/* The name of a kind ("json_schema", "json_object", "grammar", "regex", "choice", "none");
 * "?" for a value outside the enum. Cannot fail. */
const char *tdm_constraint_kind_name(int kind);

/* Parse states from the start that tdm_constraint_compile's admission check explores
 * (tdm_grammar_check; 256 of each state's byte successors each): enough to find a grammar that
 * is too ambiguous from its first bytes (a regex of thousands of overlapping alternatives, a
 * long chain of rules), at about 1 ms a schema on average (maskbench-dev: 0.32 ms without the
 * check, 1.0 ms with 256 states, 10.6 ms with tdm_grammar_check's default 4,096). */
#define TDM_CONSTRAINT_CHECK_STATES 256u

/* Compiles the constraint (kind, text[len]; text unused for JSON_OBJECT) to canonical GBNF in
 * *gbnf (appended, start rule `root`) and checks it with tdm_grammar_parse, so a grammar that
 * does not parse or has no finite accepting string is refused here, then with
 * tdm_grammar_check over TDM_CONSTRAINT_CHECK_STATES states, so one too large or too
 * ambiguous for the matcher is refused here too ("regex: grammar.stacks: ..."); *hash is
 * tdm_constraint_hash of the text. Returns 0; TDM_EINVALID with the compiler's message
 * ("/properties/a/patternProperties: not supported", "line 2, column 5 (rule root): ...",
 * "choice: must be a non-empty JSON array of strings"), for kind NONE or one outside the enum,
 * or when the GBNF would exceed TDM_GRAMMAR_MAX_TEXT_BYTES; TDM_ERESOURCE on out of memory.
 * On error *gbnf holds what was appended so far (the caller frees it either way). */
int tdm_constraint_compile(int kind, const char *text, size_t len, tdm_buf_t *gbnf, uint64_t *hash,
                           tdm_error_t *err);

/* XXH3-64 of the GBNF text: the key by which nodes cache compiled grammars. Cannot fail. */
uint64_t tdm_constraint_hash(const char *gbnf, size_t len);

/* ---- the node's cache of compiled grammars ---- */

typedef struct tdm_grammar_cache tdm_grammar_cache_t;

/* A cache that keeps compiled grammars of at most max_bytes (tdm_grammar_size_bytes plus the
 * text) that no sequence holds; grammars in use are never evicted, so the bound may be passed
 * while they run. Returns NULL with *err (TDM_ERESOURCE) on out of memory. Free with
 * tdm_grammar_cache_destroy once no grammar it handed out is held. */
tdm_grammar_cache_t *tdm_grammar_cache_new(size_t max_bytes, tdm_error_t *err);
void tdm_grammar_cache_destroy(tdm_grammar_cache_t **self_p); /* NULL-safe; nulls *self_p */

/* The compiled grammar of gbnf[len] whose hash the router sent, held for the caller until
 * tdm_grammar_cache_release: found by hash and compared by text (two texts with one hash: the
 * newer one is compiled alone, uncached, and a collision is counted), or compiled now and
 * cached. Returns 0 with *g set; TDM_EINVALID when hash is not tdm_constraint_hash of the text
 * (a sender's bug: refused, never cached under the wrong key) or for a grammar
 * tdm_grammar_parse refuses (its message); TDM_ERESOURCE on out of memory. */
int tdm_grammar_cache_get(tdm_grammar_cache_t *c, const char *gbnf, size_t len, uint64_t hash,
                          const tdm_grammar_t **g, tdm_error_t *err);

/* Gives back a grammar tdm_grammar_cache_get handed out (NULL: nothing). An uncached one is
 * freed; a cached one may be evicted once nobody holds it. */
void tdm_grammar_cache_release(tdm_grammar_cache_t *c, const tdm_grammar_t *g);

/* What the cache holds and did. */
typedef struct tdm_grammar_cache_stats {
    size_t bytes;        /* cached grammars' bytes (held ones included) */
    uint32_t entries;    /* grammars cached */
    uint64_t hits;       /* gets answered from the cache */
    uint64_t misses;     /* gets that compiled */
    uint64_t evictions;  /* grammars dropped for room */
    uint64_t collisions; /* gets whose hash named another cached text */
} tdm_grammar_cache_stats_t;

void tdm_grammar_cache_stats(const tdm_grammar_cache_t *c, tdm_grammar_cache_stats_t *out);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_CONSTRAINT_H */
