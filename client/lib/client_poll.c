/* client_poll.c - receiving: tdm_client_poll takes the frames that came, dispatches each to
 * its call by call id (chunks appended to the result and passed to on_chunk, ENDs ending the
 * call), expires deadlines and handles a lost connection; cancelling a call. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "client_internal.h"

/* Frames handled per tdm_client_poll at most, so deadlines are looked at under a flood. */
#define CLIENT_MAX_FRAMES_PER_POLL 4096
#define CLIENT_WAITING_POLL_MS 20 /* poll period while a call waits for a router */

static tdm_client_finish_t finish_from_proto(Tandem__V1__FinishReason r)
{
    switch (r) {
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP: return TDM_CLIENT_FINISH_STOP;
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH: return TDM_CLIENT_FINISH_LENGTH;
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return TDM_CLIENT_FINISH_CANCELLED;
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR: return TDM_CLIENT_FINISH_ERROR;
    default: return TDM_CLIENT_FINISH_NONE;
    }
}

static void timings_from_proto(const Tandem__V1__Timings *m, tdm_client_timings_t *t)
{
    t->queue_s = m->queue_s;
    t->ttft_s = m->ttft_s;
    t->tpot_s = m->tpot_s;
    t->decode_s = m->decode_s;
    t->prefill_s = m->prefill_s;
    t->kv_transfer_s = m->kv_transfer_s;
    t->e2e_s = m->e2e_s;
}

/* Appends the chunk's tokens and text to the call's result. */
static int result_append(client_call_t *call, const Tandem__V1__GenerateChunk *m, size_t text_len)
{
    tdm_client_result_t *r = &call->result;
    if (m->n_token_ids > 0) {
        size_t need = r->n_tokens + m->n_token_ids;
        if (need > call->tokens_cap) {
            size_t cap = call->tokens_cap ? call->tokens_cap : 64;
            while (cap < need)
                cap *= 2;
            int32_t *ids = realloc(r->token_ids, cap * sizeof *ids);
            if (!ids)
                return TDM_ERESOURCE;
            r->token_ids = ids;
            call->tokens_cap = cap;
        }
        memcpy(r->token_ids + r->n_tokens, m->token_ids, m->n_token_ids * sizeof(int32_t));
        r->n_tokens = need;
    }
    if (text_len > 0) {
        size_t need = r->text_len + text_len + 1;
        if (need > call->text_cap) {
            size_t cap = call->text_cap;
            while (cap < need)
                cap *= 2;
            char *text = realloc(r->text, cap);
            if (!text)
                return TDM_ERESOURCE;
            r->text = text;
            call->text_cap = cap;
        }
        memcpy(r->text + r->text_len, m->text, text_len);
        r->text_len += text_len;
        r->text[r->text_len] = '\0';
    }
    return TDM_OK;
}

/* Takes the final fields (finish reason, usage, timings, stop reason) of the last chunk m into
 * the call's result. TDM_ERESOURCE on out of memory. */
static int result_final(tdm_client_result_t *r, const Tandem__V1__GenerateChunk *m, bool first)
{
    r->finish_reason = finish_from_proto(m->finish_reason);
    if (m->usage) {
        r->usage.prompt_tokens = m->usage->prompt_tokens; /* the choices share the prompt */
        r->usage.completion_tokens =
            (first ? 0 : r->usage.completion_tokens) + m->usage->completion_tokens;
        r->usage.cached_prompt_tokens = m->usage->cached_prompt_tokens;
    }
    if (m->timings)
        timings_from_proto(m->timings, &r->timings);
    free(r->stop_reason);
    r->stop_reason = tdm_strdup(str_or_empty(m->stop_reason));
    return r->stop_reason ? TDM_OK : TDM_ERESOURCE;
}

/* The message's top logprobs (arrays of pointers) as the callback's arrays of structs: *tops
 * [m->n_top_logprobs] pointing into *entries; both NULL when there are none. The caller frees
 * both. TDM_ERESOURCE on out of memory. */
