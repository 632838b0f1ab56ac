/* grammar.h - grammar-constrained decoding: GBNF grammars, a per-sequence matcher, and the
 * token mask (which vocabulary tokens keep the output inside the grammar) computed over a
 * trie of the vocabulary's byte strings.
 *
 * Text form: llama.cpp's GBNF (grammars/README.md in llama.cpp): rules `name ::= alternatives`,
 * `|`, grouping `( )`, `* + ?`, `{m}`, `{m,}`, `{m,n}`, string literals with escapes
 * (\n \t \r \\ \" \xHH \uHHHH \UHHHHHHHH), character classes `[a-z]`, negated `[^"\\]`, any
 * character `.`, comments `# ...` to end of line. Grammars match UTF-8 text: literals and
 * classes are code points; a token whose bytes end inside a code point is accepted when the
 * bytes so far are a valid prefix of an allowed code point.
 *
 * Checks at compile time: undefined rules, left recursion (refused: `a ::= a "x" | "y"`;
 * tail-position cycles such as `(x?)*` are fine), a start rule with no finite string
 * (refused), repetition counts up to TDM_GRAMMAR_MAX_REPEAT and an expansion of at most
 * TDM_GRAMMAR_MAX_ELEMENTS elements. Rule names are [a-zA-Z0-9-]+; rules generated for
 * groups and repetitions are named "<rule>_<n>" in messages.
 *
 * How the mask is made (common/src/grammar/): the grammar is a flat element array
 * (llama.cpp's layout); a matcher's state is a set of hash-consed parse stacks, itself
 * hash-consed, so the matcher is a DFA over bytes built lazily; the mask walks the trie
 * depth first, one memoised transition per trie node, skipping dead subtrees and allowing
 * whole subtrees that stay inside a string or a counted repetition; the finished mask is
 * cached per state. Measured on SmolLM2's 49,152 tokens (AMD EPYC, one thread): p50 under
 * 1 us (cache hits), p99 0.1-0.2 ms over JSON and JSON-schema grammars.
 *
 * Ownership and threads: a tdm_grammar_t and a tdm_grammar_vocab_t are immutable after
 * creation and may be shared by any number of threads and matchers; a tdm_grammar_matcher_t
 * belongs to one sequence and one thread at a time.
 */
#ifndef TANDEM_GRAMMAR_H
#define TANDEM_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_GRAMMAR_MAX_TEXT_BYTES (1u << 20) /* longest GBNF text accepted (1 MiB) */
/* Limits of the compiled form (the parser refuses what would exceed them; the regex and JSON
 * Schema compilers check their own counts against them first, so that a refusal names the
 * user's quantifier or keyword, never a generated rule). */
#define TDM_GRAMMAR_MAX_REPEAT 10000u       /* largest m or n in x{m,n} */
#define TDM_GRAMMAR_MAX_ELEMENTS (1u << 22) /* elements after expanding repetitions */
/* Ambiguity bound: a matcher state holds at most this many parse stacks. A continuation that
 * would need more is refused (treated as leaving the grammar) and errmsg says why; memory
 * stays bounded whatever the grammar. Unambiguous grammars (JSON, schemas) use a handful. */
#define TDM_GRAMMAR_MAX_STACKS 1024u

typedef struct tdm_grammar tdm_grammar_t;
typedef struct tdm_grammar_vocab tdm_grammar_vocab_t;
typedef struct tdm_grammar_matcher tdm_grammar_matcher_t;

/* Parses and compiles len bytes of GBNF text; the start rule is `root` (or the rule named
 * root_rule when not NULL). Returns NULL with *err set: TDM_EINVALID with "line L, column C
 * (rule R): what" for a syntax error, an undefined rule, a repetition bound out of range, a
 * grammar over TDM_GRAMMAR_MAX_TEXT_BYTES, or a start rule with no finite accepting string;
 * TDM_ERESOURCE on out of memory. Free with tdm_grammar_destroy. */
tdm_grammar_t *tdm_grammar_parse(const char *text, size_t len, const char *root_rule,
                                 tdm_error_t *err);
void tdm_grammar_destroy(tdm_grammar_t **self_p); /* accepts NULL; sets *self_p to NULL */

/* Bytes the compiled grammar holds (for caches bounded in bytes). */
size_t tdm_grammar_size_bytes(const tdm_grammar_t *g);
/* Rules of the compiled grammar, those generated for groups and repetitions included. */
uint32_t tdm_grammar_n_rules(const tdm_grammar_t *g);

/* Limits of tdm_grammar_check, all in work units (bytes, rules, states, steps), never time. */
typedef struct tdm_grammar_limits {
    size_t max_bytes;    /* compiled size (tdm_grammar_size_bytes); default 64 MiB */
    uint32_t max_rules;  /* rules, generated ones included; default 200,000 */
    uint32_t max_states; /* parse states explored from the start; default 4,096 */
    uint32_t max_steps;  /* byte steps explored (256 per state); default 1 Mi */
} tdm_grammar_limits_t;

/* Fills *lim with the defaults above. Cannot fail. */
void tdm_grammar_limits_default(tdm_grammar_limits_t *lim);

