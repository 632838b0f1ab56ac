/* request.c - GENERATE requests in the router: validation and tokenization, the request
 * table (every request, by id, by client call, by deadline) and how a request ends other
 * than completing (failed, dropped, cancelled, client gone, deadline, shutdown). The output
 * (reorder buffer, detokenization, stop strings, chunks, completion) is stream.c's; where a
 * request runs is scheduler.c's.
 *
 * Tokenization is tdm_prompt_encode (tandem/prompt.h) with the template tdm_chat_template_pick
 * chose at start-up: the one implementation `tandem generate -m` and `tandem tokenize --chat`
 * call too, so they make the same ids of the same input; token-id input is taken as it is.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "nodes.h"
#include "request.h"
#include "scheduler.h"
#include "stats.h"
#include "stream.h"
#include "tandem/prompt.h"

/* ---- the request table ---- */

int rt_req_table_init(tdm_router_t *r)
{
    tdm_list_init(&r->requests);
    rt_heap_init(&r->deadlines);
    r->n_reqs = 0;
    if (rt_index_init(&r->by_id, 256) != TDM_OK || rt_index_init(&r->by_call, 256) != TDM_OK)
        return TDM_ERESOURCE;
    return TDM_OK;
}

void rt_req_table_fini(tdm_router_t *r)
{
    rt_index_fini(&r->by_id);
    rt_index_fini(&r->by_call);
    rt_heap_fini(&r->deadlines);
}

static uint64_t id_key(const char *id)
{
    return rt_index_hash(id, strlen(id), 0);
}

/* The key of a client call: its connection's routing id and its call id. */
static uint64_t call_key(const uint8_t *peer, size_t peer_len, uint64_t call_id)
{
    return rt_index_hash(peer, peer_len, call_id);
}

static rt_req_t *by_id_entry(const rt_index_entry_t *e)
{
    return TDM_CONTAINER_OF(e, rt_req_t, by_id);
}

rt_req_t *rt_req_find(tdm_router_t *r, const char *id)
{
    for (rt_index_entry_t *e = rt_index_first(&r->by_id, id_key(id)); e; e = rt_index_next(e))
        if (strcmp(by_id_entry(e)->id, id) == 0)
            return by_id_entry(e);
    return NULL;
}

rt_req_t *rt_req_find_attempt(tdm_router_t *r, const char *id, uint64_t attempt, bool *id_known)
{
    *id_known = false;
    for (rt_index_entry_t *e = rt_index_first(&r->by_id, id_key(id)); e; e = rt_index_next(e)) {
        rt_req_t *q = by_id_entry(e);
        if (strcmp(q->id, id) == 0) {
            *id_known = true;
            if (q->attempt_id == attempt && attempt != 0)
                return q;
        }
    }
    return NULL;
}

/* The request in flight with this id from this client connection, or NULL. Two clients may
 * use the same id at once (it is their label); one client may not, or it could not tell its
 * own replies apart. */
static rt_req_t *find_for_peer(tdm_router_t *r, const char *id, const uint8_t *peer,
                               size_t peer_len)
{
    for (rt_index_entry_t *e = rt_index_first(&r->by_id, id_key(id)); e; e = rt_index_next(e)) {
        rt_req_t *q = by_id_entry(e);
        if (strcmp(q->id, id) == 0 && q->peer_len == peer_len &&
            memcmp(q->peer, peer, peer_len) == 0)
            return q;
    }
    return NULL;
}

/* The request of this client call, or NULL. */
static rt_req_t *find_call(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id)
{
    rt_index_entry_t *e = rt_index_first(&r->by_call, call_key(peer, peer_len, call_id));
    for (; e; e = rt_index_next(e)) {
        rt_req_t *q = TDM_CONTAINER_OF(e, rt_req_t, by_call);
        if (q->call_id == call_id && q->peer_len == peer_len &&
            memcmp(q->peer, peer, peer_len) == 0)
            return q;
    }
    return NULL;
}

/* Enters q (validated, its id, peer, call and deadline set) into the table: every link of q
 * starts here. Returns false on out of memory (q is then in nothing). */