static int tops_from_proto(const Tandem__V1__GenerateChunk *m, tdm_client_token_top_t **tops,
                           tdm_client_top_logprob_t **entries)
{
    *tops = NULL;
    *entries = NULL;
    if (m->n_top_logprobs == 0)
        return TDM_OK;
    size_t n_entries = 0;
    for (size_t i = 0; i < m->n_top_logprobs; i++)
        n_entries += m->top_logprobs[i] ? m->top_logprobs[i]->n_entries : 0;
    *tops = calloc(m->n_top_logprobs, sizeof **tops);
    *entries = calloc(n_entries ? n_entries : 1, sizeof **entries);
    if (!*tops || !*entries) {
        free(*tops);
        free(*entries);
        return TDM_ERESOURCE;
    }
    size_t k = 0;
    for (size_t i = 0; i < m->n_top_logprobs; i++) {
        const Tandem__V1__TopLogprobs *tl = m->top_logprobs[i];
        (*tops)[i].entries = *entries + k;
        (*tops)[i].n_entries = tl ? tl->n_entries : 0;
        for (size_t j = 0; tl && j < tl->n_entries; j++, k++) {
            (*entries)[k].token_id = tl->entries[j]->token_id;
            (*entries)[k].logprob = tl->entries[j]->logprob;
            (*entries)[k].text = str_or_empty(tl->entries[j]->text);
        }
    }
    return TDM_OK;
}

/* The message's prompt logprobs as the callback's structs: *plps [m->n_prompt_logprobs]
 * pointing into *entries; both NULL when there are none. The caller frees both.
 * TDM_ERESOURCE on out of memory. */
static int plps_from_proto(const Tandem__V1__GenerateChunk *m, tdm_client_prompt_logprob_t **plps,
                           tdm_client_top_logprob_t **entries)
{
    *plps = NULL;
    *entries = NULL;
    if (m->n_prompt_logprobs == 0)
        return TDM_OK;
    size_t n_entries = 0;
    for (size_t i = 0; i < m->n_prompt_logprobs; i++)
        n_entries += m->prompt_logprobs[i]->n_top;
    *plps = calloc(m->n_prompt_logprobs, sizeof **plps);
    *entries = calloc(n_entries ? n_entries : 1, sizeof **entries);
    if (!*plps || !*entries) {
        free(*plps);
        free(*entries);
        return TDM_ERESOURCE;
    }
    size_t k = 0;
    for (size_t i = 0; i < m->n_prompt_logprobs; i++) {
        const Tandem__V1__PromptLogprob *p = m->prompt_logprobs[i];
        tdm_client_prompt_logprob_t *o = &(*plps)[i];
        o->token_id = p->token_id;
        o->logprob = p->logprob;
        o->rank = p->rank;
        o->text = str_or_empty(p->text);
        o->top.entries = *entries + k;
        o->top.n_entries = p->n_top;
        for (size_t j = 0; j < p->n_top; j++, k++) {
            (*entries)[k].token_id = p->top[j]->token_id;
            (*entries)[k].logprob = p->top[j]->logprob;
            (*entries)[k].text = str_or_empty(p->top[j]->text);
        }
    }
    return TDM_OK;
}

/* Runs the call's on_chunk with m (the final fields from the result when last). Returns 0 to
 * go on, 1 when the callback asked to cancel, TDM_ERESOURCE on out of memory. */
