/* http_tokenize.h - POST /tokenize and /detokenize in vLLM's shapes (http_tokenize.c).
 */
#ifndef TANDEM_ROUTER_HTTP_TOKENIZE_H
#define TANDEM_ROUTER_HTTP_TOKENIZE_H

#include <stddef.h>

#include <jansson.h>

#include "http.h"

/* POST /tokenize: body {model?, prompt | messages (+ tools), add_special_tokens (default
 * true; false: no BOS), add_generation_prompt (chat; default true), return_token_strs} ->
 * {"count", "max_model_len", "tokens", "token_strs" (null unless asked)}; served is the model a
 * given "model" must name. Sets *status (200, 400 naming the field, 404 for another model).
 * Returns a new reference, NULL on out of memory. */
json_t *http_tokenize_json(const tdm_http_vocab_t *v, const char *served, const char *body,
                           size_t len, unsigned *status);

/* POST /detokenize: body {model?, tokens} -> {"prompt": the text, special tokens rendered};
 * a token out of the vocabulary is a 400 naming "tokens" (the message its index). As above. */
json_t *http_detokenize_json(const tdm_http_vocab_t *v, const char *served, const char *body,
                             size_t len, unsigned *status);

#endif /* TANDEM_ROUTER_HTTP_TOKENIZE_H */
