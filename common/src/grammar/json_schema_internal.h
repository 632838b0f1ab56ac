/* json_schema_internal.h - what the JSON Schema compiler's files (json_schema*.c) and the regex
 * translator (regex.c) share: the compile context, the GBNF text helpers and the per-concept
 * emitters. Not a public header.
 *
 * Every emitter appends whole rules (`name ::= body\n`) to ctx->out and returns the name of
 * the rule that matches the value it compiled, so rules can be emitted in any order while a
 * body is being built in a local buffer. Every generated name starts with ctx->prefix.
 */
#ifndef TANDEM_GRAMMAR_JSON_SCHEMA_INTERNAL_H
#define TANDEM_GRAMMAR_JSON_SCHEMA_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/grammar.h"

#define JS_NAME_MAX 96      /* longest rule name we generate, with the NUL */
#define JS_PREFIX_MAX 48    /* longest caller-given rule name */
#define JS_MAX_DEPTH 64     /* nesting of subschemas compiled inside one another */
#define JS_PTR_MAX 512      /* longest JSON pointer kept for messages */
#define JS_LEN_INF SIZE_MAX /* "no upper bound" for lengths and counts */
#define JS_REP_CHUNK 1000u  /* larger repetition counts are written as nested ones */
/* Largest minLength, maxLength, minItems or maxItems: nested once, a count is at most
 * TDM_GRAMMAR_MAX_REPEAT chunks of JS_REP_CHUNK (tandem/grammar.h). */
#define JS_COUNT_MAX (TDM_GRAMMAR_MAX_REPEAT * JS_REP_CHUNK)

/* The primitives every schema may use, emitted once each on first use. */
typedef enum js_prim {
    JS_PRIM_NONE,    /* no primitive (ends the dependency lists) */
    JS_PRIM_WS,      /* bounded optional whitespace between tokens */
    JS_PRIM_CHAR,    /* one character of a JSON string's content (plain or escaped) */
    JS_PRIM_STRING,  /* any JSON string */
    JS_PRIM_INTEGER, /* any JSON integer */
    JS_PRIM_NUMBER,  /* any JSON number */
    JS_PRIM_BOOLEAN,
    JS_PRIM_NULL,
    JS_PRIM_VALUE, /* any JSON value */
    JS_PRIM_OBJECT,
    JS_PRIM_ARRAY,
    JS_PRIM_COUNT
} js_prim_t;

typedef struct js_ref {
    char *ref;              /* the $ref text (NULL for a node entry) */
    const json_t *node;     /* or the schema node (allOf / anyOf / oneOf / $ref nodes) */
    char name[JS_NAME_MAX]; /* the rule compiled (or being compiled) for it */
} js_ref_t;

typedef struct js_ctx {
    json_t *root;     /* the whole schema document (for $ref) */
    tdm_buf_t *out;   /* the GBNF being built */
    tdm_error_t *err; /* first error */
    char prefix[JS_PREFIX_MAX];
    unsigned next_rule; /* counter for generated rule names */
    bool prim_done[JS_PRIM_COUNT];
    js_ref_t *refs; /* $ref targets compiled so far */
    size_t n_refs, cap_refs;
    json_t *keep;     /* array owning the schemas built by merging (allOf, siblings) */
    json_t *prop_pos; /* "%p" of a properties object -> {name: position in the document} (built
                       * on the first merge that needs it; NULL before) */
    json_t *bigints;  /* texts of the integers beyond 64 bits, read as reals (NULL: none) */
    int depth;
    bool unsat; /* the last refusal says no value is allowed (not: not supported) */
    struct js_dfa_memo *dfa_memo; /* automata built in this compile (regex_dfa.c; NULL: none) */
} js_ctx_t;

/* Frees the automata regex_dfa.c's js_dfa_get kept for this compile (c->dfa_memo). */
void js_dfa_memo_free(js_ctx_t *c);

/* ---- json_schema.c: dispatch ---- */