static int run_on_chunk(tdm_client_t *c, client_call_t *call, const Tandem__V1__GenerateChunk *m,
                        const char *text, size_t text_len, bool last)
{
    const tdm_client_result_t *r = &call->result;
    tdm_client_token_top_t *tops;
    tdm_client_top_logprob_t *entries;
    if (tops_from_proto(m, &tops, &entries) != TDM_OK)
        return TDM_ERESOURCE;
    tdm_client_prompt_logprob_t *plps;
    tdm_client_top_logprob_t *plp_entries;
    if (plps_from_proto(m, &plps, &plp_entries) != TDM_OK) {
        free(tops);
        free(entries);
        return TDM_ERESOURCE;
    }
    tdm_client_usage_t usage = r->usage;
    if (m->usage) { /* this choice's own (the result sums the choices of n > 1) */
        usage.prompt_tokens = m->usage->prompt_tokens;
        usage.completion_tokens = m->usage->completion_tokens;
        usage.cached_prompt_tokens = m->usage->cached_prompt_tokens;
    }
    tdm_client_timings_t timings = r->timings;
    tdm_client_chunk_t ch = {
        .call_id = call->id,
        .request_id = str_or_empty(m->request_id),
        .choice = m->choice,
        .index = m->index,
        .token_ids = m->token_ids,
        .n_tokens = m->n_token_ids,
        .text = text,
        .text_len = text_len,
        .logprobs = m->logprobs,
        .n_logprobs = m->n_logprobs,
        .top_logprobs = tops,
        .n_top_logprobs = m->n_top_logprobs,
        .token_texts = (const char *const *)m->token_texts,
        .n_token_texts = m->n_token_texts,
        .last = last,
        .finish_reason = last ? r->finish_reason : TDM_CLIENT_FINISH_NONE,
        .stop_reason = last ? r->stop_reason : "",
        .prompt_logprobs = plps,
        .n_prompt_logprobs = m->n_prompt_logprobs,
        .usage = last || m->usage ? &usage : NULL,
        .timings = last ? &timings : NULL,
    };
    c->depth++;
    call->in_chunk_cb = true;
    int stop = call->on_chunk(call->user, &ch);
    call->in_chunk_cb = false;
    c->depth--;
    free(tops);
    free(entries);
    free(plps);
    free(plp_entries);
    return stop != 0 ? 1 : 0;
}

/* Records a GenerateChunk into the call and runs on_chunk. Returns 0 to go on, 1 when the
 * callback asked to cancel, or a negative status (the call must end with it). */
static int deliver_chunk(tdm_client_t *c, client_call_t *call, const Tandem__V1__GenerateChunk *m)
{
    tdm_client_result_t *r = &call->result;
    const char *text = str_or_empty(m->text);
    size_t text_len = strlen(text);
    if (result_append(call, m, text_len) != TDM_OK)
        return TDM_ERESOURCE;
    r->n_chunks++;
    call->delivered = true; /* from now on it is never sent to another router */
    if (m->n_token_ids > 0 || text_len > 0) {
        double now = tdm_time_now();
        if (call->t_first == 0)
            call->t_first = now;
        call->t_last = now;
    }
    if (m->request_id && m->request_id[0] && (!r->request_id || !r->request_id[0])) {
        free(r->request_id);
        r->request_id = tdm_strdup(m->request_id);
        if (!r->request_id)
            return TDM_ERESOURCE;
    }
    bool last = m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    if (last && result_final(r, m, call->n_final++ == 0) != TDM_OK)
        return TDM_ERESOURCE;
    if (!call->on_chunk)
        return 0;
    return run_on_chunk(c, call, m, text, text_len, last);
}

/* Handles a GenerateChunk body for call: delivers it and ends the call when the callback
 * cancels or something fails. Returns true when the call is still running. */
static bool handle_chunk_body(tdm_client_t *c, client_call_t *call, const tdm_frame_t *f)
{
    Tandem__V1__GenerateChunk *m =
        (Tandem__V1__GenerateChunk *)tdm_frame_unpack(f, &tandem__v1__generate_chunk__descriptor);
    if (!m) {
        tdm_client_send_cancel(c, call);
        tdm_client_call_end(c, call, TDM_EINTERNAL,
                            "client: call %llu: a GenerateChunk from %s does not "
                            "decode",
                            (unsigned long long)call->id, c->routers[call->router].endpoint);
        return false;
    }
    int rc = deliver_chunk(c, call, m);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    if (rc == 1) {
        tdm_client_send_cancel(c, call);
        tdm_client_call_end(c, call, TDM_ECANCELLED, "cancelled by the caller");
        return false;
    }
    if (rc < 0) {
        tdm_client_send_cancel(c, call);
        tdm_client_call_end(c, call, rc, "client: out of memory receiving a chunk");
        return false;
    }
    return true;
}

/* Fills *d from the ErrorDetail body of a refused call's END (left zero when it does not
 * decode: the message still tells). */