static bool hash_insert(tdm_router_t *r, rt_req_t *q)
{
    tdm_list_init(&q->queue_link);
    rt_heap_entry_init(&q->by_deadline);
    if (q->deadline_ms && rt_heap_push(&r->deadlines, &q->by_deadline, q->deadline_ms) != TDM_OK)
        return false;
    tdm_list_push_front(&r->requests, &q->all_link);
    rt_index_insert(&r->by_id, &q->by_id, id_key(q->id));
    rt_index_insert(&r->by_call, &q->by_call, call_key(q->peer, q->peer_len, q->call_id));
    r->n_reqs++;
    return true;
}

static void hash_remove(tdm_router_t *r, rt_req_t *q)
{
    rt_heap_remove(&r->deadlines, &q->by_deadline);
    tdm_list_remove(&q->all_link);
    rt_index_remove(&r->by_id, &q->by_id);
    rt_index_remove(&r->by_call, &q->by_call);
    r->n_reqs--;
}

rt_req_t *rt_req_for_event(tdm_router_t *r, const rt_node_t *n, const char *id, uint64_t attempt,
                           bool from_prefill, bool from_decode, const char *what)
{
    bool known;
    rt_req_t *q = rt_req_find_attempt(r, id, attempt, &known);
    if (!q && known) {
        r->metrics.stale_attempt_messages++;
        tdm_log_write(&r->log, TDM_LOG_DEBUG, id, NULL,
                      "ignoring %s of attempt %016" PRIx64 " from %s (not a current attempt)", what,
                      attempt, n->cfg->id);
        return NULL;
    }
    if (!q || !((from_prefill && n == q->prefill) || (from_decode && n == q->decode))) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, id, NULL,
                      "ignoring %s from %s (request not running there)", what, n->cfg->id);
        return NULL;
    }
    return q;
}

/* ---- ending requests ---- */

int rt_send_end(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id, int status,
                const char *message, const ProtobufCMessage *body)
{
    tdm_send_t m = {0};
    m.peer = peer;
    m.peer_len = peer_len;
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
    m.method = TANDEM__V1__METHOD__METHOD_GENERATE;
    m.call_id = call_id;
    m.status = status;
    m.message = message;
    m.body = body;
    return tdm_sock_send(r->client, &m);
}

void rt_req_free(tdm_router_t *r, rt_req_t *q)
{
    if (!q)
        return;
    rt_queue_remove(r, q);
    hash_remove(r, q);
    if (q->decode)
        rt_node_detach(q->decode, q);
    free(q->prompt);
    for (size_t i = 0; i < q->n_stop; i++)
        free(q->stop[i]);
    free(q->stop);
    free(q->tried);
    rt_stream_free(q);
    free(q);
}

void rt_req_fail(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes, const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char kv[96];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(status));
    tdm_log_write(&r->log, TDM_LOG_WARN, q->id, kv, "request failed: %s", msg);
    if (cancel_nodes)
        rt_release_nodes(r, q, status);
    rt_send_end(r, q->peer, q->peer_len, q->call_id, status, msg, NULL);
    rt_count_end(r, status, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
    rt_hist_observe(&r->metrics.e2e, tdm_time_now() - q->t_arrival);
    rt_req_free(r, q);
}

void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why)
{
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL, "request dropped: %s", why);
    rt_release_nodes(r, q, TDM_ECANCELLED);
    rt_count_end(r, TDM_ECANCELLED, TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
    rt_req_free(r, q);
}

void rt_client_cancel(tdm_router_t *r, const tdm_frame_t *f)
{
    rt_req_t *q = find_call(r, f->peer, f->peer_len, f->call_id);
    if (q) {
        rt_req_drop(r, q, "cancelled by the client");
        return;
    }
    tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                  "CANCEL for call %" PRIu64 " that is not in flight", f->call_id);
}

static const char *state_name(rt_state_t s)
{
    switch (s) {
    case RT_QUEUED: return "queued, waiting for a decode node";
    case RT_RESERVING: return "reserving KV blocks on a decode node";
    case RT_RUNNING: return "running";
    }
    return "?";
}

