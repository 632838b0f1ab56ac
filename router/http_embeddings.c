/* http_embeddings.c - POST /v1/embeddings in OpenAI's shape: the body checked and its inputs
 * tokenized here, with the router's own tokenizer (as /tokenize), by the one rule
 * tdm_prompt_encode and checked by tdm_router_embed_check, so each refusal names its param
 * ("input[2]", "input[1][7]"); then one EMBED call to the router (router/embed.c) with the
 * token ids, and its EmbedResponse written as {"object": "list", "data": [...], "model",
 * "usage"} (docs/api.md "Embeddings").
 *
 * encoding_format "base64" is each vector's float32 values as little-endian bytes in standard
 * base64 (what OpenAI's API sends and its Python client decodes with numpy.frombuffer; x86 and
 * ARM hosts are little-endian, and the bytes are written as such). The call waits for the
 * router (its queue, the nodes) at most EMBED_TIMEOUT_S with the connection parked, as a
 * generate call's (gw_call_take): no HTTP pool thread waits on a node.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <microhttpd.h>
#include <sodium.h>

#include "embed.h"
#include "http_gateway.h"
#include "http_server.h"
#include "tandem/limits.h"
#include "tandem/prompt.h"
#include "tandem/proto.h"

#define EMBED_TIMEOUT_S 600.0

/* A refusal: the reply for status with param (NULL: none) and the message. */
#define REFUSE(c, status, code, param, ...) http_reply_error(c, status, code, param, __VA_ARGS__)

/* The parsed body. */
typedef struct emb_body {
    size_t model_index;
    char served[TDM_MODEL_NAME_MAX + 1]; /* the model's name as the answer says it */
    bool base64;
    Tandem__V1__Pooling pooling;
    Tandem__V1__TokenList *lists;  /* [n] */
    Tandem__V1__TokenList **listp; /* [n] */
    size_t n;
} emb_body_t;

static void body_free(emb_body_t *b)
{
    for (size_t i = 0; b->lists && i < b->n; i++)
        free(b->lists[i].ids);
    free(b->lists);
    free(b->listp);
}

/* Input i's ids from a JSON array of integers v (what: its param) into b->lists[i]; false with
 * the reply in *ret. */
static bool take_ids(struct MHD_Connection *c, const tdm_http_vocab_t *voc, const json_t *v,
                     const char *what, emb_body_t *b, size_t i, enum MHD_Result *ret)
{
    size_t n = json_array_size(v);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        *ret = REFUSE(c, TDM_ERESOURCE, NULL, NULL, "out of memory");
        return false;
    }
    for (size_t j = 0; j < n; j++) {
        const json_t *e = json_array_get(v, j);
        json_int_t id = json_integer_value(e);
        if (!json_is_integer(e) || id < INT32_MIN || id > INT32_MAX) {
            free(ids);
            char field[TDM_ERRFIELD_MAX];
            snprintf(field, sizeof field, "%s[%zu]", what, j);
            if (json_is_integer(e)) /* as tdm_router_embed_check says it for smaller ones */
                *ret = REFUSE(c, TDM_EINVALID, NULL, field,
                              "%s: token id %" JSON_INTEGER_FORMAT
                              " is outside the vocabulary [0, %u)",
                              field, id, tdm_tokenizer_n_vocab(voc->tok));
            else
                *ret = REFUSE(c, TDM_EINVALID, NULL, field,
                              "%s: a token id must be an integer, got %s", field, oai_type_name(e));
            return false;
        }
        ids[j] = (int32_t)id;
    }
    tdm_error_t err = {0};
    if (tdm_router_embed_check(ids, n, tdm_tokenizer_n_vocab(voc->tok), voc->n_ctx, what, &err) !=
        TDM_OK) {
        free(ids);
        *ret = REFUSE(c, err.code, NULL, err.field, "%s", err.msg);
        return false;
    }
    b->lists[i].ids = ids;
    b->lists[i].n_ids = n;
    return true;
}