static void error_detail_read(const tdm_frame_t *f, tdm_client_error_detail_t *d)
{
    Tandem__V1__ErrorDetail *m =
        (Tandem__V1__ErrorDetail *)tdm_frame_unpack(f, &tandem__v1__error_detail__descriptor);
    if (!m)
        return;
    snprintf(d->field, sizeof d->field, "%s", str_or_empty(m->field));
    d->prompt_tokens = m->prompt_tokens;
    d->n_ctx = m->n_ctx;
    d->max_tokens_fit = m->max_tokens_fit;
    d->retry_after_s = m->retry_after_s;
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

/* Several routers: sends call again to the next router when nothing of it reached the caller
 * and a router is left that has not had it; true when it went (or waits for a router to come
 * up), false when the caller must end it. */
static bool retry(tdm_client_t *c, client_call_t *call, const char *why)
{
    if (c->n_routers < 2 || call->delivered || call->tries >= c->n_routers)
        return false;
    size_t from = call->router;
    (void)tdm_client_call_resend(c, call);
    if (call->router == NO_ROUTER && call->tries >= c->n_routers)
        return false;
    TDM_LOG_DEBUGF(
        c->log, NULL, "client: call %llu sent again to %s: %s on %s", (unsigned long long)call->id,
        call->router == NO_ROUTER ? "the next router up" : c->routers[call->router].endpoint, why,
        from == NO_ROUTER ? "?" : c->routers[from].endpoint);
    return true;
}

/* Handles one received frame, from router `router`. */
static void dispatch(tdm_client_t *c, const tdm_frame_t *f, size_t router)
{
    client_call_t *call = tdm_client_call_find(c, f->call_id);
    if (call && call->router != router) {
        /* a late frame from a router the call has left */
        TDM_LOG_DEBUGF(c->log, NULL,
                       "client: dropped a %s frame of call %llu from %s (sent "
                       "again elsewhere)",
                       tdm_net_kind_name(f->kind), (unsigned long long)f->call_id,
                       c->routers[router].endpoint);
        return;
    }
    if (!call) {
        /* a call that ended (cancelled, deadline) or a stray frame */
        TDM_LOG_DEBUGF(c->log, NULL, "client: dropped a %s frame of call %llu (not running)",
                       tdm_net_kind_name(f->kind), (unsigned long long)f->call_id);
        return;
    }
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
        if (call->kind != CALL_GENERATE) {
            TDM_LOG_DEBUGF(c->log, NULL, "client: dropped a STREAM frame of unary call %llu",
                           (unsigned long long)f->call_id);
            return;
        }
        handle_chunk_body(c, call, f);
        return;
    }
    if (f->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        TDM_LOG_DEBUGF(c->log, NULL, "client: dropped a %s frame of call %llu",
                       tdm_net_kind_name(f->kind), (unsigned long long)f->call_id);
        return;
    }
    if (f->status != TDM_OK) {
        if (f->status == TDM_EUNAVAILABLE && retry(c, call, f->message))
            return;
        if (f->body && f->body_len > 0) /* GENERATE's and EMBED's refusals name the field */
            error_detail_read(f, &call->result.error);
        tdm_client_call_end(c, call, f->status, "%s",
                            f->message[0] ? f->message : tdm_strerror(f->status));
        return;
    }
    if (call->kind == CALL_GENERATE) {
        /* stream=false: the END carries the one chunk; stream=true: no body */
        if (((!call->stream && call->n <= 1) || (f->body && f->body_len > 0)) &&
            !handle_chunk_body(c, call, f))
            return;
        tdm_client_call_end(c, call, TDM_OK, "%s", "");
        return;
    }
    call->resp = tdm_frame_unpack(f, call->resp_desc);
    if (!call->resp) {
        tdm_client_call_end(c, call, TDM_EINTERNAL,
                            "client: the %s response from %s does not decode",
                            tdm_net_method_name(call->method), c->routers[router].endpoint);
        return;
    }
    tdm_client_call_end(c, call, TDM_OK, "%s", "");
}

/* The largest id of the running calls (0: none): where a walk stops (tdm_client_call_after). */
static uint64_t last_call_id(const tdm_client_t *c)
{
    return c->n_calls ? c->calls[c->n_calls - 1]->id : 0;
}

/* Ends the calls whose deadline is at or before now. By id (tdm_client_call_after): their
 * on_done may start or cancel calls. */
