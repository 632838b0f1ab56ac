/* http_generate.c - the HTTP gateway's generation endpoints (/v1/completions,
 * /v1/chat/completions): the body parsed (http_openai.c), one GENERATE call per prompt started
 * through the gateway thread, and the answer written as the events come: a refusal (the first
 * event an error END) as OpenAI's error with its param from the END's ErrorDetail, a stream as
 * server-sent events, stream=false as one JSON answer. A connection whose next event has not
 * come is parked (gw_call_take) and resumed when it is queued.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <ctype.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include "http_gateway.h"
#include "http_openai.h"
#include "http_json.h"
#include "dashboard.h"
#include "http_metrics.h"
#include "http_server.h"
#include "http_responses.h"

/* Kernel send buffer of a streaming response (Linux doubles it). Autotuning would let a client
 * that stops reading park up to net.ipv4.tcp_wmem's maximum (4 MiB) in the kernel per stream;
 * with the cap the backlog waits in the call's queue, and a stream needs little: 64 KiB per
 * round trip is 320 KB/s at 200 ms. */
#define HTTP_STREAM_SNDBUF (64 << 10)

/* Whether q is a chat request that gave its limit as max_completion_tokens. */
static bool uses_max_completion_tokens(const oai_req_t *q)
{
    return q->kind == OAI_CHAT && json_object_get(q->root, "max_completion_tokens");
}

/* OpenAI's error.param for the GenerateRequest field the router named (ErrorDetail.field, a
 * path such as "stop[1]" or "sampling.temperature"): the name of the OpenAI request field it
 * was made from, with the element or member the path goes on to ("stop[1]",
 * "messages[2].content"); "" when none. */
static void param_of(const oai_req_t *q, const char *field, char *param, size_t cap)
{
    static const struct {
        const char *native, *param;
    } map[] = {
        {"prompt", "prompt"},
        {"tokens", "prompt"},
        {"chat", "messages"},
        {"stop", "stop"},
        {"model", "model"},
        {"max_tokens", "max_tokens"},
        {"truncate_prompt_tokens", "truncate_prompt_tokens"},
        {"prompt_logprobs", "prompt_logprobs"},
    };
    size_t top = strcspn(field, ".[");
    param[0] = '\0';
    if (strncmp(field, "chat.messages", 13) == 0) {
        snprintf(param, cap, "messages%s", field + 13);
        return;
    }
    if (strncmp(field, "chat.chat_template", 18) == 0 || /* and chat.chat_template_kwargs */
        strcmp(field, "chat.continue_final_message") == 0) {
        snprintf(param, cap, "%s", field + 5);
        return;
    }
    if (strncmp(field, "tokens.ids", 10) == 0) { /* the token-id prompt's element: prompt[3] */
        snprintf(param, cap, "prompt%s", field + 10);
        return;
    }
    if (strncmp(field, "constraint", top) == 0 && top == 10) {
        snprintf(param, cap, "%s", q->constraint_param);
        return;
    }
    if (top == 8 && strncmp(field, "sampling", 8) == 0 && field[8] == '.') {
        const char *sub = field + 9;
        if (strcmp(sub, "n_logprobs") == 0)
            sub = q->kind == OAI_CHAT ? "top_logprobs" : "logprobs";
        else if (strcmp(sub, "n_stop_token_ids") == 0)
            sub = "stop_token_ids";
        snprintf(param, cap, "%s", sub);
        return;
    }
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        if (strlen(map[i].native) != top || strncmp(field, map[i].native, top) != 0)
            continue;
        const char *p = map[i].param;
        if (strcmp(p, "max_tokens") == 0 && uses_max_completion_tokens(q))
            p = "max_completion_tokens";
        snprintf(param, cap, "%s%s", p, field + top);
        return;
    }
}

/* The router's message of a refusal in OpenAI's terms, into out (cap bytes). A refusal for
 * length is said from ErrorDetail's numbers in vLLM's words (the caller names the prompt of
 * a list); any other message that
 * begins with its field (tdm_error_t's rule) begins with param, OpenAI's name of the field,
 * instead; the rest of the message is never read. */
