/* grammar_matcher_internal.h - the matcher's body, shared by grammar_matcher.c (state,
 * accepting input) and grammar_mask.c (the token mask and its cache). */
#ifndef TANDEM_GRAMMAR_MATCHER_INTERNAL_H
#define TANDEM_GRAMMAR_MATCHER_INTERNAL_H

#include "grammar/grammar_internal.h"

/* Masks cached per matcher (each (n_vocab + 31) / 32 words: 6 KiB for 49,152 tokens). */
#define TDM_GRAMMAR_MASK_CACHE 32u

typedef struct gram_mask_slot {
    uint32_t *bits; /* [n_words], allocated on first use */
    uint32_t state; /* the state whose mask it holds; UINT32_MAX: free */
    uint32_t count; /* allowed tokens */
} gram_mask_slot_t;

struct tdm_grammar_matcher {
    const tdm_grammar_t *g;
    const tdm_grammar_vocab_t *v;
    gram_space_t sp;
    uint32_t cur; /* current state */
    bool ended;   /* an end-of-generation token was accepted */
    uint32_t n_words;
    gram_mask_slot_t cache[TDM_GRAMMAR_MASK_CACHE];
    uint32_t next_victim; /* round-robin replacement */
    uint32_t *walk_state; /* [max_depth + 2] state at each trie depth */
    uint32_t *deny;       /* [n_words] scratch of the mask walk's deny mode (grammar_mask.c) */
    gram_saved_t saved;   /* scratch for rebuilds and copies */
    gram_saved_t orig;    /* the state before an accept_bytes that had to rebuild */
    uint32_t floor_nodes; /* nodes right after the last rebuild */
    char errmsg[256];
};

void tdm_gram_mask_cache_clear(tdm_grammar_matcher_t *m);
void tdm_gram_matcher_note_bounds(tdm_grammar_matcher_t *m);
int tdm_gram_matcher_rebuild(tdm_grammar_matcher_t *m);
void tdm_gram_matcher_maybe_rebuild(tdm_grammar_matcher_t *m);

#endif