static void expire(tdm_client_t *c, double now)
{
    uint64_t last = last_call_id(c);
    client_call_t *call;
    for (uint64_t seen = 0; (call = tdm_client_call_after(c, seen)) && call->id <= last;) {
        seen = call->id;
        if (call->deadline > 0 && call->deadline <= now) {
            tdm_client_send_cancel(c, call);
            tdm_client_call_end(c, call, TDM_EDEADLINE,
                                "deadline exceeded: the %s call to %s did not end within %.3g s",
                                tdm_net_method_name(call->method), c->endpoint,
                                call->deadline - call->t_start);
        }
    }
}

/* Milliseconds until the nearest deadline (>= 0), or -1 when no call has one. */
static long ms_to_nearest_deadline(const tdm_client_t *c, double now)
{
    double nearest = 0;
    for (size_t i = 0; i < c->n_calls; i++) {
        double d = c->calls[i]->deadline;
        if (d > 0 && (nearest == 0 || d < nearest))
            nearest = d;
    }
    if (nearest == 0)
        return -1;
    double ms = ceil((nearest - now) * 1000.0);
    return ms < 0 ? 0 : ms > 1e9 ? 1000000000L : (long)ms;
}

/* Receives and dispatches the frames waiting from router `router` (CLIENT_MAX_FRAMES_PER_POLL
 * at most). Returns 0, or the receive error after ending every call with it. */
static int receive_frames(tdm_client_t *c, size_t router)
{
    tdm_sock_t *sock = c->routers[router].sock;
    for (int i = 0; i < CLIENT_MAX_FRAMES_PER_POLL; i++) {
        int rc = tdm_sock_recv(sock, &c->frame, 0);
        if (rc == TDM_EDEADLINE || rc == TDM_ECANCELLED)
            break; /* nothing more now; or interrupted (looked at by the caller) */
        if (rc != TDM_OK) {
            tdm_error_set(&c->err, rc, "client: receiving from %s failed: %s",
                          c->routers[router].endpoint, tdm_sock_errmsg(sock));
            tdm_frame_clear(&c->frame);
            tdm_client_end_all(c, rc, c->err.msg);
            return rc;
        }
        dispatch(c, &c->frame, router);
        tdm_frame_clear(&c->frame);
    }
    return TDM_OK;
}

/* The connection to router `router` was lost: what it sent before it went is handled, then
 * every call still running on it is sent to the next router (several routers, nothing of the
 * call delivered yet; see retry) or ends with UNAVAILABLE (the router that had it is gone; a
 * restarted one does not know it). Later calls go out over the socket's reconnection: a call
 * id is never reused, so nothing of the old connection remains. */
static void connection_lost(tdm_client_t *c, size_t router)
{
    c->n_lost++;
    int rc = receive_frames(c, router);
    if (rc != TDM_OK || c->n_calls == 0)
        return;
    const char *ep = c->routers[router].endpoint;
    TDM_LOG_DEBUGF(c->log, NULL, "client: connection to %s lost", ep);
    char why[TDM_ERRMSG_MAX];
    snprintf(why, sizeof why,
             "router connection lost: %s closed the connection (router stopped or restarted); "
             "the call may or may not have run",
             ep);
    /* by id (tdm_client_call_after): an on_done may cancel calls or start new ones, which go
     * out over the reconnection and are not this loss's */
    uint64_t last = last_call_id(c);
    client_call_t *call;
    for (uint64_t seen = 0; (call = tdm_client_call_after(c, seen)) && call->id <= last;) {
        seen = call->id;
        if (call->router != router || retry(c, call, "connection lost"))
            continue;
        tdm_client_send_cancel(c, call);
        tdm_client_call_end(c, call, TDM_EUNAVAILABLE, "%s", why);
    }
}

/* True when some call waits for a router to take it. */
static bool any_waiting(const tdm_client_t *c)
{
    for (size_t i = 0; i < c->n_calls; i++)
        if (c->calls[i]->router == NO_ROUTER)
            return true;
    return false;
}