void rt_req_check_deadlines(tdm_router_t *r, uint64_t now_ms)
{
    rt_heap_entry_t *e;
    while ((e = rt_heap_top(&r->deadlines)) && now_ms >= e->key) {
        rt_req_t *q = TDM_CONTAINER_OF(e, rt_req_t, by_deadline);
        char note[TDM_ERRMSG_MAX] = "";
        if (q->state == RT_QUEUED)
            rt_refused_decode_note(r, note, sizeof note);
        rt_req_fail(r, q, TDM_EDEADLINE, true,
                    "deadline exceeded after %.3f s (%s, %" PRIu32 " tokens out)%s%s",
                    tdm_time_now() - q->t_arrival, state_name(q->state), q->next_index,
                    note[0] ? "; " : "", note);
    }
}

void rt_req_shutdown_all(tdm_router_t *r)
{
    tdm_list_t *l;
    while ((l = tdm_list_first(&r->requests))) {
        rt_req_t *q = TDM_LIST_ENTRY(l, rt_req_t, all_link);
        rt_release_nodes(r, q, TDM_EUNAVAILABLE);
        rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_EUNAVAILABLE, "router shutting down",
                    NULL);
        rt_count_end(r, TDM_EUNAVAILABLE, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
        rt_req_free(r, q);
    }
}

/* ---- GENERATE ---- */

/* Offset of the first byte that does not start a valid UTF-8 character, or -1. */
static long utf8_invalid_at(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (!len)
            return (long)i;
        i += len;
    }
    return -1;
}

/* Checks a client's request id (id_wire_len: its length on the wire, which a NUL inside
 * makes longer than strlen): 1..TDM_REQUEST_ID_MAX printable ASCII characters without
 * spaces. TDM_EINVALID naming the first bad byte, or the length, otherwise. */
static int id_check(const char *id, size_t id_wire_len, tdm_error_t *err)
{
    size_t n = strlen(id);
    for (size_t i = 0; i < id_wire_len && i <= TDM_REQUEST_ID_MAX; i++) {
        unsigned char ch = i < n ? (unsigned char)id[i] : 0; /* past strlen: the NUL */
        if (ch <= 0x20 || ch >= 0x7f)
            return tdm_error_set(err, TDM_EINVALID,
                                 "request_id: byte %zu is 0x%02x; request ids are 1..%u printable "
                                 "ASCII characters without spaces",
                                 i, ch, TDM_REQUEST_ID_MAX);
    }
    if (n > TDM_REQUEST_ID_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "request_id is %zu bytes; request ids are 1..%u printable ASCII "
                             "characters without spaces",
                             n, TDM_REQUEST_ID_MAX);
    return TDM_OK;
}

/* Length on the wire of the last top-level length-delimited field `field` of the protobuf
 * message in b[n] (protobuf: the last occurrence wins), or 0 when absent or malformed. protobuf-c
 * hands strings over NUL-terminated, so an embedded NUL would silently shorten them: comparing
 * with this length catches it. Wire format: developers.google.com/protocol-buffers/docs/encoding.
 */
static size_t wire_field_len(const uint8_t *b, size_t n, uint32_t field)
{
    size_t i = 0, found = 0;
    while (i < n) {
        uint64_t v = 0;
        for (int shift = 0; i < n && shift < 64; shift += 7) {
            v |= (uint64_t)(b[i] & 0x7f) << shift;
            if (!(b[i++] & 0x80))
                goto have_key;
        }
        return found;
    have_key:;
        uint32_t type = (uint32_t)(v & 7);
        uint64_t num = v >> 3;
        uint64_t len = 0;
        switch (type) {
        case 0: /* varint */
            while (i < n && (b[i] & 0x80))
                i++;
            i++;
            continue;
        case 1: i += 8; continue;
        case 5: i += 4; continue;
        case 2:
            for (int shift = 0; i < n && shift < 64; shift += 7) {
                len |= (uint64_t)(b[i] & 0x7f) << shift;
                if (!(b[i++] & 0x80))
                    goto have_len;
            }
            return found;
        have_len:
            if (len > n - i)
                return found;
            if (num == field)
                found = (size_t)len;
            i += (size_t)len;
            continue;
        default: return found;
        }
    }
    return found;
}