static void oai_text(const oai_req_t *q, const gw_event_t *ev, const char *param, char *out,
                     size_t cap)
{
    const char *msg = ev->message[0] ? ev->message : tdm_strerror(ev->status);
    const char *field = ev->detail.field;
    size_t n = strlen(field);
    /* a request too long for the context: vLLM's wording (serving_engine's input check), which
     * clients such as litellm read to raise their context-window error */
    uint32_t completion = q->g.max_tokens > 0 ? (uint32_t)q->g.max_tokens : 0;
    if (ev->detail.n_ctx > 0 && completion > 0)
        snprintf(out, cap,
                 "This model's maximum context length is %" PRIu32
                 " tokens. However, you requested %" PRIu64 " tokens (%" PRIu32
                 " in the messages, %" PRIu32
                 " in the completion). Please reduce the length of the messages or completion.",
                 ev->detail.n_ctx, (uint64_t)ev->detail.prompt_tokens + completion,
                 ev->detail.prompt_tokens, completion);
    else if (ev->detail.n_ctx > 0)
        snprintf(out, cap,
                 "This model's maximum context length is %" PRIu32
                 " tokens. However, your request has %" PRIu32
                 " input tokens. Please reduce the length of the input messages.",
                 ev->detail.n_ctx, ev->detail.prompt_tokens);
    else if (n > 0 && param[0] && strncmp(msg, field, n) == 0 &&
             !(isalnum((unsigned char)msg[n]) || msg[n] == '_'))
        snprintf(out, cap, "%s%s", param, msg + n);
    else
        snprintf(out, cap, "%s", msg);
}

/* The error END ev of call `call` of r in OpenAI's terms (oai_text, param_of): *out gets its
 * status, message and param (as out->field). A refusal of one prompt of a list for the prompt
 * itself (a field in it, or its length) names which: "prompt[1] is empty", "prompt[1][3] =
 * 60000 is out of the vocabulary ...", "prompt[1]: max_tokens: ...", param "prompt[1]",
 * "prompt[1][3]" (a field outside the prompt keeps its own param). */
static void refusal_error(const http_req_t *r, size_t call, const gw_event_t *ev, tdm_error_t *out)
{
    bool list = r->q->n_prompts > 1;
    char name[32] = "prompt";
    if (list)
        snprintf(name, sizeof name, "prompt[%zu]", call);
    char field[64], param[TDM_ERRFIELD_MAX];
    param_of(r->q, ev->detail.field, field, sizeof field);
    bool in_prompt = strncmp(field, "prompt", 6) == 0 && !isalnum((unsigned char)field[6]);
    snprintf(param, sizeof param, "%s%s", in_prompt ? name : field, in_prompt ? field + 6 : "");
    char text[TDM_ERRMSG_MAX + 64];
    oai_text(r->q, ev, param, text, sizeof text);
    size_t n = strlen(name);
    if (!list || !(in_prompt || ev->detail.n_ctx > 0) || strncmp(text, name, n) == 0)
        tdm_error_set_field(out, ev->status, param, "%s", text);
    else if (strncmp(text, "prompt", 6) == 0 &&
             !(isalnum((unsigned char)text[6]) || text[6] == '_' || text[6] == '['))
        tdm_error_set_field(out, ev->status, param, "%s%s", name, text + 6); /* "prompt: ..." */
    else
        tdm_error_set_field(out, ev->status, param, "%s: %s", name, text);
    if (r->resp)
        resp_rename(r->resp, out); /* in the Responses request's names */
}

/* ---- generate ---- */

static void record(http_req_t *r, int status)
{
    if (r->recorded)
        return;
    r->recorded = true;
    dash_record(r->h->dash, status);
}

/* Cancels every call of r that has not ended (CANCEL to the router). */
static void calls_cancel(http_req_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++)
        if (r->calls[i] && !gw_call_ended(r->calls[i]))
            gw_call_cancel(r->calls[i]);
}

/* Whether a call of r has not ended. */
static bool calls_running(http_req_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++)
        if (r->calls[i] && !gw_call_ended(r->calls[i]))
            return true;
    return false;
}

/* The call's next event without blocking the thread: 0 with *ev, or with *ev NULL when the
 * connection is parked until there is one (the handler returns and libmicrohttpd calls it again
 * then); TDM_ECANCELLED when the client has hung up or the gateway ran out of memory (the calls
 * are cancelled; when tells the log at what point). With sibling_failed (before the answer, a
 * request of several calls): another call's error END also unparks it, and one already queued
 * leaves it unparked with *ev NULL and *sibling_failed true. */
