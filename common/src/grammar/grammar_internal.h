/* grammar_internal.h - the compiled grammar and the matcher's state space, shared by the files
 * of common/src/grammar/ (not part of the public interface).
 *
 * Compiled form (llama.cpp's flat layout): every rule is a run of elements in one array, its
 * alternatives separated by GRAM_ALT and the last one ended by GRAM_END. An element is a
 * character class (a sorted list of code point ranges; a literal character is a class of one)
 * or a reference to a rule. Repetition and groups were rewritten into generated rules by the
 * parser, so the matcher only ever sees classes, references and alternative ends.
 *
 * Matcher state: a set of parse stacks. A stack is a persistent list of element positions
 * (its top is the next element to match, always a class once expanded); stacks are
 * hash-consed nodes (pos, parent) so that stacks share tails and a stack is one 32-bit id.
 * A set of stacks plus a partial UTF-8 character is a "state", also hash-consed: a state id
 * names it, transitions (state, byte) -> state are memoised, and masks are cached per state.
 * So the automaton is a lazily built DFA over bytes, bounded in size (grammar_state.c).
 */
#ifndef TANDEM_GRAMMAR_INTERNAL_H
#define TANDEM_GRAMMAR_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/grammar.h"

/* Element encoding: type in the low 2 bits, value (rule or class id) above. */
enum {
    GRAM_END = 0,   /* end of a rule's last alternative */
    GRAM_ALT = 1,   /* end of an alternative that another follows */
    GRAM_REF = 2,   /* value: rule id */
    GRAM_CLASS = 3, /* value: class id */
};
#define GRAM_ELEM(type, value) (((uint32_t)(value) << 2) | (uint32_t)(type))
#define GRAM_TYPE(e) ((e)&3u)
#define GRAM_VALUE(e) ((e) >> 2)
#define GRAM_IS_STOP(e) (GRAM_TYPE(e) <= GRAM_ALT) /* END or ALT: the alternative ends */

#define GRAM_MAX_CP 0x10FFFFu
#define GRAM_UTF8_ANY (1u << 26)

struct tdm_grammar {
    uint32_t *elems; /* [n_elems] encoded elements, all rules back to back */
    uint32_t n_elems;
    uint32_t n_rules;
    uint32_t *alt_off; /* [n_rules + 1]: rule r's alternatives are alts[alt_off[r]..alt_off[r+1]) */
    uint32_t *alts;    /* start positions (in elems) of the productive alternatives */
    uint32_t n_classes;
    uint32_t *class_off; /* [n_classes + 1]: class c is ranges[2*class_off[c]..2*class_off[c+1]) */
    uint32_t *ranges;    /* inclusive code point ranges, lo hi lo hi ..., sorted, disjoint */
    uint32_t (*class_ascii)[4]; /* [n_classes] the ASCII bytes each class holds (bitmap) */
    uint32_t root;              /* start rule id */
    size_t size_bytes;
};

/* True when class c of g holds code point cp (binary search). */
bool tdm_gram_class_has(const tdm_grammar_t *g, uint32_t c, uint32_t cp);
/* True when class c of g holds every code point of [lo, hi]. */
bool tdm_gram_class_covers(const tdm_grammar_t *g, uint32_t c, uint32_t lo, uint32_t hi);
/* True when class c of g holds a code point in [lo, hi]. */
bool tdm_gram_class_meets(const tdm_grammar_t *g, uint32_t c, uint32_t lo, uint32_t hi);

/* ---- the parser's output, before analysis (grammar_parse.c -> grammar_check.c) ---- */

typedef struct gram_rule {
    char *name;      /* heap; generated rules are "<parent>_<n>" (not a legal user name) */
    uint32_t *elems; /* heap; alternatives separated by GRAM_ALT, ended by GRAM_END */
    uint32_t n_elems, cap;
    bool defined;
    size_t def_at;     /* byte offset of the definition (generated: of the group/operator) */
    size_t ref_at;     /* byte offset of the first reference (for "undefined rule") */
    uint32_t ref_from; /* rule holding that first reference */
} gram_rule_t;

typedef struct gram_ir {
    const char *text;
    size_t len;
    gram_rule_t *rules;
    uint32_t n_rules, cap_rules;
    uint32_t *ranges; /* class ranges, pairs */
    uint32_t n_ranges, cap_ranges;
    uint32_t *class_off; /* [n_classes + 1] */
    uint32_t n_classes, cap_classes;
    size_t n_elems_total;
    uint32_t *names; /* user rule names: open addressing, rule ids + 1 (0: empty) */
    uint32_t n_names, name_cap;
} gram_ir_t;