static uint64_t random_u64(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
        /* getrandom cannot fail for 8 bytes once the pool is initialised; mix the clock in
         * anyway so two requests never share a seed */
        v ^= (uint64_t)(tdm_time_now() * 1e9) * 0x9e3779b97f4a7c15ull;
    }
    return v;
}

/* Tokenizes the request's input into q->prompt. */
static int tokenize_input(tdm_router_t *r, const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                          tdm_error_t *err)
{
    tdm_token_t *ids = NULL;
    size_t n_ids = 0;
    int rc;
    switch (g->input_case) {
    case TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT: {
        size_t len = strlen(g->prompt);
        if (len == 0)
            return tdm_error_set(err, TDM_EINVALID, "prompt is empty");
        long bad = utf8_invalid_at(g->prompt, len);
        if (bad >= 0)
            return tdm_error_set(err, TDM_EINVALID, "prompt is not valid UTF-8 (byte offset %ld)",
                                 bad);
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "prompt: %s", g->prompt);
        tdm_prompt_input_t in = {.text = g->prompt, .text_len = len};
        rc = tdm_prompt_encode(r->tok, NULL, &in, &ids, &n_ids, NULL, err);
        if (rc != TDM_OK)
            return tdm_error_prefix(err, rc, "prompt: ");
        break;
    }
    case TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT: {
        size_t n = g->chat ? g->chat->n_messages : 0;
        if (n == 0)
            return tdm_error_set(err, TDM_EINVALID, "chat.messages is empty");
        if (!r->have_template)
            return tdm_error_set(err, TDM_EPRECONDITION,
                                 "chat: the model has no chat template the router knows (%s)",
                                 r->template_error);
        tdm_chat_message_t *msgs = calloc(n, sizeof *msgs);
        if (!msgs)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        rc = TDM_OK;
        for (size_t i = 0; i < n && rc == TDM_OK; i++) {
            const Tandem__V1__ChatMessage *cm = g->chat->messages[i];
            long bad = utf8_invalid_at(cm->content, strlen(cm->content));
            if (bad >= 0)
                rc = tdm_error_set(err, TDM_EINVALID,
                                   "chat.messages[%zu].content is not valid UTF-8 (byte offset "
                                   "%ld)",
                                   i, bad);
            else if (utf8_invalid_at(cm->role, strlen(cm->role)) >= 0)
                rc = tdm_error_set(err, TDM_EINVALID, "chat.messages[%zu].role is not valid UTF-8",
                                   i);
            msgs[i] = (tdm_chat_message_t){cm->role, cm->content};
        }
        char *text = NULL;
        if (rc == TDM_OK) {
            tdm_prompt_input_t in = {.messages = msgs, .n_messages = n};
            rc = tdm_prompt_encode(r->tok, &r->chat, &in, &ids, &n_ids, &text, err);
            if (rc != TDM_OK)
                tdm_error_prefix(err, rc, "chat.messages: ");
        }
        free(msgs);
        if (rc != TDM_OK)
            return rc;
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "chat prompt: %s", text);
        free(text);
        break;
    }
    case TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS: {
        size_t n = g->tokens ? g->tokens->n_ids : 0;
        if (n == 0)
            return tdm_error_set(err, TDM_EINVALID, "tokens.ids is empty");
        for (size_t i = 0; i < n; i++)
            if (g->tokens->ids[i] < 0 || (uint32_t)g->tokens->ids[i] >= r->n_vocab)
                return tdm_error_set(err, TDM_EINVALID,
                                     "tokens.ids[%zu] = %" PRId32
                                     " is out of the vocabulary (0..%" PRIu32 ")",
                                     i, g->tokens->ids[i], r->n_vocab - 1);
        if (n >= r->n_ctx)
            break; /* the length check below gives the message */
        ids = malloc(n * sizeof *ids);
        if (!ids)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        memcpy(ids, g->tokens->ids, n * sizeof *ids);
        n_ids = n;
        break;
    }
    default:
        return tdm_error_set(err, TDM_EINVALID,
                             "input: the request has none; set prompt, chat or tokens");
    }
    if (g->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS && !ids)
        n_ids = g->tokens->n_ids;
    if (n_ids == 0) {
        free(ids);
        return tdm_error_set(err, TDM_EINVALID, "prompt: the input has no tokens");
    }
    if (n_ids >= r->n_ctx) {
        free(ids);
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt has %zu tokens; the context is %" PRIu32
                             " tokens (prompt + max_tokens must fit)",
                             n_ids, r->n_ctx);
    }
    q->prompt = ids;
    q->n_prompt = (uint32_t)n_ids;
    return TDM_OK;
}