static int take_event(http_req_t *r, const char *when, gw_event_t **ev, bool *sibling_failed)
{
    int rc = TDM_ECANCELLED;
    *ev = NULL;
    bool failed = false;
    if (!http_client_gone(r->fd)) {
        gw_parker_t pk = http_parker(r->conn);
        rc = sibling_failed && r->n_calls > 1
                 ? gw_call_take_watch(r->call, r->calls, r->n_calls, r->fd, &pk, ev, &failed)
                 : gw_call_take(r->call, r->fd, &pk, ev);
    }
    if (sibling_failed)
        *sibling_failed = failed;
    if (rc == TDM_OK)
        return rc;
    tdm_log_write(&r->h->log, TDM_LOG_INFO, r->q->id, NULL,
                  "http client disconnected %s: request cancelled", when);
    r->cancelled = true;
    calls_cancel(r);
    record(r, TDM_ECANCELLED);
    return TDM_ECANCELLED;
}

/* multi: the writer of the choice ch belongs to (the current call's prompt). */
static size_t choice_slot(const http_req_t *r, const tdm_client_chunk_t *ch)
{
    uint32_t k = ch->choice < r->q->best_of ? ch->choice : r->q->best_of - 1;
    return r->cur * r->q->best_of + k;
}

/* multi: the next prompt's call, once the current one ended OK. */
static bool next_call(http_req_t *r)
{
    if (r->cur + 1 >= r->n_calls)
        return false;
    r->call = r->calls[++r->cur];
    return true;
}

/* Turns one event of a running stream into SSE text in r->sse. */
static void stream_event(http_req_t *r, gw_event_t *ev)
{
    int rc = TDM_OK;
    if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
        const tdm_client_chunk_t *ch = gw_event_chunk(ev);
        rc = oai_sse_chunk(r->q, r->multi ? &r->outs[choice_slot(r, ch)] : &r->out, ch, &r->sse);
        if (rc == TDM_OK)
            return;
        calls_cancel(r);
        if (r->resp)
            resp_sse_end(r->resp, r->q, &r->out, TDM_EINTERNAL, "the HTTP gateway is out of memory",
                         &r->sse);
        else
            oai_sse_end(r->q, &r->out, TDM_EINTERNAL, "the HTTP gateway is out of memory", &r->sse);
        record(r, TDM_EINTERNAL);
        r->sse_done = true;
        return;
    }
    if (r->multi && ev->status == TDM_OK && next_call(r))
        return; /* the next prompt's choices follow */
    if (r->multi && ev->status != TDM_OK)
        calls_cancel(r); /* one failed: the answer failed */
    if (r->multi)
        oai_usage_sum(r->q, r->outs, &r->out);
    tdm_error_t end = {0};
    if (ev->status != TDM_OK && r->q->n_prompts > 1)
        refusal_error(r, r->cur, ev, &end); /* names the prompt */
    else
        tdm_error_set(&end, ev->status, "%s", ev->message);
    if (r->resp && resp_sse_end(r->resp, r->q, &r->out, ev->status, end.msg, &r->sse) != TDM_OK)
        ev->status = TDM_EINTERNAL; /* out of memory: the stream ends short */
    else if (!r->resp)
        oai_sse_end(r->q, &r->out, ev->status, end.msg, &r->sse);
    record(r, ev->status);
    r->sse_done = true;
    if (ev->status != TDM_OK)
        tdm_log_write(&r->h->log, TDM_LOG_INFO, r->q->id, NULL, "http stream ended with %s: %s",
                      tdm_status_name(ev->status), ev->message);
}

/* The content reader of a stream: the SSE text of the events queued so far; with none, it
 * parks the connection and returns 0 (libmicrohttpd calls it again once resumed). */
static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    http_req_t *r = cls;
    while (r->sse_off == r->sse.len) {
        if (r->sse_done)
            return MHD_CONTENT_READER_END_OF_STREAM;
        tdm_buf_clear(&r->sse);
        r->sse_off = 0;
        gw_event_t *ev = NULL;
        if (take_event(r, "mid-stream", &ev, NULL) != TDM_OK)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (!ev)
            return 0; /* parked */
        stream_event(r, ev);
        gw_event_free(ev);
        if (r->sse_done) /* the rest is ours to send: a client that stops reading times out */
            MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT,
                                      (unsigned)r->h->cfg->router.http_connection_timeout_s);
    }
    size_t n = r->sse.len - r->sse_off;
    if (n > max)
        n = max;
    memcpy(buf, r->sse.data + r->sse_off, n);
    r->sse_off += n;
    return (ssize_t)n;
}

/* The ids of a generate request: without a client id the router's own (q->id, as the body's
 * "id") is the reply's X-Request-Id; a client's id goes to the router with a suffix from q->id,
 * since the router refuses an id already in flight from the gateway and two clients (or one
 * client's retries) may send the same id at once. */
