/* http_endpoints.c - the HTTP gateway's routing and its endpoints other than generation:
 * /v1/models, /health, /ready, /metrics, the dashboard and its /api/ calls, /tokenize,
 * /detokenize, /version and OPTIONS. Each answers from one short unary call to the router
 * (HTTP_UNARY_TIMEOUT_S at most) or from the gateway's own state.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <microhttpd.h>

#include "http_gateway.h"
#include "http_openai.h"
#include "http_json.h"
#include "http_conv.h"
#include "http_tokenize.h"
#include "dashboard.h"
#include "http_metrics.h"
#include "http_server.h"
#include "http_responses.h"
#include "tandem/limits.h"

/* Whether s has a Unicode format character (tdm_unicode_is_format) among its well-formed UTF-8
 * characters: *at its byte offset, *cp the character. */
static bool format_char_at(const char *s, size_t *at, uint32_t *cp)
{
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t len = tdm_utf8_decode((const unsigned char *)s + i, n - i, cp);
        if (len && tdm_unicode_is_format(*cp)) {
            *at = i;
            return true;
        }
        i += len ? len : 1;
    }
    return false;
}

static enum MHD_Result handle_models(tdm_http_t *h, struct MHD_Connection *c, const char *id)
{
    enum MHD_Result ret;
    if (!http_check_key(h, c, &ret))
        return ret;
    Tandem__V1__ModelsRequest req = TANDEM__V1__MODELS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_MODELS, &req.base,
                      &tandem__v1__models_response__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, &err);
    if (rc != TDM_OK)
        return http_reply_error(c, rc, NULL, NULL, "%s", err.msg);
    Tandem__V1__ModelsResponse *mr = (Tandem__V1__ModelsResponse *)resp;
    json_t *data = json_array();
    json_t *found = NULL;
    for (size_t i = 0; data && i < mr->n_models; i++) {
        const Tandem__V1__ModelInfo *mi = mr->models[i];
        json_t *o =
            json_pack("{s:o, s:s, s:I, s:s, s:o, s:n, s:i}", "id", http_json_str(mi->name),
                      "object", "model", "created", (json_int_t)h->started, "owned_by", "tandem",
                      "root", http_json_str(mi->name), "parent", "max_model_len", (int)mi->n_ctx);
        if (!o)
            continue;
        /* Tandem's own: the model's other served names, and whether a decode node of it is up
         * ("ready") or none is ("unavailable": its requests wait) */
        json_t *aliases = json_array();
        bool named = id && strcmp(id, mi->name) == 0;
        for (size_t j = 0; aliases && j < mi->n_aliases; j++) {
            json_array_append_new(aliases, http_json_str(mi->aliases[j]));
            named = named || (id && strcmp(id, mi->aliases[j]) == 0);
        }
        json_object_set_new(o, "aliases", aliases ? aliases : json_array());
        json_object_set_new(o, "state", http_json_str(mi->state[0] ? mi->state : "ready"));
        if (named)
            found = json_incref(o);
        json_array_append_new(data, o);
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    if (id) {
        json_decref(data);
        size_t at = 0;
        uint32_t cp = 0;
        if (!found && format_char_at(id, &at, &cp))
            return http_reply_error(c, TDM_EINVALID, NULL, "model",
                                    "model: byte %zu is U+%04" PRIX32 ", an invisible format "
                                    "character (Unicode category Cf: a bidi control, a zero-width "
                                    "character); a model name is printable UTF-8",
                                    at, cp);
        if (!found)
            return http_reply_error(c, TDM_ENOTFOUND, "model_not_found", "model",
                                    "The model '%s' does not exist", id);
        return http_reply_json(c, 200, found);
    }
    return http_reply_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

static enum MHD_Result handle_ready(tdm_http_t *h, struct MHD_Connection *c)
{
    /* HealthResponse.ready is the router's readiness rule: at least one decode node is up and
     * not suspect (decode nodes prefill locally, so prefill nodes are optional) */
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_HEALTH, &req.base,
                      &tandem__v1__health_response__descriptor, 2.0, &resp, &err);
    if (rc != TDM_OK)
        return http_reply_json(
            c, 503,
            json_pack("{s:s, s:o}", "status", "unavailable", "message", http_json_str(err.msg)));
    Tandem__V1__HealthResponse *hr = (Tandem__V1__HealthResponse *)resp;
    bool ready = hr->ready;
    json_t *v = json_pack("{s:s, s:b, s:o}", "status", ready ? "ready" : "not ready", "ready",
                          ready, "version", http_json_str(hr->version));
    /* refused registrations with their reason: why an expected node is missing (node ids
     * and model details, so only for a request that may see the cluster's state: /ready
     * itself is open to probes) */
    json_t *refused = v && http_state_key_ok(h, c, NULL) ? json_array() : NULL;
    for (size_t i = 0; refused && i < hr->n_refused; i++)
        json_array_append_new(refused, json_pack("{s:o, s:o, s:f, s:I}", "node_id",
                                                 http_json_str(hr->refused[i]->node_id), "reason",
                                                 http_json_str(hr->refused[i]->reason), "age_s",
                                                 hr->refused[i]->age_s, "count",
                                                 (json_int_t)hr->refused[i]->count));
    if (refused)
        json_object_set_new(v, "refused", refused);
    protobuf_c_message_free_unpacked(resp, NULL);
    if (v && !ready)
        json_object_set_new(v, "message",
                            json_string("no decode node is up and answering (a suspect node, "
                                        "silent past the heartbeat timeout, does not count; "
                                        "decode nodes serve alone, prefill nodes are optional)"));
    return http_reply_json(c, ready ? 200 : 503, v);
}