/* Validates g and fills q. Returns 0 or the status with *err naming the field. */
static int build_request(tdm_router_t *r, const Tandem__V1__GenerateRequest *g, size_t id_wire_len,
                         rt_req_t *q, tdm_error_t *err)
{
    const tdm_config_t *cfg = r->cfg;
    if (id_wire_len > 0) { /* set (an empty id means: the router makes one) */
        int rc = id_check(g->request_id, id_wire_len, err);
        if (rc != TDM_OK)
            return rc;
        if (find_for_peer(r, g->request_id, q->peer, q->peer_len))
            return tdm_error_set(err, TDM_EINVALID,
                                 "request_id '%s' is already in flight; use a new id",
                                 g->request_id);
        snprintf(q->id, sizeof q->id, "%s", g->request_id);
    } else {
        do
            snprintf(q->id, sizeof q->id, "req-%016" PRIx64, random_u64());
        while (rt_req_find(r, q->id));
    }
    const char *served = cfg->model.name ? cfg->model.name : "";
    if (g->model[0] && strcmp(g->model, served) != 0)
        return tdm_error_set(err, TDM_ENOTFOUND,
                             "model '%s' is not served here; this router serves '%s'", g->model,
                             served);
    if (g->max_tokens < 1)
        return tdm_error_set(err, TDM_EINVALID, "max_tokens must be >= 1, got %" PRId32,
                             g->max_tokens);
    if (g->n_stop > TDM_MAX_STOP_STRINGS)
        return tdm_error_set(err, TDM_EINVALID, "stop: %zu strings given, at most %u allowed",
                             g->n_stop, TDM_MAX_STOP_STRINGS);
    for (size_t i = 0; i < g->n_stop; i++) {
        size_t len = strlen(g->stop[i]);
        if (len == 0)
            return tdm_error_set(err, TDM_EINVALID, "stop[%zu] is empty", i);
        if (len > TDM_MAX_STOP_STRING_BYTES)
            return tdm_error_set(err, TDM_EINVALID, "stop[%zu] is %zu bytes long, at most %u", i,
                                 len, TDM_MAX_STOP_STRING_BYTES);
        long bad = utf8_invalid_at(g->stop[i], len);
        if (bad >= 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "stop[%zu] is not valid UTF-8 (byte offset %ld)", i, bad);
    }
    if (g->n_stop) {
        q->stop = calloc(g->n_stop, sizeof *q->stop);
        if (!q->stop)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        for (size_t i = 0; i < g->n_stop; i++) {
            if (!(q->stop[i] = tdm_strdup(g->stop[i])))
                return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
            q->n_stop = i + 1;
        }
    }
    tdm_sampling_params_default(&q->sp);
    bool seeded = false;
    if (g->sampling) {
        int rc = tdm_proto_sampling_from(g->sampling, &q->sp, err);
        if (rc != TDM_OK)
            return rc;
        seeded = g->sampling->has_seed || (g->sampling->set_mask & TDM_PROTO_SET_SEED);
    }
    if (!seeded)
        q->sp.seed = random_u64();
    q->sp.max_tokens = g->max_tokens; /* checked against the context below */
    int rc = tdm_sampling_params_validate(&q->sp, r->n_vocab, err);
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc, "sampling: ");
    rc = tokenize_input(r, g, q, err);
    if (rc != TDM_OK)
        return rc;
    uint32_t room = r->n_ctx - q->n_prompt;
    if ((uint32_t)g->max_tokens > room) {
        return tdm_error_set(err, TDM_EINVALID,
                             "max_tokens: prompt (%" PRIu32 " tokens) + max_tokens (%" PRId32
                             ") exceeds the context of %" PRIu32 " tokens; at most %" PRIu32
                             " tokens can be generated for this "
                             "prompt",
                             q->n_prompt, g->max_tokens, r->n_ctx, room);
    } else {
        q->sp.max_tokens = g->max_tokens;
    }
    q->stream = g->stream;
    q->include_stop_str = g->include_stop_str;
    q->echo = g->echo_token_text;
    return TDM_OK;
}