/* The check a router runs before admitting a request with grammar g (lim NULL: the defaults):
 * its compiled size and rules against the limits, then its byte automaton explored breadth
 * first from the start (each state's 256 successors) for up to max_states states and
 * max_steps steps, looking for a prefix whose parse state needs more than
 * TDM_GRAMMAR_MAX_STACKS stacks (the matcher would refuse a continuation of it). The verdict
 * depends only on g and lim: the same on every machine and run. Returns 0; TDM_EINVALID with
 * err->field "grammar.size", "grammar.rules" or "grammar.stacks" and the numbers in the
 * message; TDM_ERESOURCE on out of memory. A grammar that passes can still meet the stack bound
 * past the explored prefixes (see TDM_GRAMMAR_MAX_STACKS). Takes no reference to g. */
int tdm_grammar_check(const tdm_grammar_t *g, const tdm_grammar_limits_t *lim, tdm_error_t *err);

/* The vocabulary as the mask sees it: each token's decoded bytes
 * (tdm_tokenizer_token_bytes, render_special false) in a trie; control and unused tokens
 * are never allowed by a mask, except the end-of-generation tokens (tdm_tokenizer_is_eog),
 * which are allowed exactly when the grammar accepts. Returns NULL with *err set on out of
 * memory. Free with tdm_grammar_vocab_destroy. */
tdm_grammar_vocab_t *tdm_grammar_vocab_new(const tdm_tokenizer_t *tok, tdm_error_t *err);
void tdm_grammar_vocab_destroy(tdm_grammar_vocab_t **self_p);
uint32_t tdm_grammar_vocab_n_vocab(const tdm_grammar_vocab_t *v);

/* A matcher: the state of one sequence in grammar g, over vocabulary v (both must outlive
 * it; v may be NULL for a matcher fed only bytes: it then has no tokens and an empty mask).
 * Starts at the beginning of the start rule. Returns NULL with *err set: TDM_ERESOURCE on
 * out of memory, TDM_EINVALID when the start alone needs more than TDM_GRAMMAR_MAX_STACKS
 * stacks. Memory: the matcher's tables grow with the states it meets and are rebuilt around
 * the current state past a bound (a few MiB at most in practice; see grammar_internal.h);
 * up to TDM_GRAMMAR_MASK_CACHE (32) masks of (n_vocab + 31) / 32 words are cached. */
tdm_grammar_matcher_t *tdm_grammar_matcher_new(const tdm_grammar_t *g, const tdm_grammar_vocab_t *v,
                                               tdm_error_t *err);
void tdm_grammar_matcher_destroy(tdm_grammar_matcher_t **self_p);
void tdm_grammar_matcher_reset(tdm_grammar_matcher_t *m); /* back to the start */

/* Puts dst in src's state (both of the same grammar and vocabulary): for trying tokens and
 * rolling back. Returns 0, TDM_EINVALID for matchers of different grammars or vocabularies,
 * or TDM_ERESOURCE on out of memory (dst is then unchanged). */
int tdm_grammar_matcher_copy(tdm_grammar_matcher_t *dst, const tdm_grammar_matcher_t *src);
/* A new matcher in m's state. Returns NULL with *err set on out of memory; free with
 * tdm_grammar_matcher_destroy. */
tdm_grammar_matcher_t *tdm_grammar_matcher_clone(const tdm_grammar_matcher_t *m, tdm_error_t *err);

/* Advances over n bytes of output. Returns true, or false (state unchanged) when the bytes
 * leave the grammar (or, rarely, when a bound of the matcher was hit: errmsg then says so;
 * see TDM_GRAMMAR_MAX_STACKS). */
bool tdm_grammar_matcher_accept_bytes(tdm_grammar_matcher_t *m, const char *bytes, size_t n);

/* Advances over one token: its bytes, or, for an end-of-generation token, the end of the
 * output. Returns 0, or TDM_EINVALID (state unchanged) when the mask would not allow it
 * (message in tdm_grammar_matcher_errmsg). */
int tdm_grammar_matcher_accept_token(tdm_grammar_matcher_t *m, int32_t token);

/* True when the output so far is a complete string of the grammar (EOS allowed). */
bool tdm_grammar_matcher_is_accepting(const tdm_grammar_matcher_t *m);
/* True when the output is complete and no further byte is allowed (generation must end). */
bool tdm_grammar_matcher_is_done(const tdm_grammar_matcher_t *m);

/* Writes the allowed-token mask for the next token: bit (t % 32) of mask[t / 32] is set when
 * token t is allowed; mask has (n_vocab + 31) / 32 words. Control, unknown and unused tokens
 * never pass; end-of-generation tokens pass exactly when is_accepting. A matcher without a
 * vocabulary, or after an end-of-generation token, gets an empty mask. Cost: a memcpy when
 * this state's mask is cached, else one walk of the vocabulary trie (tens to a few hundred
 * us for 49,152 tokens). Allocates only while its bounded tables and cache warm up. Returns
 * the number of allowed tokens (0 only when the grammar cannot continue, which a matcher fed
 * only allowed tokens never reaches, or past TDM_GRAMMAR_MAX_STACKS: see errmsg). */
uint32_t tdm_grammar_matcher_fill_mask(tdm_grammar_matcher_t *m, uint32_t *mask);

/* The last refusal or bound hit, in words ("" when none); owned by the matcher, valid until
 * its next call. */
const char *tdm_grammar_matcher_errmsg(const tdm_grammar_matcher_t *m);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_GRAMMAR_H */
