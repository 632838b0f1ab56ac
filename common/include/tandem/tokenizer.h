/* tokenizer.h - text <-> token ids from GGUF tokenizer metadata, exactly as the reference
 * (Hugging Face tokenizers / llama.cpp) tokenizers do.
 *
 * Two families (tokenizer.ggml.model):
 *  - "gpt2": byte-level BPE. Text is split by the pre-tokenizer regexes named by
 *    tokenizer.ggml.pre (PCRE2 with UTF + UCP), each piece mapped byte->unicode (GPT-2's
 *    bytes_to_unicode table) and merged by rank (tokenizer.ggml.merges).
 *  - "llama": SentencePiece-style BPE: spaces become U+2581, a leading U+2581 is added
 *    (tokenizer.ggml.add_space_prefix, default true), pieces are merged by score
 *    (tokenizer.ggml.scores) and unknown bytes fall back to <0xXX> tokens.
 * Control (and unknown) tokens are matched in the text only when parse_special is set;
 * otherwise they are tokenized as plain text. User-defined tokens (added tokens such as
 * deepseek-coder's) are always matched, as the reference tokenizers do. Matching is
 * leftmost-longest.
 * The tokenizer copies what it needs from the GGUF file: it does not keep the tdm_gguf_t.
 * It is immutable after creation, so one instance may be shared by threads.
 */
#ifndef TANDEM_TOKENIZER_H
#define TANDEM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t tdm_token_t;

typedef enum tdm_tokenizer_kind {
    TDM_TOKENIZER_BPE = 0, /* tokenizer.ggml.model = "gpt2" (byte-level BPE) */
    TDM_TOKENIZER_SPM = 1, /* tokenizer.ggml.model = "llama" (SentencePiece-style BPE) */
} tdm_tokenizer_kind_t;

/* Token attributes (tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control,
 * 4 user-defined, 5 unused, 6 byte). */
typedef enum tdm_token_attr {
    TDM_TOKEN_NORMAL = 1,
    TDM_TOKEN_UNKNOWN = 2,
    TDM_TOKEN_CONTROL = 3,
    TDM_TOKEN_USER_DEFINED = 4,
    TDM_TOKEN_UNUSED = 5,
    TDM_TOKEN_BYTE = 6,
} tdm_token_attr_t;

typedef struct tdm_tokenizer tdm_tokenizer_t;

/* Builds a tokenizer from the tokenizer.ggml.* metadata of g (works on vocabulary-only files).
 * Returns NULL with *err set: TDM_EINVALID for missing/inconsistent metadata (names the key),
 * for an unknown tokenizer.ggml.model or tokenizer.ggml.pre (names the value and the supported
 * ones), TDM_ERESOURCE on out of memory. Caller frees with tdm_tokenizer_destroy. */
tdm_tokenizer_t *tdm_tokenizer_new(const tdm_gguf_t *g, tdm_error_t *err);
void tdm_tokenizer_destroy(tdm_tokenizer_t **self_p);

tdm_tokenizer_kind_t tdm_tokenizer_kind(const tdm_tokenizer_t *tok);
const char *tdm_tokenizer_pre(const tdm_tokenizer_t *tok); /* "smollm", "gpt-2", "default"… */
uint32_t tdm_tokenizer_n_vocab(const tdm_tokenizer_t *tok);
tdm_token_t tdm_tokenizer_bos(const tdm_tokenizer_t *tok); /* -1 when the vocab has none */
tdm_token_t tdm_tokenizer_eos(const tdm_tokenizer_t *tok); /* -1 when none */
tdm_token_t tdm_tokenizer_eot(const tdm_tokenizer_t *tok); /* end of turn (<|im_end|>,
                                                              <|eot_id|>) or -1 */
tdm_token_t tdm_tokenizer_unk(const tdm_tokenizer_t *tok); /* unknown token or -1 */
bool tdm_tokenizer_add_bos(const tdm_tokenizer_t *tok);    /* tokenizer.ggml.add_bos_token */
/* Byte-level BPE: the i-th regex (PCRE2 syntax, UTF + UCP) of the pre-tokenizer sequence, each
 * splitting the pieces the previous one left and keeping matched and unmatched spans (Hugging
 * Face's Split with behaviour "Isolated"); NULL past the last one and for SPM. The string is
 * static. */
const char *tdm_tokenizer_pre_regex(const tdm_tokenizer_t *tok, size_t i);
/* Byte-level BPE: true when a pre-token found whole in the vocabulary is not merged (llama3:
 * Hugging Face's BPE ignore_merges). */