static void request_ids(http_req_t *r, oai_req_t *q)
{
    if (!r->rid[0]) {
        snprintf(r->rid, sizeof r->rid, "%s", q->id);
        return;
    }
    size_t n = strlen(q->id);
    const char *tail = q->id + (n > 8 ? n - 8 : 0);
    snprintf(q->native_id, sizeof q->native_id, "%.*s-%s", (int)(TDM_REQUEST_ID_MAX - 9), r->rid,
             tail);
    q->g.request_id = q->native_id;
    q->creq.request_id = q->native_id;
}

/* The writers (and for stream=false the answers) of a request of several choices. */
static bool multi_alloc(http_req_t *r, const oai_req_t *q)
{
    size_t n = oai_candidates(q);
    r->multi = n > 1;
    r->calls = calloc(q->n_prompts, sizeof *r->calls);
    if (!r->calls)
        return false;
    if (!r->multi)
        return true;
    r->q_candidates = n;
    r->outs = calloc(n, sizeof *r->outs);
    r->wholes = calloc(n, sizeof *r->wholes);
    for (size_t i = 0; r->outs && i < n; i++)
        r->outs[i].index = (uint32_t)(i / q->best_of * q->n + i % q->best_of);
    return r->outs && r->wholes;
}

/* Starts one GENERATE call per prompt of q (r->calls, each holding a reference on q). Returns
 * 0, or the error of the call that could not start: the ones before it are cancelled and
 * released and q is gone. */
static int calls_start(tdm_http_t *h, http_req_t *r, oai_req_t *q, tdm_error_t *err)
{
    size_t n = q->n_prompts;
    q->refs = (int)n;
    for (size_t i = 0; i < n; i++) {
        r->calls[i] = gw_generate_start(h->gw, &q->creqs[i], oai_req_unref, q, err);
        if (r->calls[i])
            continue;
        for (size_t j = i + 1; j < n; j++)
            oai_req_unref(q); /* the calls never made */
        for (size_t j = 0; j < i; j++) {
            gw_call_cancel(r->calls[j]);
            gw_call_release(&r->calls[j]);
        }
        return err->code ? err->code : TDM_EINTERNAL;
    }
    r->n_calls = n;
    r->cur = 0;
    r->call = r->calls[0];
    return TDM_OK;
}

/* Parses the body and starts its GENERATE calls (r->q, r->calls). Returns true, or false with
 * the error reply queued and *ret its result. */
static bool generate_start(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, oai_kind_t kind,
                           enum MHD_Result *ret)
{
    http_model_t m;
    tdm_error_t err = {0};
    const char *served = h->cfg->model.name ? h->cfg->model.name : "";
    if (http_model_get(h, &m, &err) == TDM_OK)
        served = m.name;
    oai_req_t *q = malloc(sizeof *q);
    if (!q) {
        *ret = http_reply_error(c, TDM_EINTERNAL, NULL, NULL, "out of memory");
        return false;
    }
    size_t len = r->body.len;
    const char *body = r->resp ? resp_chat_body(r->resp, &len) : r->body.data;
    int rc = oai_parse(kind, body ? body : "", len, served, q, &err);
    /* the family of the model asked for (an unknown one: the router answers 404 for it) */
    int mi = rc == TDM_OK ? tdm_config_model_index(h->cfg, q->g.model) : -1;
    if (rc == TDM_OK && (rc = oai_apply_family(q, &h->families[mi < 0 ? 0 : mi], &err)) != TDM_OK)
        oai_req_clear(q);
    if (rc != TDM_OK) {
        free(q);
        if (r->resp)
            resp_rename(r->resp, &err);
        http_counters_refusal(h->counters, err.field, rc);
        *ret = http_reply_error(c, rc, NULL, err.field, "%s", err.msg);
        return false;
    }
    r->q = q;
    if (r->resp)
        resp_bind(r->resp, q); /* the response id and its stream writer */
    request_ids(r, q);
    q->creq.timeout_s = h->cfg->router.request_timeout_s;
    if (oai_prompt_requests(q) != TDM_OK || !multi_alloc(r, q)) {
        oai_req_destroy(q);
        r->q = NULL;
        *ret = http_reply_error(c, TDM_EINTERNAL, NULL, NULL, "out of memory");
        return false;
    }
    if (calls_start(h, r, q, &err) != TDM_OK) {
        r->q = NULL;
        *ret = http_reply_error(c, err.code, NULL, NULL, "%s", err.msg);
        return false;
    }
    pthread_mutex_lock(&h->mu);
    h->n_calls++;
    pthread_mutex_unlock(&h->mu);
    return true;
}

