/* special.c - finding special tokens (control, unknown, user-defined) in text: a byte trie of
 * their texts, walked once per candidate position.
 *
 * Matching is leftmost-longest (Hugging Face's added-vocabulary matcher): at a position the
 * longest special token whose text starts there wins, among those the call may match
 * (user-defined tokens always, control and unknown ones only with parse_special). The trie makes
 * that cost the length of the longest prefix shared with some special token, however many
 * there are: Gemma 3 has 6,400 special tokens, 6,300 of them beginning with '<', and a scan of
 * them at every '<' of HTML or code would cost thousands of comparisons per token.
 * A text shared by two special tokens matches the lower id.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

static bool is_special(uint8_t attr)
{
    return attr == TDM_TOKEN_CONTROL || attr == TDM_TOKEN_USER_DEFINED || attr == TDM_TOKEN_UNKNOWN;
}

/* The child of node for byte b, or -1. */
static int32_t trie_child(const tdm_tokenizer_t *tok, int32_t node, uint8_t b)
{
    for (int32_t c = tok->trie[node].first_child; c >= 0; c = tok->trie[c].next)
        if (tok->trie[c].byte == b)
            return c;
    return -1;
}

/* Adds the text s[0..n) (n > 0) of token id; the nodes come from tok->trie's free end. */
static void trie_insert(tdm_tokenizer_t *tok, const char *s, size_t n, tdm_token_t id)
{
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = trie_child(tok, node, b);
        if (c < 0) {
            c = (int32_t)tok->n_trie++;
            tok->trie[c] = (tdm_tok_trie_node_t){
                .first_child = -1, .next = tok->trie[node].first_child, .id = -1, .byte = b};
            tok->trie[node].first_child = c;
        }
        node = c;
    }
    if (tok->trie[node].id < 0)
        tok->trie[node].id = id;
}

int tdm_tok_special_init(tdm_tokenizer_t *tok)
{
    size_t bytes = 1; /* the root */
    for (uint32_t id = 0; id < tok->n_vocab; id++)
        if (is_special(tok->attr[id]))
            bytes += tok->text_off[id + 1] - tok->text_off[id] - 1;
    if (bytes > INT32_MAX)
        return TDM_ERESOURCE;
    tok->trie = malloc(bytes * sizeof *tok->trie);
    if (!tok->trie)
        return TDM_ERESOURCE;
    tok->trie[0] = (tdm_tok_trie_node_t){.first_child = -1, .next = -1, .id = -1, .byte = 0};
    tok->n_trie = 1;
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        size_t len;
        const char *s = tdm_tok_text(tok, (tdm_token_t)id, &len);
        if (!is_special(tok->attr[id]) || len == 0)
            continue;
        trie_insert(tok, s, len, (tdm_token_t)id);
        uint64_t bit = 1ULL << ((uint8_t)s[0] & 63);
        tok->first_any[(uint8_t)s[0] >> 6] |= bit;
        if (tok->attr[id] == TDM_TOKEN_USER_DEFINED)
            tok->first_user[(uint8_t)s[0] >> 6] |= bit;
    }
    return TDM_OK;
}

void tdm_tok_special_free(tdm_tokenizer_t *tok)
{
    free(tok->trie);
    tok->trie = NULL;
    tok->n_trie = 0;
}

tdm_token_t tdm_tok_special_match(const tdm_tokenizer_t *tok, const char *text, size_t len,
                                  bool parse_special, size_t *mlen)
{
    const uint64_t *first = parse_special ? tok->first_any : tok->first_user;
    if (len == 0)
        return -1;
    uint8_t c = (uint8_t)text[0];
    if (!((first[c >> 6] >> (c & 63)) & 1))
        return -1;
    tdm_token_t best = -1;
    int32_t node = 0;
    for (size_t i = 0; i < len; i++) {
        node = trie_child(tok, node, (uint8_t)text[i]);
        if (node < 0)
            break;
        tdm_token_t id = tok->trie[node].id;
        if (id >= 0 && (parse_special || tok->attr[id] == TDM_TOKEN_USER_DEFINED)) {
            best = id;
            *mlen = i + 1;
        }
    }
    return best;
}