void rt_generate(tdm_router_t *r, const tdm_frame_t *f)
{
    r->metrics.requests_total++;
    double now = tdm_time_now();
    uint64_t now_ms = tdm_net_now_ms();
    if (tdm_frame_expired(f, now_ms)) {
        rt_count_end(r, TDM_EDEADLINE, -1);
        tdm_sock_reply_error(r->client, f, TDM_EDEADLINE,
                             "the request's deadline had passed when it arrived");
        return;
    }
    Tandem__V1__GenerateRequest *g = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
        f, &tandem__v1__generate_request__descriptor);
    if (!g) {
        rt_count_end(r, TDM_EINVALID, -1);
        tdm_sock_reply_error(r->client, f, TDM_EINVALID,
                             "the body does not decode as a GenerateRequest");
        return;
    }
    tdm_error_t err = {0};
    rt_req_t *q = calloc(1, sizeof *q);
    int rc = q ? TDM_OK : tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    if (q) {
        q->t_arrival = now;
        memcpy(q->peer, f->peer, f->peer_len);
        q->peer_len = f->peer_len;
        q->call_id = f->call_id;
        q->deadline_ms = f->deadline_unix_ms
                             ? f->deadline_unix_ms
                             : now_ms + (uint64_t)(r->cfg->router.request_timeout_s * 1000.0 + 0.5);
        tdm_detok_init(&q->detok, r->tok, false);
        size_t id_wire_len = wire_field_len(f->body, f->body ? f->body_len : 0, 1);
        rc = build_request(r, g, id_wire_len, q, &err);
    }
    if (rc == TDM_OK && !(q->tried = calloc(r->n_nodes ? r->n_nodes : 1, sizeof *q->tried)))
        rc = tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    protobuf_c_message_free_unpacked(&g->base, NULL);
    if (rc != TDM_OK) {
        char kv[96];
        snprintf(kv, sizeof kv, "status=%s", tdm_status_name(rc));
        tdm_log_write(&r->log, TDM_LOG_INFO, q && q->id[0] ? q->id : NULL, kv,
                      "request refused: %s", err.msg);
        rt_count_end(r, rc, -1);
        tdm_sock_reply_error(r->client, f, rc, "%s", err.msg);
        if (q) {
            free(q->prompt);
            for (size_t i = 0; i < q->n_stop; i++)
                free(q->stop[i]);
            free(q->stop);
            free(q->tried);
            free(q);
        }
        return;
    }
    if (!hash_insert(r, q)) {
        rt_count_end(r, TDM_ERESOURCE, -1);
        tdm_sock_reply_error(r->client, f, TDM_ERESOURCE, "router out of memory");
        free(q->prompt);
        for (size_t i = 0; i < q->n_stop; i++)
            free(q->stop[i]);
        free(q->stop);
        free(q->tried);
        free(q);
        return;
    }
    q->chunk.index = 0;
    r->metrics.prompt_tokens += q->n_prompt;
    char kv[200];
    snprintf(kv, sizeof kv,
             "prompt_tokens=%" PRIu32 " max_tokens=%" PRId32 " stream=%s stop_strings=%zu",
             q->n_prompt, q->sp.max_tokens, q->stream ? "true" : "false", q->n_stop);
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, kv, "request accepted");
    /* FIFO: behind requests already waiting */
    rc = rt_queue_first(r) ? 1 : rt_dispatch(r, q);
    if (rc == 1) {
        if (r->n_queued >= (size_t)r->cfg->router.max_queue) {
            r->metrics.queue_full++;
            rt_req_fail(r, q, TDM_ERESOURCE, false, "queue full (%zu requests waiting)",
                        r->n_queued);
            return;
        }
        rt_queue_push(r, q, false);
        tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                      "queued: no decode node up with room (%zu waiting)", r->n_queued);
        rt_drain_queue(r);
    } else if (rc < 0) {
        rt_req_fail(r, q, rc, false, "%s", r->err.msg);
    }
}
