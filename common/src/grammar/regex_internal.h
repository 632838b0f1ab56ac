/* regex_internal.h - what the two regex translators share: code point sets, the regex
 * reader (regex.c) and the automaton (regex_dfa.c) that patternProperties' keys and length
 * bounds beside a pattern are built from. Not a public header.
 */
#ifndef TANDEM_GRAMMAR_REGEX_INTERNAL_H
#define TANDEM_GRAMMAR_REGEX_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "json_schema_internal.h"
#include "tandem/base.h"

#define CPSET_MAX 512 /* ranges in one character class */
#define CP_MAX 0x10FFFFu
#define RX_MAX_DEPTH 64

/* A set of code points as ranges (sorted and merged once normalized). */
typedef struct cpset {
    size_t n;
    uint32_t lo[CPSET_MAX], hi[CPSET_MAX];
} cpset_t;

/* The reader's position in a regex. */
typedef struct rx {
    const char *s;
    size_t n, i;
    bool json;
    const char *char_rule; /* any string character (JSON mode's unanchored sides) */
    tdm_error_t *err;
    int depth;
    size_t want_lo, want_hi; /* JSON mode: the length bounds to build in (minLength ...) */
} rx_t;

/* Adds [lo, hi]; false when the set already has CPSET_MAX ranges. */
bool js_cpset_add(cpset_t *s, uint32_t lo, uint32_t hi);
/* Sorts and merges overlapping or touching ranges. */
void js_cpset_normalize(cpset_t *s);
/* Copies the n ranges of src into dst (not the unused rest of the arrays). */
void js_cpset_copy(cpset_t *dst, const cpset_t *src);
/* Complement within [0, CP_MAX] of a normalized set. */
void js_cpset_negate(cpset_t *s);
bool js_cpset_has(const cpset_t *s, uint32_t cp);
/* Removes [lo, hi] from a normalized set. */
void js_cpset_remove(cpset_t *s, uint32_t lo, uint32_t hi);
/* The set's characters as GBNF that matches them inside a JSON string (json.dumps form). */
void js_cpset_emit_json(tdm_buf_t *b, const cpset_t *s);

static inline bool js_rx_eof(const rx_t *r)
{
    return r->i >= r->n;
}

static inline uint32_t js_rx_peek(const rx_t *r)
{
    return js_rx_eof(r) ? 0 : (unsigned char)r->s[r->i];
}

/* Sets r->err to "what (at offset N)" and returns TDM_EINVALID. */
int js_rx_fail(rx_t *r, const char *what);

/* Reads a group's kind prefix after '(' ("?:", a named group "?<name>" / "?P<name>"; other
 * kinds refused) and enters it (r->depth, at most RX_MAX_DEPTH): the rule both regex compilers
 * (regex.c to GBNF, regex_dfa.c to an automaton) share. 0, or js_rx_fail's code. */
int js_rx_group_open(rx_t *r);
/* Reads one UTF-8 character (a byte that is not UTF-8 is refused). */
int js_rx_char(rx_t *r, uint32_t *cp);
/* After a backslash: one character (*cp) or a class added to *s (*is_class). */
int js_rx_escape(rx_t *r, bool in_class, uint32_t *cp, cpset_t *s, bool *is_class);
/* After '[': the class up to its ']', normalized, into s. */
int js_rx_class(rx_t *r, cpset_t *s);
/* Up to 6 decimal digits into *v; false when there is none. */
bool js_rx_number(rx_t *r, size_t *v);

/* ---- regex_dfa.c: regexes as deterministic automata over code points ---- */

#define JS_DFA_MAX_PATTERNS 30 /* patterns in one automaton (tag bits, one more for names) */

typedef struct js_dfa js_dfa_t;

/* Builds the deterministic automaton of n_pats regexes (the subset of regex.c, with JSON
 * Schema's search semantics: an unanchored side admits any text) and of the literal strings
 * names[n_names] (UTF-8), read together: the tag of the state reached by a text has bit i set
 * when the text matches pats[i], and bit n_pats when it is one of the names. The automaton is
 * complete: every text reaches a state. Returns 0 with *out (free with js_dfa_free);
 * TDM_EINVALID with *bad the index of the pattern refused and "what (at offset N)" in err, or
 * "automaton too large" when the subset construction passes its bound (*bad n_pats then);
 * TDM_ERESOURCE on out of memory. */
int js_dfa_new(const char *const *pats, size_t n_pats, const char *const *names, size_t n_names,
               js_dfa_t **out, size_t *bad, tdm_error_t *err);
void js_dfa_free(js_dfa_t **d); /* accepts NULL; nulls *d */
/* js_dfa_new through the compile's memo (c->dfa_memo): the automaton of the same patterns and
 * names, in the same order, is built once per compile and kept until it ends (up to
 * JS_DFA_MEMO_BYTES of transitions and JS_DFA_MEMO_MAX automata; past that, built for the
 * caller alone). Same returns; give *out back with js_dfa_release. */
int js_dfa_get(js_ctx_t *c, const char *const *pats, size_t n_pats, const char *const *names,
               size_t n_names, js_dfa_t **out, size_t *bad, tdm_error_t *err);
/* Frees *d unless the memo keeps it; nulls *d (accepts NULL). */
void js_dfa_release(js_ctx_t *c, js_dfa_t **d);
/* js_dfa_memo_free (json_schema_internal.h) frees the memo at the end of the compile. */
/* The tag of the state the UTF-8 text s[n] leads to. Cannot fail. */
uint32_t js_dfa_tag(const js_dfa_t *d, const char *s, size_t n);
/* The distinct tags of the states reachable from the start, into tags[cap]; returns how many
 * there are (more than cap: only cap written). Cannot fail. */
size_t js_dfa_tags(const js_dfa_t *d, uint32_t *tags, size_t cap);
/* Emits the rules that match the content of a JSON string (between the quotes, json.dumps's
 * escapes) whose decoded text leads to a state tagged exactly want and is lo to hi characters
 * long (hi JS_LEN_INF: no bound): the automaton times a length counter. name gets the start
 * rule, or "" when no text qualifies. Returns 0, TDM_EINVALID (c->err: "automaton too large")
 * past the bound on states, or TDM_ERESOURCE. */
int js_dfa_emit(js_ctx_t *c, const js_dfa_t *d, uint32_t want, size_t lo, size_t hi, char *name);

#endif /* TANDEM_GRAMMAR_REGEX_INTERNAL_H */
