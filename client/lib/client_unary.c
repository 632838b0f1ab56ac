/* client_unary.c - the blocking calls (Generate, and the unary Health, Models and Status) and
 * async unary calls, with the conversion of their responses to the client's structs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

int tdm_client_generate(tdm_client_t *c, const tdm_client_request_t *req,
                        tdm_client_chunk_fn on_chunk, void *user, tdm_client_result_t *result)
{
    tdm_client_result_init(result);
    int rc;
    if (c->depth > 0) {
        rc = tdm_error_set(&c->err, TDM_EPRECONDITION,
                           "client: tdm_client_generate called from a callback");
        goto out_fail;
    }
    client_call_t *call;
    rc = tdm_client_generate_begin(c, req, on_chunk, NULL, user, true, &call);
    if (rc != TDM_OK)
        goto out_fail;
    tdm_client_call_wait(c, call);
    *result = call->result; /* moves the owned buffers out */
    tdm_client_result_init(&call->result);
    tdm_client_call_free(call);
    if (result->status != TDM_OK)
        tdm_error_set(&c->err, result->status, "%s", result->message);
    if (!result->text)
        result->text = tdm_strdup("");
    return result->status;

out_fail:
    result->status = rc;
    snprintf(result->message, sizeof result->message, "%s", c->err.msg);
    result->finish_reason = TDM_CLIENT_FINISH_ERROR;
    result->text = tdm_strdup("");
    result->request_id = tdm_strdup("");
    result->stop_reason = tdm_strdup("");
    return rc;
}

int tdm_client_call_start(tdm_client_t *c, int method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                          tdm_client_unary_fn on_done, void *user, uint64_t *call_id)
{
    tdm_error_clear(&c->err);
    if (!on_done || !req || !resp_desc)
        return tdm_error_set(&c->err, TDM_EINVALID, "client: on_done, req or resp_desc is NULL");
    if (method == TANDEM__V1__METHOD__METHOD_GENERATE)
        return tdm_error_set(&c->err, TDM_EINVALID,
                             "client: GENERATE streams; use tdm_client_generate_start");
    if (isnan(timeout_s))
        return tdm_error_set(&c->err, TDM_EINVALID, "client: timeout_s is NaN");
    client_call_t *call = tdm_client_call_new(c, method, CALL_UNARY);
    if (!call)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    call->resp_desc = resp_desc;
    call->on_unary = on_done;
    call->user = user;
    uint64_t id = call->id;
    int rc = tdm_client_call_send(c, call, req, timeout_s);
    if (rc == TDM_OK && call_id)
        *call_id = id;
    return rc;
}

/* A blocking unary call: *resp (caller frees with protobuf_c_message_free_unpacked) on 0. */
static int unary_call(tdm_client_t *c, int method, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                      ProtobufCMessage **resp)
{
    tdm_error_clear(&c->err);
    c->err_field[0] = '\0';
    *resp = NULL;
    if (c->depth > 0)
        return tdm_error_set(&c->err, TDM_EPRECONDITION,
                             "client: a blocking %s call from a callback",
                             tdm_net_method_name(method));
    if (isnan(timeout_s))
        return tdm_error_set(&c->err, TDM_EINVALID, "client: timeout_s is NaN");
    client_call_t *call = tdm_client_call_new(c, method, CALL_UNARY);
    if (!call)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    call->sync = true;
    call->resp_desc = resp_desc;
    int rc = tdm_client_call_send(c, call, req, timeout_s);
    if (rc != TDM_OK)
        return rc;
    tdm_client_call_wait(c, call);
    rc = call->result.status;
    if (rc == TDM_OK) {
        *resp = call->resp;
        call->resp = NULL;
    } else {
        /* the field the router's ErrorDetail names (EMBED's refusals): tdm_client_errfield */
        const char *field = call->result.error.field;
        snprintf(c->err_field, sizeof c->err_field, "%s", field);
        tdm_error_set_field(&c->err, rc, field[0] ? field : NULL, "%s: %s",
                            tdm_net_method_name(method), call->result.message);
    }
    tdm_client_call_free(call);
    return rc;
}