/* Input i's text s, tokenized (the model's BOS rule, as a raw prompt) and checked. */
static bool take_text(struct MHD_Connection *c, const tdm_http_vocab_t *voc, const char *s,
                      size_t len, const char *what, emb_body_t *b, size_t i, enum MHD_Result *ret)
{
    if (len == 0) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, what, "%s: empty string; an input is 1..%u tokens",
                      what, voc->n_ctx);
        return false;
    }
    tdm_prompt_input_t in = {.text = s, .text_len = len};
    tdm_token_t *ids = NULL;
    size_t n = 0;
    tdm_error_t err = {0};
    if (tdm_prompt_encode(voc->tok, NULL, &in, &ids, &n, NULL, &err) != TDM_OK ||
        tdm_router_embed_check(ids, n, tdm_tokenizer_n_vocab(voc->tok), voc->n_ctx, what, &err) !=
            TDM_OK) {
        free(ids);
        *ret = REFUSE(c, err.code, NULL, err.field[0] ? err.field : what, "%s", err.msg);
        return false;
    }
    b->lists[i].ids = ids;
    b->lists[i].n_ids = n;
    return true;
}

/* input: a string, a list of strings, a list of token ids, or a list of lists of token ids
 * (OpenAI's four shapes). */
static bool take_input(struct MHD_Connection *c, const tdm_http_vocab_t *voc, const json_t *in,
                       emb_body_t *b, enum MHD_Result *ret)
{
    bool one_string = json_is_string(in);
    bool one_tokens =
        json_is_array(in) && json_array_size(in) > 0 && json_is_integer(json_array_get(in, 0));
    if (!in || (!one_string && !json_is_array(in))) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, "input",
                      "input: required, a string, an array of strings, an array of token ids or "
                      "an array of arrays of token ids");
        return false;
    }
    b->n = one_string || one_tokens ? 1 : json_array_size(in);
    if (b->n == 0 || b->n > RT_EMBED_MAX_INPUTS) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, "input", "input: %zu inputs; a request takes 1..%u",
                      b->n, RT_EMBED_MAX_INPUTS);
        return false;
    }
    b->lists = calloc(b->n, sizeof *b->lists);
    b->listp = calloc(b->n, sizeof *b->listp);
    if (!b->lists || !b->listp) {
        *ret = REFUSE(c, TDM_ERESOURCE, NULL, NULL, "out of memory");
        return false;
    }
    for (size_t i = 0; i < b->n; i++) {
        tandem__v1__token_list__init(&b->lists[i]);
        b->listp[i] = &b->lists[i];
    }
    if (one_string)
        return take_text(c, voc, json_string_value(in), json_string_length(in), "input", b, 0, ret);
    if (one_tokens)
        return take_ids(c, voc, in, "input", b, 0, ret);
    /* a list: every element a string, or every element an array of ids */
    bool strings = json_is_string(json_array_get(in, 0));
    if (!strings && !json_is_array(json_array_get(in, 0))) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, "input[0]",
                      "input[0] must be a string, a token id or an array of token ids, got %s",
                      oai_type_name(json_array_get(in, 0)));
        return false;
    }
    for (size_t i = 0; i < b->n; i++) {
        const json_t *e = json_array_get(in, i);
        char what[32];
        snprintf(what, sizeof what, "input[%zu]", i);
        if (strings ? !json_is_string(e) : !json_is_array(e)) {
            *ret = REFUSE(c, TDM_EINVALID, NULL, what,
                          "%s: every element of input must be %s, like input[0] (got %s)", what,
                          strings ? "a string" : "an array of token ids", oai_type_name(e));
            return false;
        }
        if (strings
                ? !take_text(c, voc, json_string_value(e), json_string_length(e), what, b, i, ret)
                : !take_ids(c, voc, e, what, b, i, ret))
            return false;
    }
    return true;
}