static enum MHD_Result handle_metrics(tdm_http_t *h, struct MHD_Connection *c)
{
    Tandem__V1__MetricsRequest req = TANDEM__V1__METRICS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_METRICS, &req.base,
                      &tandem__v1__metrics_response__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, &err);
    if (rc != TDM_OK) {
        char msg[TDM_ERRMSG_MAX + 32];
        int n = snprintf(msg, sizeof msg, "metrics unavailable: %s\n", err.msg);
        return http_reply(c, tdm_status_info(rc)->http_status, "text/plain; charset=utf-8", msg,
                          n > 0 && (size_t)n < sizeof msg ? (size_t)n : strlen(msg));
    }
    /* the one place the metrics become text, with the gateway's own counters */
    tdm_buf_t text = TDM_BUF_INIT;
    rc = http_counters_append(h->counters, (Tandem__V1__MetricsResponse *)resp);
    if (rc == TDM_OK)
        rc = tdm_proto_metrics_text((const Tandem__V1__MetricsResponse *)resp, &text);
    protobuf_c_message_free_unpacked(resp, NULL);
    enum MHD_Result ret =
        rc == TDM_OK ? http_reply(c, 200, "text/plain; version=0.0.4; charset=utf-8",
                                  text.data ? text.data : "", text.len)
                     : http_reply(c, 500, "text/plain; charset=utf-8", "out of memory\n", 14);
    tdm_buf_free(&text);
    return ret;
}

static const char *query_get(void *ctx, const char *name)
{
    return MHD_lookup_connection_value(ctx, MHD_GET_ARGUMENT_KIND, name);
}

/* POST /tokenize and /detokenize (http_tokenize.c), with the router's tokenizer. */
static enum MHD_Result handle_tokenize(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r,
                                       bool detokenize)
{
    enum MHD_Result ret;
    if (!http_check_key(h, c, &ret))
        return ret;
    const char *body = r->body.data ? r->body.data : "";
    /* the model the body names, when it is one of the served names (else the first model's
     * name, which the body's model then fails to match: 404) */
    const char *served = h->cfg->models[0].name;
    size_t mi = 0;
    json_t *root = json_loadb(body, r->body.len, 0, NULL);
    const char *asked = json_string_value(json_object_get(root, "model"));
    int found = asked ? tdm_config_model_index(h->cfg, asked) : -1;
    char name[TDM_MODEL_NAME_MAX + 1];
    if (found >= 0) {
        mi = (size_t)found;
        snprintf(name, sizeof name, "%s", asked);
        served = name;
    }
    json_decref(root);
    const tdm_http_vocab_t *voc = &h->vocabs[mi];
    if (!voc->tok)
        return http_reply_error(c, TDM_EUNAVAILABLE, NULL, NULL, "the router has no tokenizer");
    unsigned status = 500;
    json_t *v = detokenize ? http_detokenize_json(voc, served, body, r->body.len, &status)
                           : http_tokenize_json(voc, served, body, r->body.len, &status);
    return http_reply_json(c, status, v);
}