/* Compiles schema s (found at JSON pointer ptr) into a rule; its name goes to name[JS_NAME_MAX].
 * Returns 0 or a negative TDM_E code with ctx->err set. */
int js_compile(js_ctx_t *c, json_t *s, const char *ptr, char *name);
/* Sets name to the shared primitive rule p (emitting it on first use). */
int js_prim(js_ctx_t *c, js_prim_t p, char *name);
/* A fresh rule name. */
void js_new_name(js_ctx_t *c, char *name);
/* Appends x{lo,hi} (hi JS_LEN_INF: no bound) for the GBNF atom x (a name or a parenthesized
 * group), with counts over JS_REP_CHUNK nested so the engine's repetition limit never
 * applies. */
void js_rep(tdm_buf_t *b, const char *x, size_t lo, size_t hi);
/* Appends `name ::= body\n`. */
int js_emit_rule(js_ctx_t *c, const char *name, const char *body);
/* Sets ctx->err to TDM_EINVALID "<ptr>[/key]: what" and returns TDM_EINVALID. */
int js_fail(js_ctx_t *c, const char *ptr, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Like js_fail, for a schema that allows no value: sets c->unsat (an optional property
 * with such a schema is left out instead of failing the whole schema). */
int js_fail_unsat(js_ctx_t *c, const char *ptr, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Out of memory (also when b->oom). */
int js_oom(js_ctx_t *c);
/* A point of the compile to come back to: the grammar text, the memo entries and the
 * primitives emitted so far. */
typedef struct js_mark {
    size_t out_len, n_refs;
    bool prims[JS_PRIM_COUNT];
} js_mark_t;
void js_mark_set(const js_ctx_t *c, js_mark_t *m);
/* Forgets what was compiled since m, and the refusal (error and c->unsat). */
void js_mark_undo(js_ctx_t *c, const js_mark_t *m);
/* js_compile, except that a schema allowing no value sets *none (what it compiled and the
 * refusal forgotten) and returns 0 with name empty. */
int js_compile_or_none(js_ctx_t *c, json_t *s, const char *ptr, char *name, bool *none);
/* Follows a "#..." reference to its target in the document, or NULL (error set). */
json_t *js_resolve_ref(js_ctx_t *c, const char *ref, const char *ptr);
/* s with a top-level $ref replaced by its target merged with the sibling keywords (*out: s
 * itself when it has no $ref; merged schemas are owned by c->keep). */
int js_resolve_top(js_ctx_t *c, json_t *s, const char *ptr, json_t **out);
/* Appends "/key" with JSON pointer escaping (~0 ~1) to ptr into out[JS_PTR_MAX]. */
void js_ptr_join(char *out, const char *ptr, const char *key);
/* Like js_ptr_join with an array index. */
void js_ptr_index(char *out, const char *ptr, size_t i);

/* Whether key is a validation keyword (constrains values), not an annotation or unknown. */
bool js_keyword_constrains(const char *key);

/* ---- json_schema_object.c: objects and arrays ---- */

int js_object(js_ctx_t *c, json_t *s, const char *ptr, char *name);
int js_array(js_ctx_t *c, json_t *s, const char *ptr, char *name);

/* ---- json_schema_string.c: strings, formats, literal values ---- */

int js_string(js_ctx_t *c, json_t *s, const char *ptr, char *name);
/* Whether format value f names a custom format (an annotation, ignored), not one JSON Schema
 * defines. */
bool js_format_custom(json_t *f);
/* Appends the GBNF that matches exactly the JSON value v (compact, bounded whitespace inside
 * containers as elsewhere; strings and numbers as Python's json.dumps writes them). */
int js_literal(js_ctx_t *c, json_t *v, tdm_buf_t *body);
/* The JSON texts js_literal matches for the scalar v (string, number, boolean, null), written
 * into t[0] and t[1] (TDM_BUF_INIT on entry; the caller frees both): returns how many (two for
 * an integral number: "2" and "2.0"), 0 for an object or array, or TDM_ERESOURCE. */
int js_scalar_texts(json_t *v, tdm_buf_t t[2]);
/* Writes the JSON encoding of string s[n] (without quotes) as json.dumps(ensure_ascii=False)
 * does, then as a GBNF string literal (with quotes) into body. */
int js_json_string_literal(const char *s, size_t n, bool with_quotes, tdm_buf_t *body);

/* ---- json_schema_unique.c: uniqueItems ---- */

/* An array schema s with uniqueItems true and lo to hi items: its items must be from a finite
 * set of at most 10 scalar values (enum, const, boolean, null), else refused with the pointer. */
int js_array_unique(js_ctx_t *c, json_t *s, const char *ptr, size_t lo, size_t hi, char *name);

/* ---- json_schema_format.c: formats as regexes ---- */

/* Appends the anchored regex (regex.c's subset) of format name to out: every format JSON Schema
 * defines but idn-email, idn-hostname and regex. Returns 0, TDM_ENOTFOUND (no regex form), or
 * TDM_ERESOURCE. */
int js_format_regex(const char *name, tdm_buf_t *out);

/* ---- json_schema_enum.c: enum / const values ---- */

/* Appends a GBNF expression matching exactly the values vals[n] (as js_literal does): the
 * scalar ones as a trie of their texts, so a large enum does not start one parse stack per
 * value; objects and arrays as alternatives. Returns 0 or TDM_ERESOURCE (ctx->err set). */
int js_enum_expr(js_ctx_t *c, json_t *const *vals, size_t n, tdm_buf_t *body);

/* ---- json_schema_number.c: integers and numbers with bounds ---- */

int js_integer(js_ctx_t *c, json_t *s, const char *ptr, char *name);
int js_number(js_ctx_t *c, json_t *s, const char *ptr, char *name);

/* ---- json_schema_multiple.c: multipleOf ---- */

/* An integer or number schema s with multipleOf: the integer multiples of an integer k (up to
 * 1,000) within its bounds, or refused with the pointer (a decimal k, bounds it cannot meet). */
int js_multiple(js_ctx_t *c, json_t *s, const char *ptr, char *name);

/* ---- json_schema_depend.c: dependentRequired, dependencies ---- */

/* s with dependentRequired / array-valued dependencies expanded into the cases, schemas without
 * them: *out is the array of cases (at least one; owned by c->keep), or NULL when s has
 * neither keyword. Fails with the
 * pointer on a schema dependency, a trigger not in properties, or more than 4 triggers not
 * already required. */
int js_expand_dependent(js_ctx_t *c, json_t *s, const char *ptr, json_t **out);

/* ---- json_schema_merge.c: allOf and sibling keywords ---- */

/* Merges schemas a and b (already $ref-resolved at their top) into a new schema that allows
 * exactly the values both allow, or fails naming ptr. *out is owned by c->keep. */
int js_merge(js_ctx_t *c, json_t *a, json_t *b, const char *ptr, json_t **out);

/* Gives the properties object copy (kept alive by c->keep) the document positions of orig, the
 * object it was copied from, so merges order its names as orig's. Returns 0 or TDM_ERESOURCE. */
int js_merge_alias(js_ctx_t *c, json_t *copy, json_t *orig);

/* *t, the target of schema s's $ref, as if written where that $ref stands: a copy (owned by
 * c->keep) whose properties take the $ref's document position, in their order, so the merge
 * with the properties beside the $ref orders them as llguidance does. *t is left as it is
 * when it or s has no properties, s is not in the document, or the target merges schemas of
 * its own (anyOf, allOf, if, ...: those compare with the target's own positions). Returns 0
 * or TDM_ERESOURCE. */
int js_merge_at_ref(js_ctx_t *c, json_t *s, json_t **t);

/* Frees what the merges kept besides c->keep (the property positions). Cannot fail. */
void js_merge_free(js_ctx_t *c);

/* True when no JSON value can match both schemas (already $ref-resolved at their top), by
 * a cheap sufficient test: disjoint types, disjoint enum / const values, a property required
 * by both whose enum / const values are disjoint, or (objects the only type they share) a
 * property one requires and the other forbids. False means "maybe not". */
bool js_disjoint(json_t *a, json_t *b);

/* ---- json_schema_negate.c: complements, oneOf, if/then/else, not ---- */

/* Appends to the array out schemas whose union is exactly the values s (found at ptr) rejects
 * (none when s accepts everything); fails with the pointer of a keyword whose complement is not
 * written (pattern, format, items, additionalProperties, anyOf, ...). */
int js_negate(js_ctx_t *c, json_t *s, const char *ptr, json_t *out);
/* Compiles s (found at ptr) as one more alternative of body ("a | b"); an s that allows no
 * value adds nothing (what it compiled is forgotten). Returns 0 or an error. */
int js_union_add(js_ctx_t *c, json_t *s, const char *ptr, tdm_buf_t *body);
/* Emits `name ::= body`; an empty body (no alternative allows a value) is refused as allowing
 * no value, naming key. */
int js_union_emit(js_ctx_t *c, tdm_buf_t *body, const char *ptr, const char *key, char *name);
/* The union of base merged with each schema of the array cases (cases no value fits left
 * out; none left: refused as allowing no value, naming key). */
int js_compile_union(js_ctx_t *c, json_t *base, json_t *cases, const char *ptr, const char *key,
                     char *name);
/* base (s without `not`) minus the values `not`'s schema n allows: the union of base merged
 * with each case of n's complement (cases no value fits left out). */
int js_compile_negated(js_ctx_t *c, json_t *base, json_t *n, const char *ptr, char *name);
/* if / then / else of s over base (s without them): base and if and then, or base and a case
 * of if's complement and else. */
int js_compile_if(js_ctx_t *c, json_t *base, json_t *s, const char *ptr, char *name);
/* oneOf over branches (already merged with the siblings; originals: as written), exactly: each
 * branch merged with a case of the complement of every other branch it may overlap (the
 * complement of the branch as written: the siblings are in every branch already); at most 256
 * combinations. */
int js_compile_one_of(js_ctx_t *c, json_t *branches, json_t *originals, const char *ptr,
                      char *name);

/* ---- gbnf text helpers (regex.c) ---- */

/* Appends code point cp as it goes inside a GBNF string literal ("..."), escaped. */
int js_gbnf_lit_cp(tdm_buf_t *b, uint32_t cp);
/* Appends code point cp as it goes inside a GBNF character class [...], escaped. */
void js_gbnf_class_cp(tdm_buf_t *b, uint32_t cp);
/* Appends bytes s[n] (UTF-8) as a GBNF string literal with its quotes. */
int js_gbnf_lit(tdm_buf_t *b, const char *s, size_t n);

/* Translates the regex re[len] (the subset of docs/structured-output.md) to a GBNF expression
 * appended to expr. json_mode: the expression matches the JSON-escaped content of a string
 * whose decoded text matches (search semantics: an unanchored side gets any text, char_rule
 * repeated); otherwise it matches the text itself, whole (anchors optional). In JSON mode,
 * length bounds [want_lo, want_hi] (minLength / maxLength; 0, JS_LEN_INF for none) are built
 * into the expression when that is exact (an anchored sequence with one repeated character
 * class); the caller compares them with the result. *min_len / *max_len get the bounds of
 * the length of matched text in characters (JS_LEN_INF: unbounded). Returns 0 or TDM_EINVALID
 * with "what (at offset N)" in err, TDM_ERESOURCE on out of memory. */
int js_regex_expr(const char *re, size_t len, bool json_mode, const char *char_rule, size_t want_lo,
                  size_t want_hi, tdm_buf_t *expr, size_t *min_len, size_t *max_len,
                  tdm_error_t *err);

#endif /* TANDEM_GRAMMAR_JSON_SCHEMA_INTERNAL_H */