/* The body's fields other than input; false with the reply in *ret. */
static bool take_fields(tdm_http_t *h, struct MHD_Connection *c, const json_t *root, emb_body_t *b,
                        enum MHD_Result *ret)
{
    const tdm_config_t *cfg = h->cfg;
    const json_t *model = json_object_get(root, "model");
    snprintf(b->served, sizeof b->served, "%s", cfg->models[0].name);
    if (model && !json_is_null(model)) {
        if (!json_is_string(model)) {
            *ret = REFUSE(c, TDM_EINVALID, NULL, "model", "model must be a string, got %s",
                          oai_type_name(model));
            return false;
        }
        int mi = tdm_config_model_index(cfg, json_string_value(model));
        if (mi < 0) {
            *ret = REFUSE(c, TDM_ENOTFOUND, "model_not_found", "model",
                          "The model '%.200s' does not exist", json_string_value(model));
            return false;
        }
        b->model_index = (size_t)mi;
        snprintf(b->served, sizeof b->served, "%s", json_string_value(model));
    }
    const json_t *fmt = json_object_get(root, "encoding_format");
    const char *f = json_string_value(fmt);
    if (fmt && !json_is_null(fmt) &&
        (!f || (strcmp(f, "float") != 0 && strcmp(f, "base64") != 0))) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, "encoding_format",
                      "encoding_format: '%.64s' is not one of 'float', 'base64'",
                      f ? f : "(not a string)");
        return false;
    }
    b->base64 = f && strcmp(f, "base64") == 0;
    const json_t *dims = json_object_get(root, "dimensions");
    if (dims && !json_is_null(dims)) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, "dimensions",
                      "dimensions: model '%s' does not support reducing the embedding "
                      "dimensions (its vectors have the model's hidden size; leave dimensions "
                      "out)",
                      b->served);
        return false;
    }
    const json_t *user = json_object_get(root, "user");
    if (user && !json_is_null(user) && !json_is_string(user)) {
        *ret = REFUSE(c, TDM_EINVALID, NULL, "user", "user: must be a string");
        return false;
    }
    const json_t *pool = json_object_get(root, "pooling");
    const char *p = json_string_value(pool);
    b->pooling = TANDEM__V1__POOLING__POOLING_LAST;
    if (pool && !json_is_null(pool)) {
        if (p && strcmp(p, "mean") == 0)
            b->pooling = TANDEM__V1__POOLING__POOLING_MEAN;
        else if (!p || strcmp(p, "last") != 0) {
            *ret =
                REFUSE(c, TDM_EINVALID, NULL, "pooling",
                       "pooling: '%.64s' is not one of 'last', 'mean'", p ? p : "(not a string)");
            return false;
        }
    }
    return true;
}

/* One vector as JSON: an array of numbers, or its float32 bytes in base64. */
static json_t *vector_json(const float *v, size_t n, bool base64)
{
    if (!base64) {
        json_t *a = json_array();
        for (size_t i = 0; a && i < n; i++)
            json_array_append_new(a, json_real((double)v[i]));
        return a;
    }
    size_t bytes = n * sizeof(float);
    unsigned char *raw = malloc(bytes ? bytes : 1);
    size_t cap = sodium_base64_ENCODED_LEN(bytes, sodium_base64_VARIANT_ORIGINAL);
    char *text = malloc(cap);
    json_t *s = NULL;
    if (raw && text) {
        for (size_t i = 0; i < n; i++) { /* little-endian whatever the host */
            uint32_t u;
            memcpy(&u, &v[i], sizeof u);
            for (int k = 0; k < 4; k++)
                raw[i * 4 + (size_t)k] = (unsigned char)(u >> (8 * k));
        }
        sodium_bin2base64(text, cap, raw, bytes, sodium_base64_VARIANT_ORIGINAL);
        s = json_string(text);
    }
    free(raw);
    free(text);
    return s;
}

static json_t *answer_json(const Tandem__V1__EmbedResponse *resp, const emb_body_t *b)
{
    json_t *data = json_array();
    for (size_t i = 0; data && i < resp->n_data; i++) {
        const Tandem__V1__Embedding *e = resp->data[i];
        json_array_append_new(
            data, json_pack("{s:s, s:I, s:o}", "object", "embedding", "index", (json_int_t)e->index,
                            "embedding", vector_json(e->embedding, e->n_embedding, b->base64)));
    }
    return json_pack("{s:s, s:o, s:s, s:{s:I, s:I}}", "object", "list", "data", data, "model",
                     b->served, "usage", "prompt_tokens", (json_int_t)resp->prompt_tokens,
                     "total_tokens", (json_int_t)resp->prompt_tokens);
}

/* A request's EMBED call (r->emb): owned by its gateway call (emb_free is its req_free), read
 * by the HTTP side while it holds the call. */
struct emb_call {
    emb_body_t b;
    Tandem__V1__EmbedRequest req; /* points into b and rid */
    char rid[TDM_REQUEST_ID_MAX + 1];
    gw_call_t *call;
};

static void emb_free(void *arg)
{
    struct emb_call *e = arg;
    body_free(&e->b);
    free(e);
}