/* A POST endpoint's refusals before its handler: 405 for another method, 413 for a body over
 * TDM_HTTP_MAX_BODY_BYTES. true with *ret set when refused. */
static bool post_refused(struct MHD_Connection *c, const http_req_t *r, const char *url,
                         const char *method, enum MHD_Result *ret)
{
    if (strcmp(method, "POST") != 0)
        *ret = http_reply_bad_http(c, 405, "method_not_allowed", "%s %s: use POST", method, url);
    else if (r->too_large)
        *ret = http_reply_bad_http(c, 413, "request_too_large",
                                   "the request body is larger than %u bytes",
                                   TDM_HTTP_MAX_BODY_BYTES);
    else
        return false;
    return true;
}

/* OPTIONS (any path), /tokenize, /detokenize and /version; false when url is none of them. */
static bool route_conv(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, const char *url,
                       const char *method, enum MHD_Result *ret)
{
    if (strcmp(method, "OPTIONS") == 0) {
        if (!r->rid[0])
            http_request_id_new(r->rid, sizeof r->rid);
        *ret = (enum MHD_Result)http_options(h->cfg, c, r->rid);
        return true;
    }
    bool tok = strcmp(url, "/tokenize") == 0, detok = strcmp(url, "/detokenize") == 0;
    if (tok || detok) {
        if (!post_refused(c, r, url, method, ret))
            *ret = handle_tokenize(h, c, r, detok);
        return true;
    }
    if (strcmp(url, "/version") != 0)
        return false;
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        *ret = http_reply_bad_http(c, 405, "method_not_allowed", "%s %s: use GET", method, url);
    else
        *ret = http_reply_json(c, 200, json_pack("{s:s}", "version", TANDEM_VERSION));
    return true;
}

/* POST /v1/responses, GET and DELETE /v1/responses/{id} (http_responses.c); false when url is
 * none of them. */
static bool route_responses(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, const char *url,
                            const char *method, enum MHD_Result *ret)
{
    if (strcmp(url, "/v1/responses") == 0) {
        if (!post_refused(c, r, url, method, ret))
            *ret = http_responses(h, c, r);
        return true;
    }
    if (strncmp(url, "/v1/responses/", 14) != 0 || !url[14])
        return false;
    bool del = strcmp(method, "DELETE") == 0;
    if (!del && strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        *ret = http_reply_bad_http(c, 405, "method_not_allowed", "%s %s: use GET or DELETE", method,
                                   url);
    else
        *ret = http_responses_item(h, c, url + 14, del);
    return true;
}

/* ---- the access handler ---- */

/* GET /api/status: the dashboard's status with every served model's shape. */
static enum MHD_Result handle_api_status(tdm_http_t *h, struct MHD_Connection *c)
{
    http_model_t m;
    tdm_error_t err = {0};
    bool have = http_model_get(h, &m, &err) == TDM_OK;
    static const size_t cap = TDM_CONFIG_MAX_MODELS;
    http_model_t *all = malloc(cap * sizeof *all);
    size_t n_all = 0;
    if (all && http_models_all(h, all, cap, &n_all, &err) != TDM_OK)
        n_all = 0;
    json_t *v =
        dash_status_json(h->dash, n_all ? all : (have ? &m : NULL), n_all ? n_all : (have ? 1 : 0));
    free(all);
    return http_reply_json(c, 200, v);
}

/* GET /api/capacity: the plan of the model ?node=ID serves (several models; a different
 * ?model= is a 400), else of ?model=NAME, else the first model's. */
static enum MHD_Result handle_api_capacity(tdm_http_t *h, struct MHD_Connection *c)
{
    http_model_t m;
    tdm_error_t err = {0};
    bool have = http_model_get(h, &m, &err) == TDM_OK;
    const char *want = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "model");
    const char *node = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "node");
    char node_model[TDM_MODEL_NAME_MAX + 1] = "";
    if (node && h->cfg->n_models > 1 &&
        http_node_model(h, node, node_model, sizeof node_model, &err) == TDM_OK && node_model[0]) {
        /* a node's pool is planned with the shape of the model it serves */
        if (want && want[0] && tdm_config_model_index(h->cfg, want) >= 0 &&
            tdm_config_model_index(h->cfg, want) != tdm_config_model_index(h->cfg, node_model))
            return http_reply_error(c, TDM_EINVALID, NULL, "model",
                                    "model: node %.64s serves %.64s, not %.64s (give one of "
                                    "node and model, or the node's own model)",
                                    node, node_model, want);
        want = node_model;
    }
    if (want && want[0]) {
        int rc = http_model_named(h, want, &m, &err);
        if (rc == TDM_ENOTFOUND)
            return http_reply_error(c, rc, "model_not_found", "model", "%s", err.msg);
        have = rc == TDM_OK;
    }
    unsigned status = 200;
    json_t *v = dash_capacity_json(h->dash, have ? &m : NULL, query_get, c, &status);
    return http_reply_json(c, status, v);
}