/* Parses GBNF text into ir (zeroed by the caller). Returns 0 or an error (message in err
 * with "line L, column C (rule R): what"). The ir may hold partial content either way; free
 * with tdm_gram_ir_free. */
int tdm_gram_parse_ir(gram_ir_t *ir, const char *text, size_t len, tdm_error_t *err);
void tdm_gram_ir_free(gram_ir_t *ir);
/* Grows *arr (elements of sz bytes, capacity *cap) to hold need elements, doubling from 16;
 * false on out of memory (*arr unchanged). The one array growth of the grammar module. */
bool tdm_gram_grow(void **arr, uint32_t *cap, uint32_t need, size_t sz);
/* Formats "line L, column C (rule R): " + fmt into err with code TDM_EINVALID. */
int tdm_gram_error_at(const gram_ir_t *ir, size_t at, uint32_t rule, tdm_error_t *err,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Checks ir (undefined rules, left recursion, a start rule with no finite string) and builds
 * the compiled grammar; returns NULL with err set. */
tdm_grammar_t *tdm_gram_compile(gram_ir_t *ir, const char *root_rule, tdm_error_t *err);

/* ---- the vocabulary trie (grammar_vocab.c) ---- */

/* One trie node, in depth-first preorder with children sorted by byte: node i's subtree is
 * nodes [i, end); the tokens whose bytes end at node i are tok_ids[tok_begin..tok_end), and
 * every token below it (itself included) is tok_ids[tok_begin..sub_tok_end). */
typedef struct gram_trie_node {
    uint8_t byte;
    uint8_t nonascii; /* 1 when a byte >= 0x80 occurs in the subtree (itself included) */
    uint16_t depth;   /* 0 for a first byte */
    uint16_t height;  /* bytes of the longest token below, from this node (>= 1) */
    uint16_t pad;
    uint32_t end;
    uint32_t tok_begin, tok_end, sub_tok_end;
} gram_trie_node_t;

enum { GRAM_TOK_NEVER = 0, GRAM_TOK_BYTES = 1, GRAM_TOK_EOG = 2 };

struct tdm_grammar_vocab {
    uint32_t n_vocab;
    uint8_t *kind;       /* [n_vocab] GRAM_TOK_* */
    uint32_t *bytes_off; /* [n_vocab + 1] token t's bytes are blob[bytes_off[t]..bytes_off[t+1]) */
    char *blob;
    gram_trie_node_t *nodes;
    uint32_t (*node_ascii)[4]; /* [n_nodes] bitmap of the ASCII bytes in node i's subtree */
    uint32_t n_nodes;
    uint32_t *tok_ids; /* tokens in byte-sorted order */
    uint32_t *eog;     /* [n_eog] end-of-generation tokens */
    uint32_t n_eog;
    uint32_t max_depth;  /* longest token, bytes */
    uint32_t *trie_bits; /* [(n_vocab + 31) / 32] bitmap of the tokens in the trie (token ids) */
};

/* ---- the state space (grammar_state.c) ---- */

#define GRAM_DEAD UINT32_MAX /* "no state": the byte leaves the grammar */
#define GRAM_UNKNOWN (UINT32_MAX - 1)

typedef struct gram_node {
    uint32_t pos;    /* next element to match */
    uint32_t parent; /* node id of the rest of the stack; 0 is the empty stack */
} gram_node_t;

typedef struct gram_state {
    uint32_t set_off, set_len; /* node ids in set_pool, sorted ascending; id 0 = empty stack */
    uint32_t utf8; /* partial character: 0; or value | rem << 21 | len << 23 | 1 << 25; or
                      GRAM_UTF8_ANY | rem << 21 (any continuation, every stack takes it) */
    uint32_t hash;
    uint32_t mask_slot; /* UINT32_MAX: no cached mask */
    uint32_t row;       /* dense transitions at rows[row * 256], UINT32_MAX: none */
    uint32_t hits;      /* live steps the mask walk took from this state */
    uint8_t uni_ok;     /* 1 once uni / uni_next are computed */
    uint8_t cover_ok;   /* 1 once cover is computed */
    uint16_t cover;     /* see tdm_gram_space_cover */
    uint32_t uni_next;  /* the successor most ASCII bytes lead to (GRAM_DEAD: too few) */
    uint32_t uni[4];    /* the ASCII bytes b with step(s, b) == uni_next */
} gram_state_t;

typedef struct gram_space {
    const tdm_grammar_t *g;
    gram_node_t *nodes;
    uint32_t *stamp; /* [cap_nodes] expansion generation that last visited the node */
    uint32_t n_nodes, cap_nodes;
    uint32_t *node_hash; /* open addressing, node ids + 1 (0 empty) */
    uint32_t node_hash_cap;
    uint32_t gen;
    gram_state_t *states;
    uint32_t n_states, cap_states;
    uint32_t *state_hash;
    uint32_t state_hash_cap;
    uint32_t *set_pool;
    uint32_t n_pool, cap_pool;
    uint32_t *rows; /* [n_rows][256] transitions of the states that have a row (GRAM_UNKNOWN:
                       not computed yet); the others use trans */
    uint32_t n_rows, cap_rows;
    uint32_t *row_owner; /* [n_rows] the state holding each row */
    uint32_t cap_owner, next_row;
    uint64_t *trans; /* open addressing: key (state << 8 | byte) + 1 in high 32, next low */
    uint32_t trans_cap, n_trans;
    uint32_t *work, *out; /* scratch */
    uint32_t cap_work, cap_out, n_work, n_out;
    bool full;          /* a table reached its bound during this operation */
    bool too_ambiguous; /* a step needed more than TDM_GRAMMAR_MAX_STACKS stacks */
    bool oom;
} gram_space_t;

/* Table bounds; a table past half its bound is rebuilt around the current state between
 * calls. Worst case per matcher: nodes 256 Ki x 12 B + hash 2 MiB, states 32 Ki x 64 B + hash,
 * transitions 256 Ki (a 4 MiB table), set pool 1 Mi x 4 B, 256 dense rows of 1 KiB: about
 * 17 MiB; a JSON-schema generation uses a few hundred KiB. */
#define GRAM_MAX_NODES (1u << 18)
#define GRAM_MAX_STATES (1u << 15)
#define GRAM_MAX_TRANS (1u << 18)
#define GRAM_MAX_POOL (1u << 20)
#define GRAM_MAX_ROWS 256u /* states with a dense transition row (1 KiB each) */

int tdm_gram_space_init(gram_space_t *sp, const tdm_grammar_t *g);
void tdm_gram_space_free(gram_space_t *sp);
/* Clears every table (ids become invalid). */
void tdm_gram_space_clear(gram_space_t *sp);
/* The state at the beginning of the start rule; GRAM_DEAD on a full table or no memory. */
uint32_t tdm_gram_space_start(gram_space_t *sp);
/* The state after byte b from state s (memoised); GRAM_DEAD when b leaves the grammar or a
 * bound was hit (sp->full / too_ambiguous / oom say which). */
uint32_t tdm_gram_space_step(gram_space_t *sp, uint32_t s, uint8_t b);
/* The same, with the dense row looked at first (the mask's inner loop). */
static inline uint32_t tdm_gram_space_step_fast(gram_space_t *sp, uint32_t s, uint8_t b)
{
    uint32_t r = sp->states[s].row;
    if (r != UINT32_MAX) {
        uint32_t v = sp->rows[(size_t)r * 256 + b];
        if (v != GRAM_UNKNOWN)
            return v;
    }
    return tdm_gram_space_step(sp, s, b);
}
bool tdm_gram_space_accepting(const gram_space_t *sp, uint32_t s);
bool tdm_gram_space_done(const gram_space_t *sp, uint32_t s);
/* Copies state s of src into dst (another space of the same grammar; may be src after a
 * clear when s was saved with tdm_gram_space_save). Returns the id in dst or GRAM_DEAD. */
typedef struct gram_saved {
    uint32_t *pos; /* all stacks' positions, top first, each stack ended by UINT32_MAX */
    uint32_t n, cap;
    uint32_t utf8;
} gram_saved_t;
int tdm_gram_space_save(const gram_space_t *sp, uint32_t s, gram_saved_t *out);
uint32_t tdm_gram_space_load(gram_space_t *sp, const gram_saved_t *in);

/* Uniform successors, the mask's shortcut: B(s) = s->uni, the ASCII bytes that all lead to
 * one state s->uni_next (a string's content loops: uni_next is s; under x{0,200} it is the
 * next count). cover(s) = the number of steps k along s, next(s), next(next(s)), ... for
 * which every state's B contains B(s): any string of at most cover(s) bytes of B(s) stays
 * inside the grammar, so a trie subtree of that height over those bytes is allowed whole.
 * Computed on demand (128 steps per state, GRAM_COVER_SCAN states ahead); a loop gives
 * GRAM_COVER_INF. */
#define GRAM_COVER_SCAN 16u
#define GRAM_COVER_INF 0xFFFFu
uint16_t tdm_gram_space_cover(gram_space_t *sp, uint32_t s);

#endif /* TANDEM_GRAMMAR_INTERNAL_H */