enum MHD_Result http_embeddings(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r)
{
    enum MHD_Result ret;
    if (!http_check_key(h, c, &ret))
        return ret;
    json_error_t je;
    json_t *root = json_loadb(r->body.data ? r->body.data : "", r->body.len, 0, &je);
    if (!root && json_error_code(&je) == json_error_null_character)
        return REFUSE(c, TDM_EINVALID, NULL, NULL,
                      "a string of the body holds \\u0000 (line %d, column %d): inputs cannot "
                      "contain NUL characters",
                      je.line, je.column);
    if (!root || !json_is_object(root)) {
        ret = REFUSE(c, TDM_EINVALID, NULL, NULL, "the body must be a JSON object%s%s",
                     root ? "" : ": ", root ? "" : je.text);
        json_decref(root);
        return ret;
    }
    struct emb_call *e = calloc(1, sizeof *e);
    if (!e) {
        json_decref(root);
        return REFUSE(c, TDM_ERESOURCE, NULL, NULL, "out of memory");
    }
    emb_body_t *b = &e->b;
    if (!take_fields(h, c, root, b, &ret))
        goto out_free;
    const tdm_http_vocab_t *voc = &h->vocabs[b->model_index];
    if (!voc->tok) {
        ret = REFUSE(c, TDM_EUNAVAILABLE, NULL, NULL, "the router has no tokenizer");
        goto out_free;
    }
    if (!take_input(c, voc, json_object_get(root, "input"), b, &ret))
        goto out_free;
    json_decref(root);
    tandem__v1__embed_request__init(&e->req);
    snprintf(e->rid, sizeof e->rid, "%s", r->rid);
    e->req.request_id = e->rid;
    e->req.model = b->served;
    e->req.token_inputs = b->listp;
    e->req.n_token_inputs = b->n;
    e->req.pooling = b->pooling;
    /* the call may wait long (the router's queue, the nodes): no idle timeout meanwhile */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    tdm_error_t err = {0};
    e->call =
        gw_unary_start(h->gw, TANDEM__V1__METHOD__METHOD_EMBED, &e->req.base,
                       &tandem__v1__embed_response__descriptor, EMBED_TIMEOUT_S, emb_free, e, &err);
    if (!e->call) /* e is freed */
        return REFUSE(c, err.code, NULL, NULL, "%s", err.msg);
    r->emb = e;
    pthread_mutex_lock(&h->mu);
    h->n_calls++; /* drained at shutdown like a generate call */
    pthread_mutex_unlock(&h->mu);
    return http_embeddings_resume(h, c, r);
out_free:
    emb_free(e);
    json_decref(root);
    return ret;
}

/* The OpenAI param of a field the router's EMBED refusal names: its token_inputs are this
 * request's input; NULL for none. */
static const char *http_param(const char *field)
{
    if (!field[0])
        return NULL;
    return strncmp(field, "token_inputs", 12) == 0 ? "input" : field;
}

enum MHD_Result http_embeddings_resume(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r)
{
    struct emb_call *e = r->emb;
    for (;;) {
        gw_event_t *ev = NULL;
        gw_parker_t pk = http_parker(c);
        if (http_client_gone(r->fd) || gw_call_take(e->call, r->fd, &pk, &ev) != TDM_OK) {
            tdm_log_write(&h->log, TDM_LOG_INFO, e->rid, NULL,
                          "http client disconnected before the embeddings: call cancelled");
            gw_call_cancel(e->call);
            return MHD_NO;
        }
        if (!ev)
            return MHD_YES; /* parked */
        if (ev->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
            gw_event_free(ev); /* a unary call has no stream */
            continue;
        }
        /* the answer is ours to send: a client that stops reading times out */
        MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                                  (unsigned)h->cfg->router.http_connection_timeout_s);
        enum MHD_Result ret;
        if (ev->status != TDM_OK)
            ret = REFUSE(c, ev->status, NULL, http_param(ev->detail.field), "%s",
                         ev->message[0] ? ev->message : tdm_strerror(ev->status));
        else if (!ev->resp)
            ret = REFUSE(c, TDM_EINTERNAL, NULL, NULL, "the router's EMBED answer is missing");
        else
            ret = http_reply_json(c, 200,
                                  answer_json((const Tandem__V1__EmbedResponse *)ev->resp, &e->b));
        gw_event_free(ev);
        return ret;
    }
}

void http_embeddings_end(tdm_http_t *h, http_req_t *r, int toe)
{
    gw_call_t *call = r->emb->call; /* r->emb is freed with the call's last reference */
    r->emb = NULL;
    if (!gw_call_ended(call)) {
        tdm_log_write(&h->log, TDM_LOG_INFO, r->rid, NULL,
                      "http request ended before its embeddings (termination %d): cancelled", toe);
        gw_call_cancel(call);
    }
    gw_call_release(&call);
    pthread_mutex_lock(&h->mu);
    if (--h->n_calls == 0)
        pthread_cond_broadcast(&h->idle);
    pthread_mutex_unlock(&h->mu);
}