int tdm_client_health(tdm_client_t *c, double timeout_s, tdm_client_health_t *out)
{
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_HEALTH, &req.base,
                        &tandem__v1__health_response__descriptor, timeout_s, &resp);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__HealthResponse *h = (const Tandem__V1__HealthResponse *)resp;
    memset(out, 0, sizeof *out);
    out->live = h->live;
    out->ready = h->ready;
    snprintf(out->version, sizeof out->version, "%s", str_or_empty(h->version));
    protobuf_c_message_free_unpacked(resp, NULL);
    return TDM_OK;
}

void tdm_client_models_clear(tdm_client_models_t *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_models; i++) {
        free(m->models[i].name);
        free(m->models[i].chat_template);
        free(m->models[i].state);
    }
    free(m->models);
    m->models = NULL;
    m->n_models = 0;
}

int tdm_client_models(tdm_client_t *c, double timeout_s, tdm_client_models_t *out)
{
    memset(out, 0, sizeof *out);
    Tandem__V1__ModelsRequest req = TANDEM__V1__MODELS_REQUEST__INIT;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_MODELS, &req.base,
                        &tandem__v1__models_response__descriptor, timeout_s, &resp);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__ModelsResponse *m = (const Tandem__V1__ModelsResponse *)resp;
    if (m->n_models > 0) {
        out->models = calloc(m->n_models, sizeof *out->models);
        if (!out->models)
            goto out_oom;
    }
    for (size_t i = 0; i < m->n_models; i++) {
        const Tandem__V1__ModelInfo *mi = m->models[i];
        tdm_client_model_t *dst = &out->models[i];
        out->n_models = i + 1;
        dst->name = tdm_strdup(str_or_empty(mi->name));
        dst->chat_template = tdm_strdup(str_or_empty(mi->chat_template));
        dst->state = tdm_strdup(str_or_empty(mi->state));
        if (!dst->name || !dst->chat_template || !dst->state)
            goto out_oom;
        dst->prefill_nodes_up = mi->prefill_nodes_up;
        dst->decode_nodes_up = mi->decode_nodes_up;
        dst->requests_running = mi->requests_running;
        dst->requests_queued = mi->requests_queued;
        dst->fingerprint = mi->fingerprint;
        dst->n_ctx = mi->n_ctx;
        dst->n_vocab = mi->n_vocab;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return TDM_OK;

out_oom:
    tdm_client_models_clear(out);
    protobuf_c_message_free_unpacked(resp, NULL);
    return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
}

void tdm_client_cluster_status_clear(tdm_client_cluster_status_t *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_nodes; i++) {
        free(s->nodes[i].node_id);
        free(s->nodes[i].role);
        free(s->nodes[i].device);
        free(s->nodes[i].refused_reason);
        free(s->nodes[i].host_id);
        free(s->nodes[i].gpu_uuid);
        free(s->nodes[i].model);
    }
    free(s->nodes);
    for (size_t i = 0; i < s->n_kv_routes; i++) {
        free(s->kv_routes[i].prefill_node_id);
        free(s->kv_routes[i].decode_node_id);
        free(s->kv_routes[i].transport);
    }
    free(s->kv_routes);
    for (size_t i = 0; i < s->n_refused; i++) {
        free(s->refused[i].node_id);
        free(s->refused[i].reason);
    }
    free(s->refused);
    free(s->version);
    free(s->model);
    memset(s, 0, sizeof *s);
}

/* Copies one NodeStatus into *d. TDM_ERESOURCE on out of memory (what was copied stays in *d
 * for tdm_client_cluster_status_clear). */
