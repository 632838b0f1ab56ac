/* prompt.h - a request's input (raw text or chat messages) -> the prompt's token ids.
 *
 * The one implementation of the rule that turns what a user typed into the tokens a model
 * sees. The router (router/request.c), `tandem generate -m` and `tandem tokenize --chat` all
 * call tdm_prompt_encode with a template picked by tdm_chat_template_pick (tandem/chat.h), so
 * the same input gives the same ids everywhere; tests/unit/test_router.c checks the three
 * agree. The rule:
 *  - raw text: tokenized with parse_special (control tokens' texts such as "<|im_start|>" are
 *    matched) and BOS added when the tokenizer says so (tokenizer.ggml.add_bos_token);
 *  - chat with a Jinja template (the request's, else the picked one: the model's
 *    tokenizer.chat_template or a template file): rendered by tdm_chat_apply_jinja with the
 *    messages, tools, the generation prompt, the model's bos/eos texts and the request's
 *    kwargs, then tokenized with parse_special as llama.cpp's server does with --jinja: when
 *    the tokenizer adds BOS (tokenizer.ggml.add_bos_token) and the rendering begins with the
 *    BOS text, that text is cut and the tokenizer adds the BOS token, so a template that writes
 *    bos_token gives one BOS, not two; otherwise the text is tokenized as it is, with BOS added
 *    when the tokenizer says so. (vLLM tokenizes with add_special_tokens=False instead; the
 *    two differ only for a template that does not write BOS on a model that adds one.)
 *  - chat with a built-in template (a model without tokenizer.chat_template, or an override
 *    naming chatml|llama3|llama2|gemma): rendered by tdm_chat_apply_tools (with the input's
 *    tools) with the picked template, its default system message and the generation prompt,
 *    then tokenized with parse_special and BOS added when the tokenizer says so and the
 *    template does not write BOS's text itself (tdm_chat_template_writes_bos), which is Hugging
 *    Face's add_special_tokens=False for chat prompts.
 *
 * Pure: no state, safe from any thread for a tokenizer that is.
 */
#ifndef TANDEM_PROMPT_H
#define TANDEM_PROMPT_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/chat.h"
#include "tandem/sampling.h"
#include "tandem/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What to encode: raw text when text is not NULL, chat messages otherwise. All pointers are
 * borrowed from the caller and must stay valid during the call. */
typedef struct tdm_prompt_input {
    const char *text; /* raw prompt of text_len bytes (UTF-8; need not be NUL-terminated) */
    size_t text_len;
    const tdm_chat_message_t *messages; /* chat: n_messages messages (NULL when 0) */
    size_t n_messages;
    const char *system;        /* chat: NULL, or a system message put before messages (the CLI's
                                  --system); it replaces the template's default one */
    const char *tools;         /* chat: NULL/"" or OpenAI's tools as a JSON array text, rendered by
                                  tdm_chat_apply_tools (the Hermes format) */
    bool no_generation_prompt; /* chat: leave out the generation prompt (the /tokenize endpoint's
                                  add_generation_prompt: false); requests always have it */
    bool no_bos;               /* add no BOS whatever the rule says (/tokenize's
                                  add_special_tokens: false) */
    const tdm_jinja_t *jinja;  /* chat: NULL, or a template used instead of the picked one (a
                                  request's chat_template, compiled by tdm_chat_jinja_compile) */
    const json_t *template_kwargs; /* chat: NULL or a JSON object of more template variables
                                      (chat_template_kwargs); Jinja templates only, the built-in
                                      ones have no variables to set */
    int64_t now;  /* chat: strftime_now's time in seconds since the epoch; 0: the clock */
    bool *raised; /* chat: NULL, or set to whether a failed rendering was the template's own
                     raise_exception (its message is then the template's alone) */
} tdm_prompt_input_t;

/* Encodes in as the rule above says. pick is the template (tdm_chat_template_pick); it may be
 * NULL for raw text. rendered, when not NULL, receives the rendered chat text (a
 * NUL-terminated heap string the caller frees with free(); NULL for raw text and on error),
 * for logs.
 * On success *ids is a heap array of *n_ids token ids (0 <= id < the vocabulary size) that the
 * caller frees with free(); it may be empty (an empty raw text without BOS) but is not NULL.
 * Callers check the length against their context themselves.
 * Errors: TDM_EINVALID for a chat without a template (pick NULL and no in->jinja), one
 * tdm_chat_apply refuses (unknown role, misplaced system message, broken Llama-2 alternation:
 * the message names the message's index, counting an explicit system message as index 0) or
 * a Jinja rendering that fails (tdm_chat_apply_jinja: jinja2's message with line:column,
 * raise_exception's message, a render limit); TDM_ERESOURCE (out of
 * memory); TDM_EINTERNAL (the tokenizer's PCRE2 failed). On error *ids is NULL and *n_ids 0. */
int tdm_prompt_encode(const tdm_tokenizer_t *tok, const tdm_chat_pick_t *pick,
                      const tdm_prompt_input_t *in, tdm_token_t **ids, size_t *n_ids,
                      char **rendered, tdm_error_t *err);

/* The rule that turns one of vLLM's bad_words into the token sequences the sampler masks by
 * (vLLM's SamplingParams): the word without leading ASCII whitespace, tokenized as it is
 * (without BOS, special tokens not parsed), then " " + that word when it tokenizes to as many
 * tokens with a different first one (the word inside text, where the tokenizer joins the space
 * to it). Both are appended to sp (tdm_sampling_bad_seq_add). The router and `tandem generate
 * -m` both call this. index names the word in messages ("bad_words[2]").
 * Errors: TDM_EINVALID with err->field "bad_words[<index>]" for a word over
 * TDM_SAMPLING_MAX_BAD_WORD_BYTES bytes, not valid UTF-8, or only whitespace, and with
 * err->field "bad_words" when the sequences pass their limits (TDM_SAMPLING_MAX_BAD_SEQS,
 * TDM_SAMPLING_MAX_BAD_TOKENS); the message begins with the field. TDM_ERESOURCE,
 * TDM_EINTERNAL as tdm_tokenizer_encode. sp is left with the sequences added before the
 * failure. */
int tdm_prompt_bad_word(const tdm_tokenizer_t *tok, const char *word, size_t index,
                        tdm_sampling_params_t *sp, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_PROMPT_H */