bool tdm_tokenizer_ignore_merges(const tdm_tokenizer_t *tok);
/* True for tokens that end generation: eos, eot and other end-of-generation controls. */
bool tdm_tokenizer_is_eog(const tdm_tokenizer_t *tok, tdm_token_t id);
/* The token's type; TDM_TOKEN_UNUSED for an id out of range. */
tdm_token_attr_t tdm_tokenizer_attr(const tdm_tokenizer_t *tok, tdm_token_t id);

/* The vocabulary string of a token as stored in the file (byte-level or U+2581 form);
 * NULL for an id out of range. *len gets its length in bytes. */
const char *tdm_tokenizer_piece(const tdm_tokenizer_t *tok, tdm_token_t id, size_t *len);

/* Finds a token by its exact vocabulary string; -1 when absent. */
tdm_token_t tdm_tokenizer_find(const tdm_tokenizer_t *tok, const char *piece, size_t len);

/* Encodes len bytes of UTF-8 text (invalid UTF-8 is accepted: bytes that do not form a
 * character are tokenized as single bytes; a byte the vocabulary cannot spell becomes the unk
 * token, or is dropped when there is none). add_bos prepends BOS when the vocab has one;
 * parse_special also matches control tokens' texts in the input (user-defined ones always).
 * SPM adds the space prefix at the start of the text and after each special token
 * (llama.cpp's behaviour). Cost: O(n log n) in the longest pre-token.
 * On success *ids is a heap array of *n_ids tokens that the caller frees with free()
 * (non-NULL even when empty). Errors: TDM_ERESOURCE (out of memory), TDM_EINTERNAL (PCRE2
 * failure; message has PCRE2's text). */
int tdm_tokenizer_encode(const tdm_tokenizer_t *tok, const char *text, size_t len, bool add_bos,
                         bool parse_special, tdm_token_t **ids, size_t *n_ids, tdm_error_t *err);

/* The bytes a token stands for when decoded: byte-level pieces mapped back to bytes,
 * U+2581 to space, <0xXX> to that byte, user-defined tokens to their text, control (and
 * unknown, unused) tokens to their text when render_special and to nothing otherwise.
 * No NUL is written. Writes at most cap bytes to buf and returns the full length (which
 * may exceed cap, as snprintf does), or TDM_EINVALID for an id out of range. */
int tdm_tokenizer_token_bytes(const tdm_tokenizer_t *tok, tdm_token_t id, bool render_special,
                              char *buf, size_t cap);

/* Decodes n ids to bytes (the exact inverse of encode for text without special tokens: for
 * SPM vocabularies the space prefix added by encode is removed). *out is a NUL-terminated heap
 * string of *out_len bytes (may contain invalid UTF-8 if the ids do); caller frees.
 * Errors: TDM_EINVALID (an id out of range, message names its index), TDM_ERESOURCE. */
int tdm_tokenizer_decode(const tdm_tokenizer_t *tok, const tdm_token_t *ids, size_t n,
                         bool render_special, char **out, size_t *out_len, tdm_error_t *err);

/* Incremental detokenizer for streaming: push ids one at a time, get text that never ends in
 * the middle of a UTF-8 character; flush at the end emits what is left (an incomplete
 * sequence as U+FFFD per maximal invalid subpart, as the Unicode standard recommends).
 * A plain value: initialise with tdm_detok_init, no destroy needed. */
typedef struct tdm_detok {
    const tdm_tokenizer_t *tok;
    bool render_special;
    bool at_start; /* SPM: the first piece's leading space is dropped */
    unsigned char pending[8];
    size_t n_pending; /* bytes of an incomplete UTF-8 character held back */
} tdm_detok_t;

void tdm_detok_init(tdm_detok_t *d, const tdm_tokenizer_t *tok, bool render_special);

/* Writes the text completed by id to out[0..] (cap bytes) and sets *out_len; out is
 * NUL-terminated. Bytes that can never form a character are written as U+FFFD (one per
 * maximal invalid subpart), so the output is always valid UTF-8; for ids whose decode is valid
 * UTF-8 the concatenated output equals tdm_tokenizer_decode's. 64 bytes of cap always suffice
 * for tokens shorter than 48 bytes of valid UTF-8; a larger token needs its length + 16 (and
 * 3 bytes per invalid byte). Errors: TDM_EINVALID (id out of range), TDM_ERESOURCE (cap too
 * small; nothing is consumed). */
int tdm_detok_push(tdm_detok_t *d, tdm_token_t id, char *out, size_t cap, size_t *out_len);

/* Emits held-back bytes (as U+FFFD replacement characters) and resets the state.
 * out needs 3 * 8 + 1 bytes at most. Cannot fail when cap >= 25. */
int tdm_detok_flush(tdm_detok_t *d, char *out, size_t cap, size_t *out_len);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_TOKENIZER_H */