static int node_status_from_proto(const Tandem__V1__NodeStatus *ns, tdm_client_node_status_t *d)
{
    d->node_id = tdm_strdup(str_or_empty(ns->node_id));
    d->role = tdm_strdup(str_or_empty(ns->role));
    d->device = tdm_strdup(str_or_empty(ns->device));
    d->refused_reason = tdm_strdup(str_or_empty(ns->refused_reason));
    d->host_id = tdm_strdup(str_or_empty(ns->host_id));
    d->gpu_uuid = tdm_strdup(str_or_empty(ns->gpu_uuid));
    d->model = tdm_strdup(str_or_empty(ns->model));
    if (!d->node_id || !d->role || !d->device || !d->refused_reason || !d->host_id ||
        !d->gpu_uuid || !d->model)
        return TDM_ERESOURCE;
    d->refused_age_s = ns->refused_age_s;
    d->instance_id = ns->instance_id;
    d->up = ns->up;
    d->suspect = ns->suspect;
    static const Tandem__V1__NodeLoad no_load = TANDEM__V1__NODE_LOAD__INIT;
    const Tandem__V1__NodeLoad *ld = ns->load ? ns->load : &no_load;
    d->kv_blocks_total = ns->kv_blocks_total;
    d->kv_layer_groups = ns->kv_layer_groups;
    d->kv_blocks_used = ld->kv_blocks_used;
    d->kv_blocks_cached = ld->kv_blocks_cached;
    d->reserved_blocks = ns->reserved_blocks;
    d->running = ld->running;
    d->waiting = ld->waiting;
    d->batch_size = ld->batch_size;
    d->queued_prefill_tokens = ld->queued_prefill_tokens;
    d->prefix_queries = ld->prefix_queries;
    d->prefix_hits = ld->prefix_hits;
    d->step_time_s = ld->step_s;
    d->last_heartbeat_age_s = ns->last_heartbeat_age_s;
    return TDM_OK;
}

/* Copies the KV routes of m into *out. TDM_ERESOURCE on out of memory (partial). */
static int kv_routes_from_proto(const Tandem__V1__ClusterStatus *m,
                                tdm_client_cluster_status_t *out)
{
    if (m->n_kv_routes > 0 && !(out->kv_routes = calloc(m->n_kv_routes, sizeof *out->kv_routes)))
        return TDM_ERESOURCE;
    for (size_t i = 0; i < m->n_kv_routes; i++) {
        tdm_client_kv_route_t *d = &out->kv_routes[i];
        out->n_kv_routes = i + 1;
        d->prefill_node_id = tdm_strdup(str_or_empty(m->kv_routes[i]->prefill_node_id));
        d->decode_node_id = tdm_strdup(str_or_empty(m->kv_routes[i]->decode_node_id));
        d->transport = tdm_strdup(str_or_empty(m->kv_routes[i]->transport));
        if (!d->prefill_node_id || !d->decode_node_id || !d->transport)
            return TDM_ERESOURCE;
    }
    return TDM_OK;
}

/* Copies the nodes, the refused registrations and the KV routes of m into *out. TDM_ERESOURCE on
 * out of memory (partial; the caller clears). */
static int cluster_lists_from_proto(const Tandem__V1__ClusterStatus *m,
                                    tdm_client_cluster_status_t *out)
{
    if (m->n_nodes > 0 && !(out->nodes = calloc(m->n_nodes, sizeof *out->nodes)))
        return TDM_ERESOURCE;
    for (size_t i = 0; i < m->n_nodes; i++) {
        out->n_nodes = i + 1;
        if (node_status_from_proto(m->nodes[i], &out->nodes[i]) != TDM_OK)
            return TDM_ERESOURCE;
    }
    if (m->n_refused > 0 && !(out->refused = calloc(m->n_refused, sizeof *out->refused)))
        return TDM_ERESOURCE;
    for (size_t i = 0; i < m->n_refused; i++) {
        tdm_client_refused_t *d = &out->refused[i];
        out->n_refused = i + 1;
        d->node_id = tdm_strdup(str_or_empty(m->refused[i]->node_id));
        d->reason = tdm_strdup(str_or_empty(m->refused[i]->reason));
        if (!d->node_id || !d->reason)
            return TDM_ERESOURCE;
        d->age_s = m->refused[i]->age_s;
        d->count = m->refused[i]->count;
    }
    return kv_routes_from_proto(m, out);
}

int tdm_client_status(tdm_client_t *c, double timeout_s, tdm_client_cluster_status_t *out)
{
    memset(out, 0, sizeof *out);
    Tandem__V1__StatusRequest req = TANDEM__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_STATUS, &req.base,
                        &tandem__v1__cluster_status__descriptor, timeout_s, &resp);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__ClusterStatus *m = (const Tandem__V1__ClusterStatus *)resp;
    out->version = tdm_strdup(str_or_empty(m->version));
    out->model = tdm_strdup(str_or_empty(m->model));
    out->requests_running = m->requests_running;
    out->requests_queued = m->requests_queued;
    out->requests_total = m->requests_total;
    out->router_instance_id = m->router_instance_id;
    rc = out->version && out->model ? cluster_lists_from_proto(m, out) : TDM_ERESOURCE;
    protobuf_c_message_free_unpacked(resp, NULL);
    if (rc != TDM_OK) {
        tdm_client_cluster_status_clear(out);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    return TDM_OK;
}

