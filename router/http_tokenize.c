/* http_tokenize.c - POST /tokenize and /detokenize in vLLM's shapes, answered in the gateway
 * with the router's own tokenizer and chat template (tdm_router_vocab, immutable, so HTTP
 * threads may share them) through the one prompt rule, tdm_prompt_encode: the ids are those a
 * request with the same prompt or messages is prefilled with.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_openai.h"
#include "http_json.h"
#include "http_tokenize.h"
#include "tandem/chat.h"
#include "tandem/prompt.h"

/* The error body for code (a tdm status) naming param, *status its HTTP status. New
 * reference. */
static json_t *tok_error(unsigned *status, int code, const char *param, const char *msg)
{
    *status = tdm_status_info(code)->http_status;
    return http_error_json(code, code == TDM_ENOTFOUND ? "model_not_found" : NULL, param, msg);
}

/* The boolean field name of root into *out (default kept when absent or null); false with the
 * error in *bad when it is of another type. */
static bool get_flag(json_t *root, const char *name, bool *out, unsigned *status, json_t **bad)
{
    json_t *v = json_object_get(root, name);
    if (!v || json_is_null(v))
        return true;
    if (!json_is_boolean(v)) {
        char msg[96];
        snprintf(msg, sizeof msg, "%s must be a boolean", name);
        *bad = tok_error(status, TDM_EINVALID, name, msg);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

/* Parses body as a JSON object and checks its model against served. NULL with *err set (the
 * reply) on failure. */
static json_t *tok_root(const char *body, size_t len, const char *served, unsigned *status,
                        json_t **err)
{
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je);
    char msg[TDM_ERRMSG_MAX];
    if (!root || !json_is_object(root)) {
        snprintf(msg, sizeof msg, "the body must be a JSON object%s%s", root ? "" : ": ",
                 root ? "" : je.text);
        json_decref(root);
        *err = tok_error(status, TDM_EINVALID, NULL, msg);
        return NULL;
    }
    json_t *model = json_object_get(root, "model");
    if (model && !json_is_null(model) &&
        (!json_is_string(model) || strcmp(json_string_value(model), served) != 0)) {
        snprintf(msg, sizeof msg, "The model '%.200s' does not exist",
                 json_is_string(model) ? json_string_value(model) : "(not a string)");
        json_decref(root);
        *err = tok_error(status, TDM_ENOTFOUND, "model", msg);
        return NULL;
    }
    return root;
}

/* The ids of the prompt or messages of root (q holds the parsed chat when messages, with its
 * tools, chat_template and chat_template_kwargs). A request's own chat_template is compiled
 * here for this request (the gateway's threads share no cache; generation requests go through
 * the router's, router/template_cache.h). */
static int tok_encode(const tdm_http_vocab_t *v, json_t *root, const oai_req_t *q, bool special,
                      bool gen_prompt, tdm_token_t **ids, size_t *n, tdm_error_t *err)
{
    tdm_prompt_input_t in = {.no_bos = !special, .no_generation_prompt = !gen_prompt};
    json_t *prompt = json_object_get(root, "prompt");
    if (prompt) {
        in.text = json_string_value(prompt);
        in.text_len = json_string_length(prompt);
        return tdm_prompt_encode(v->tok, NULL, &in, ids, n, NULL, err);
    }
    in.messages = q->creq.messages;
    in.n_messages = q->creq.n_messages;
    in.tools = q->creq.tools;
    in.continue_final_message = q->continue_final_message; /* checked by oai_parse */
    in.template_kwargs = json_object_get(root, "chat_template_kwargs");
    if (json_is_null(in.template_kwargs))
        in.template_kwargs = NULL;
    tdm_jinja_t *own = NULL;
    if (q->chat_template) {
        own = tdm_chat_jinja_compile(q->chat_template, strlen(q->chat_template), err);
        if (!own) {
            tdm_error_prefix(err, err->code, "chat_template: ");
            return tdm_error_field(err, "chat_template");
        }
        in.jinja = own;
    }
    int rc = tdm_prompt_encode(v->tok, v->pick, &in, ids, n, NULL, err);
    tdm_jinja_destroy(&own);
    return rc;
}

/* {"count", "max_model_len", "tokens", "token_strs"} of ids. */
static json_t *tok_response(const tdm_http_vocab_t *v, const tdm_token_t *ids, size_t n, bool strs)
{
    json_t *tokens = json_array();
    json_t *pieces = strs ? json_array() : json_null();
    for (size_t i = 0; tokens && pieces && i < n; i++) {
        json_array_append_new(tokens, json_integer(ids[i]));
        if (strs) {
            size_t len = 0;
            const char *p = tdm_tokenizer_piece(v->tok, ids[i], &len);
            json_array_append_new(pieces, http_json_text(p, p ? len : 0));
        }
    }
    return json_pack("{s:I, s:I, s:o*, s:o*}", "count", (json_int_t)n, "max_model_len",
                     (json_int_t)v->n_ctx, "tokens", tokens, "token_strs", pieces);
}

/* The input of a /tokenize body: exactly one of prompt (a string) and messages (parsed into q
 * as a chat request is). Returns true, or false with the reply in *bad. */
static bool tok_input(json_t *root, const char *body, size_t len, const char *served, oai_req_t *q,
                      bool *have_q, unsigned *status, json_t **bad)
{
    json_t *prompt = json_object_get(root, "prompt");
    json_t *messages = json_object_get(root, "messages");
    if (!prompt == !messages) {
        *bad = tok_error(status, TDM_EINVALID, prompt ? "messages" : "prompt",
                         prompt ? "give prompt or messages, not both"
                                : "prompt (a string) or messages is required");
        return false;
    }
    if (prompt && !json_is_string(prompt)) {
        *bad = tok_error(status, TDM_EINVALID, "prompt", "prompt must be a string");
        return false;
    }
    if (prompt)
        return true;
    tdm_error_t err = {0};
    int rc = oai_parse_tokenize(body, len, served, q, &err);
    if (rc != TDM_OK) {
        *bad = tok_error(status, rc, err.field[0] ? err.field : "messages", err.msg);
        return false;
    }
    *have_q = true;
    return true;
}

json_t *http_tokenize_json(const tdm_http_vocab_t *v, const char *served, const char *body,
                           size_t len, unsigned *status)
{
    json_t *bad = NULL;
    json_t *root = tok_root(body, len, served, status, &bad);
    if (!root)
        return bad;
    bool special = true, gen_prompt = true, strs = false, have_q = false;
    oai_req_t q;
    json_t *out = NULL;
    if (!get_flag(root, "add_special_tokens", &special, status, &bad) ||
        !get_flag(root, "add_generation_prompt", &gen_prompt, status, &bad) ||
        !get_flag(root, "return_token_strs", &strs, status, &bad) ||
        !tok_input(root, body, len, served, &q, &have_q, status, &bad)) {
        out = bad;
        goto out_root;
    }
    tdm_token_t *ids = NULL;
    size_t n = 0;
    tdm_error_t err = {0};
    int rc = tok_encode(v, root, have_q ? &q : NULL, special, gen_prompt, &ids, &n, &err);
    if (rc != TDM_OK) {
        out = tok_error(status, rc,
                        err.field[0] ? err.field
                        : have_q     ? "messages"
                                     : "prompt",
                        err.msg);
    } else {
        *status = 200;
        out = tok_response(v, ids, n, strs);
    }
    free(ids);
    if (have_q)
        oai_req_clear(&q);
out_root:
    json_decref(root);
    return out;
}

/* The ids of tokens[] (0 <= id < the vocabulary) into a heap array *ids. */
static bool detok_ids(const tdm_http_vocab_t *v, json_t *tokens, tdm_token_t **ids,
                      unsigned *status, json_t **bad)
{
    if (!json_is_array(tokens)) {
        *bad = tok_error(status, TDM_EINVALID, "tokens", "tokens must be an array of token ids");
        return false;
    }
    size_t n = json_array_size(tokens);
    *ids = calloc(n ? n : 1, sizeof **ids);
    if (!*ids) {
        *bad = tok_error(status, TDM_EINTERNAL, NULL, "out of memory");
        return false;
    }
    uint32_t n_vocab = tdm_tokenizer_n_vocab(v->tok);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(tokens, i);
        json_int_t id = json_is_integer(e) ? json_integer_value(e) : -1;
        if (id < 0 || id >= (json_int_t)n_vocab) {
            char msg[128];
            snprintf(msg, sizeof msg, "tokens[%zu] must be a token id in [0, %u)", i, n_vocab);
            *bad = tok_error(status, TDM_EINVALID, "tokens", msg);
            free(*ids);
            *ids = NULL;
            return false;
        }
        (*ids)[i] = (tdm_token_t)id;
    }
    return true;
}

json_t *http_detokenize_json(const tdm_http_vocab_t *v, const char *served, const char *body,
                             size_t len, unsigned *status)
{
    json_t *bad = NULL;
    json_t *root = tok_root(body, len, served, status, &bad);
    if (!root)
        return bad;
    tdm_token_t *ids = NULL;
    json_t *tokens = json_object_get(root, "tokens");
    json_t *out;
    if (!tokens) {
        out =
            tok_error(status, TDM_EINVALID, "tokens", "tokens (an array of token ids) is required");
    } else if (!detok_ids(v, tokens, &ids, status, &bad)) {
        out = bad;
    } else {
        char *text = NULL;
        size_t text_len = 0;
        tdm_error_t err = {0};
        /* special tokens rendered, as Hugging Face's decode does by default (vLLM's) */
        int rc = tdm_tokenizer_decode(v->tok, ids, json_array_size(tokens), true, &text, &text_len,
                                      &err);
        *status = 200;
        out = rc == TDM_OK ? json_pack("{s:o}", "prompt", http_json_text(text, text_len))
                           : tok_error(status, rc, "tokens", err.msg);
        free(text);
    }
    free(ids);
    json_decref(root);
    return out;
}