int tdm_client_poll_impl(tdm_client_t *c, int timeout_ms, int fd)
{
    uint64_t ended0 = c->n_ended;
    if (tdm_client_cancel_requested(c)) {
        tdm_client_end_all(c, TDM_ECANCELLED, "cancelled (interrupted)");
        return TDM_ECANCELLED;
    }
    long wait = timeout_ms;
    long to_deadline = ms_to_nearest_deadline(c, tdm_time_now());
    if (to_deadline >= 0 && (wait < 0 || to_deadline < wait))
        wait = to_deadline;
    if (any_waiting(c) && (wait < 0 || wait > CLIENT_WAITING_POLL_MS))
        wait = CLIENT_WAITING_POLL_MS; /* look for a router to take it again soon */
    zmq_pollitem_t items[2 * TDM_CLIENT_MAX_ROUTERS + 1];
    int n_items = 0;
    for (size_t i = 0; i < c->n_routers; i++) {
        items[n_items++] = (zmq_pollitem_t){tdm_sock_zsock(c->routers[i].sock), 0, ZMQ_POLLIN, 0};
        if (c->routers[i].monitor)
            items[n_items++] = (zmq_pollitem_t){c->routers[i].monitor, 0, ZMQ_POLLIN, 0};
    }
    if (fd >= 0)
        items[n_items++] = (zmq_pollitem_t){NULL, fd, ZMQ_POLLIN, 0};
    int n = zmq_poll(items, n_items, wait);
    if (n < 0 && errno != EINTR) {
        int e = errno;
        int status = e == ETERM ? TDM_ECANCELLED : TDM_EINTERNAL;
        tdm_error_set(&c->err, status, "client: waiting on %s failed: %s", c->endpoint,
                      zmq_strerror(e));
        tdm_client_end_all(c, status, c->err.msg);
        return status;
    }
    for (size_t i = 0, k = 0; n > 0 && i < c->n_routers; i++) {
        if (items[k].revents & ZMQ_POLLIN) {
            int rc = receive_frames(c, i);
            if (rc != TDM_OK)
                return rc;
        }
        k += c->routers[i].monitor ? 2 : 1;
    }
    for (size_t i = 0; i < c->n_routers; i++)
        if (tdm_client_monitor_read(c, i) > 0)
            connection_lost(c, i);
    if (c->n_routers > 1)
        tdm_client_resend_waiting(c);
    if (tdm_client_cancel_requested(c)) {
        tdm_client_end_all(c, TDM_ECANCELLED, "cancelled (interrupted)");
        return TDM_ECANCELLED;
    }
    expire(c, tdm_time_now());
    return (int)(c->n_ended - ended0);
}

int tdm_client_poll(tdm_client_t *c, int timeout_ms)
{
    return tdm_client_poll_fd(c, timeout_ms, -1);
}

int tdm_client_poll_fd(tdm_client_t *c, int timeout_ms, int fd)
{
    if (c->depth > 0)
        return tdm_error_set(&c->err, TDM_EPRECONDITION,
                             "client: tdm_client_poll called from a callback");
    return tdm_client_poll_impl(c, timeout_ms, fd);
}

int tdm_client_generate_cancel(tdm_client_t *c, uint64_t call_id)
{
    return tdm_client_cancel(c, call_id);
}

int tdm_client_cancel(tdm_client_t *c, uint64_t call_id)
{
    client_call_t *call = tdm_client_call_find(c, call_id);
    if (!call || call->sync)
        return tdm_error_set(&c->err, TDM_ENOTFOUND, "client: no running call %llu",
                             (unsigned long long)call_id);
    if (call->in_chunk_cb)
        return tdm_error_set(&c->err, TDM_EPRECONDITION,
                             "client: call %llu cannot be cancelled from its own on_chunk "
                             "(return nonzero instead)",
                             (unsigned long long)call_id);
    tdm_client_send_cancel(c, call);
    tdm_client_call_end(c, call, TDM_ECANCELLED, "cancelled by the caller");
    return TDM_OK;
}

/* Polls until the sync call has ended. */
void tdm_client_call_wait(tdm_client_t *c, client_call_t *call)
{
    while (!call->ended) {
        int rc = tdm_client_poll_impl(c, -1, -1);
        if (rc < 0 && !call->ended) /* not expected: a failed poll ends every call */
            tdm_client_call_end(c, call, rc, "%s", c->err.msg);
    }
}