enum MHD_Result http_route(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, const char *url,
                           const char *method)
{
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    enum MHD_Result ret;
    if (route_conv(h, c, r, url, method, &ret))
        return ret;
    if (strcmp(url, "/v1/completions") == 0 || strcmp(url, "/v1/chat/completions") == 0) {
        if (post_refused(c, r, url, method, &ret))
            return ret;
        return http_generate(h, c, r,
                             strcmp(url, "/v1/completions") == 0 ? OAI_COMPLETION : OAI_CHAT);
    }
    if (route_responses(h, c, r, url, method, &ret))
        return ret;
    if (strcmp(url, "/v1/embeddings") == 0) {
        if (post_refused(c, r, url, method, &ret))
            return ret;
        return http_embeddings(h, c, r);
    }
    if (r->too_large)
        return http_reply_bad_http(c, 413, "request_too_large",
                                   "the request body is larger than %u bytes",
                                   TDM_HTTP_MAX_BODY_BYTES);
    bool known = strcmp(url, "/") == 0 || strcmp(url, "/health") == 0 ||
                 strcmp(url, "/ready") == 0 || strcmp(url, "/metrics") == 0 ||
                 strcmp(url, "/api/status") == 0 || strcmp(url, "/api/capacity") == 0 ||
                 strcmp(url, "/v1/models") == 0 || strncmp(url, "/v1/models/", 11) == 0;
    if (!known)
        return http_reply_error(c, TDM_ENOTFOUND, "not_found", NULL,
                                "no such endpoint: %s %s (see docs/api.md, HTTP API)", method, url);
    if (!get)
        return http_reply_bad_http(c, 405, "method_not_allowed", "%s %s: use GET", method, url);
    bool state = strcmp(url, "/") == 0 || strcmp(url, "/metrics") == 0 ||
                 strcmp(url, "/api/status") == 0 || strcmp(url, "/api/capacity") == 0;
    if (state && !http_check_state_key(h, c, &ret))
        return ret;
    if (strcmp(url, "/") == 0)
        return http_reply(c, 200, "text/html; charset=utf-8", tdm_dashboard_html,
                          tdm_dashboard_html_len);
    if (strcmp(url, "/health") == 0)
        return http_reply(c, 200, "application/json", "{\"status\":\"ok\"}\n", 16);
    if (strcmp(url, "/ready") == 0)
        return handle_ready(h, c);
    if (strcmp(url, "/metrics") == 0)
        return handle_metrics(h, c);
    if (strcmp(url, "/v1/models") == 0)
        return handle_models(h, c, NULL);
    if (strncmp(url, "/v1/models/", 11) == 0)
        return handle_models(h, c, url + 11);
    if (strcmp(url, "/api/status") == 0)
        return handle_api_status(h, c);
    return handle_api_capacity(h, c);
}