/* The answer is ours to send from here on: the connection timeout parking had lifted
 * (http_generate) is back, so a client that stops reading is dropped. */
static void timeout_back(http_req_t *r, struct MHD_Connection *c)
{
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                              (unsigned)r->h->cfg->router.http_connection_timeout_s);
}

/* Answers call `call` of r, which the router refused (its first event is an error END):
 * OpenAI's error with the param the END's ErrorDetail names (refusal_error). */
static enum MHD_Result reply_refused(http_req_t *r, struct MHD_Connection *c, size_t call,
                                     const gw_event_t *ev)
{
    tdm_error_t e = {0};
    timeout_back(r, c);
    refusal_error(r, call, ev, &e);
    record(r, ev->status);
    const char *code =
        e.code == TDM_ENOTFOUND && strcmp(e.field, "model") == 0 ? "model_not_found" : NULL;
    if (ev->detail.n_ctx > 0)
        code = "context_length_exceeded"; /* OpenAI's code for a request over the context */
    return http_reply_json_retry(c, tdm_status_info(e.code)->http_status,
                                 http_error_json(e.code, code, e.field, e.msg),
                                 ev->detail.retry_after_s);
}

/* Answers a stream=false call from its one chunk (r->whole, consumed) and the event after it
 * (end, consumed): the chunk once the END OK has come; an error END is answered as the
 * router's error. */
static enum MHD_Result reply_whole(http_req_t *r, struct MHD_Connection *c, gw_event_t *end)
{
    gw_event_t *ev = r->whole;
    r->whole = NULL;
    timeout_back(r, c);
    enum MHD_Result ret;
    if (end->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && end->status != TDM_OK) {
        ret = reply_refused(r, c, r->cur, end);
    } else {
        json_t *body = r->resp ? resp_whole(r->resp, r->q, &r->out, gw_event_chunk(ev))
                               : oai_response(r->q, &r->out, gw_event_chunk(ev));
        record(r, TDM_OK);
        ret = http_reply_json(c, 200, body);
    }
    gw_event_free(end);
    gw_event_free(ev);
    return ret;
}

/* Starts the SSE response of a stream from its first event (consumed): the status is 200
 * from here on, errors become an SSE error event. */
static enum MHD_Result reply_stream(tdm_http_t *h, http_req_t *r, struct MHD_Connection *c,
                                    gw_event_t *ev)
{
    r->streaming = true;
    int sndbuf = HTTP_STREAM_SNDBUF;
    if (r->fd >= 0)
        setsockopt(r->fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    dash_streams(h->dash, 1);
    if (r->resp && resp_sse_begin(r->resp, r->q, &r->sse) != TDM_OK) {
        gw_event_free(ev);
        gw_call_cancel(r->call);
        return MHD_NO;
    }
    stream_event(r, ev);
    gw_event_free(ev);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_reader, r, NULL);
    if (!resp) {
        gw_call_cancel(r->call);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream; charset=utf-8");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    http_add_conv_headers(c, resp);
    http_counters_response(r->h->counters, 200);
    enum MHD_Result ret = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* multi, stream=false: the answer from every choice's chunk, once the last call ended OK. */
static enum MHD_Result reply_gathered(http_req_t *r, struct MHD_Connection *c)
{
    size_t n = oai_candidates(r->q);
    timeout_back(r, c);
    const tdm_client_chunk_t *chs[OAI_MAX_PROMPTS * OAI_MAX_CHOICES];
    for (size_t i = 0; i < n; i++) {
        chs[i] = r->wholes[i] ? gw_event_chunk(r->wholes[i]) : NULL;
        if (!chs[i]) {
            record(r, TDM_EINTERNAL);
            return http_reply_error(c, TDM_EINTERNAL, NULL, NULL,
                                    "the router's answer lacks choice %zu", i);
        }
    }
    json_t *body = oai_response_multi(r->q, r->outs, chs, &r->out);
    record(r, TDM_OK);
    return http_reply_json(c, 200, body);
}

/* multi, stream=false: takes one event (consumed). Returns true when the answer is queued
 * (*ret its result): every call ended OK, or one failed (the others are cancelled). */
static bool gather_event(http_req_t *r, struct MHD_Connection *c, gw_event_t *ev,
                         enum MHD_Result *ret)
{
    if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
        const tdm_client_chunk_t *ch = gw_event_chunk(ev);
        size_t i = choice_slot(r, ch);
        if (ch->last && !r->wholes[i])
            r->wholes[i] = ev;
        else
            gw_event_free(ev);
        return false;
    }
    if (ev->status != TDM_OK) {
        calls_cancel(r);
        *ret = reply_refused(r, c, r->cur, ev);
        gw_event_free(ev);
        return true;
    }
    gw_event_free(ev);
    if (next_call(r))
        return false;
    *ret = reply_gathered(r, c);
    return true;
}

/* The END of a call of r other than the current one that was refused (a prompt list fails as
 * a whole: another prompt's refusal ends the answer before, or while, the current one runs),
 * with *which its index, or NULL. Takes only queued events. */
static gw_event_t *sibling_refusal(http_req_t *r, size_t *which)
{
    for (size_t i = 0; i < r->n_calls; i++) {
        if (i == r->cur || !r->calls[i] || !gw_call_failed(r->calls[i]))
            continue;
        gw_event_t *ev = NULL;
        while (gw_call_next(r->calls[i], -1, 0, &ev) == TDM_OK && ev) {
            if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
                *which = i;
                return ev;
            }
            gw_event_free(ev);
        }
    }
    return NULL;
}