const tdm_client_node_status_t *tdm_client_status_find_node(const tdm_client_cluster_status_t *s,
                                                            const char *node_id)
{
    for (size_t i = 0; i < s->n_nodes; i++)
        if (strcmp(s->nodes[i].node_id, node_id) == 0)
            return &s->nodes[i];
    return NULL;
}

/* ---- Embed ---- */

void tdm_client_embeddings_clear(tdm_client_embeddings_t *e)
{
    if (!e)
        return;
    free(e->values);
    free(e->prompt_tokens);
    free(e->model);
    memset(e, 0, sizeof *e);
}

/* The answer into *out: every input once, in order, of one width. */
static int embeddings_take(tdm_client_t *c, const Tandem__V1__EmbedResponse *m, size_t n_inputs,
                           tdm_client_embeddings_t *out)
{
    if (m->n_data != n_inputs || n_inputs == 0 || !m->data[0])
        return tdm_error_set(&c->err, TDM_EINTERNAL,
                             "client: the EMBED answer has %zu vectors for %zu inputs", m->n_data,
                             n_inputs);
    size_t d = m->data[0]->n_embedding;
    out->values = malloc(n_inputs * (d ? d : 1) * sizeof *out->values);
    out->prompt_tokens = calloc(n_inputs, sizeof *out->prompt_tokens);
    out->model = tdm_strdup(m->model ? m->model : "");
    if (!out->values || !out->prompt_tokens || !out->model)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    for (size_t i = 0; i < n_inputs; i++) {
        const Tandem__V1__Embedding *e = m->data[i];
        if (!e || e->index != i || e->n_embedding != d)
            return tdm_error_set(&c->err, TDM_EINTERNAL,
                                 "client: the EMBED answer's vector %zu is not input %zu's of "
                                 "%zu values",
                                 i, i, d);
        memcpy(out->values + i * d, e->embedding, d * sizeof *out->values);
        out->prompt_tokens[i] = e->prompt_tokens;
    }
    out->n = n_inputs;
    out->n_embd = (uint32_t)d;
    out->total_prompt_tokens = m->prompt_tokens;
    return TDM_OK;
}

int tdm_client_embed(tdm_client_t *c, const tdm_client_embed_req_t *req, double timeout_s,
                     tdm_client_embeddings_t *out)
{
    memset(out, 0, sizeof *out);
    size_t n = req->n_texts + req->n_token_inputs;
    Tandem__V1__TokenList *lists =
        calloc(req->n_token_inputs ? req->n_token_inputs : 1, sizeof *lists);
    Tandem__V1__TokenList **listp =
        calloc(req->n_token_inputs ? req->n_token_inputs : 1, sizeof *listp);
    if (!lists || !listp) {
        free(lists);
        free(listp);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    for (size_t i = 0; i < req->n_token_inputs; i++) {
        tandem__v1__token_list__init(&lists[i]);
        lists[i].ids = (int32_t *)(uintptr_t)req->token_ids[i];
        lists[i].n_ids = req->n_token_ids[i];
        listp[i] = &lists[i];
    }
    Tandem__V1__EmbedRequest q = TANDEM__V1__EMBED_REQUEST__INIT;
    q.model = (char *)(uintptr_t)(req->model ? req->model : "");
    q.request_id = (char *)(uintptr_t)(req->request_id ? req->request_id : "");
    q.texts = (char **)(uintptr_t)req->texts;
    q.n_texts = req->n_texts;
    q.token_inputs = listp;
    q.n_token_inputs = req->n_token_inputs;
    q.pooling = req->mean ? TANDEM__V1__POOLING__POOLING_MEAN : TANDEM__V1__POOLING__POOLING_LAST;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_EMBED, &q.base,
                        &tandem__v1__embed_response__descriptor, timeout_s, &resp);
    free(lists);
    free(listp);
    if (rc != TDM_OK)
        return rc;
    rc = embeddings_take(c, (const Tandem__V1__EmbedResponse *)resp, n, out);
    if (rc != TDM_OK)
        tdm_client_embeddings_clear(out);
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}