/* Runs a started generate call as far as its queued events allow: called when the request
 * is complete and again each time its parked connection is resumed. The first event decides
 * the answer (a refusal, a stream, or the one chunk of stream=false, which waits for the END
 * after it); returns MHD_YES with the connection parked while an event is missing. */
enum MHD_Result http_generate_resume(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r)
{
    for (;;) {
        gw_event_t *ev = NULL;
        bool sibling_failed = false;
        if (take_event(r, "before the answer", &ev, &sibling_failed) != TDM_OK)
            return MHD_NO;
        if (!ev && !sibling_failed)
            return MHD_YES; /* parked */
        enum MHD_Result ret;
        size_t which = 0;
        gw_event_t *refused = r->n_calls > 1 ? sibling_refusal(r, &which) : NULL;
        if (refused) {
            if (ev)
                gw_event_free(ev);
            calls_cancel(r);
            ret = reply_refused(r, c, which, refused);
            gw_event_free(refused);
            return ret;
        }
        if (!ev) /* the failed sibling's END was taken meanwhile: look again */
            continue;
        if (r->multi && !r->q->stream) {
            if (gather_event(r, c, ev, &ret))
                return ret;
            continue;
        }
        if (r->whole)
            return reply_whole(r, c, ev);
        if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && ev->status != TDM_OK) {
            calls_cancel(r);
            ret = reply_refused(r, c, r->cur, ev);
            gw_event_free(ev);
            return ret;
        }
        if (r->q->stream)
            return reply_stream(h, r, c, ev);
        if (ev->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
            gw_event_free(ev);
            gw_call_cancel(r->call);
            record(r, TDM_EINTERNAL);
            return http_reply_error(c, TDM_EINTERNAL, NULL, NULL,
                                    "the router's answer is not one GenerateChunk");
        }
        r->whole = ev; /* stream=false: the answer once the END after it has come */
    }
}

enum MHD_Result http_generate(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r,
                              oai_kind_t kind)
{
    enum MHD_Result ret;
    if (!http_check_key(h, c, &ret))
        return ret;
    /* a request may wait long (queue, generation) and a stream's reader may be slow: no idle
     * timeout until it completes (a parked connection has none anyway) */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    if (!generate_start(h, c, r, kind, &ret))
        return ret;
    return http_generate_resume(h, c, r);
}

void http_generate_end(tdm_http_t *h, http_req_t *r, int toe)
{
    if (!r->cancelled && calls_running(r)) {
        tdm_log_write(&h->log, TDM_LOG_INFO, r->q ? r->q->id : NULL, NULL,
                      "http request ended before its answer (termination %d): cancelled", toe);
        calls_cancel(r);
        record(r, TDM_ECANCELLED);
    }
    r->call = NULL;
    for (size_t i = 0; i < r->n_calls; i++) /* none may unpark a call released before it */
        gw_call_unwatch(r->calls[i]);
    for (size_t i = 0; i < r->n_calls; i++)
        gw_call_release(&r->calls[i]);
    pthread_mutex_lock(&h->mu);
    if (--h->n_calls == 0)
        pthread_cond_broadcast(&h->idle);
    pthread_mutex_unlock(&h->mu);
}
