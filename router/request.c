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
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "admit.h"
#include "nodes.h"
#include "request.h"
#include "scheduler.h"
#include "stats.h"
#include "stream.h"
#include "tandem/constraint.h"
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

/* ---- the choices of one call (n > 1) ---- */

static void group_unref(rt_group_t *g)
{
    if (--g->refs == 0)
        free(g);
}

/* Ends every sibling of q (not q): NodeCancel to their nodes, for a failure (fail) the error
 * chunk a stream gets, counted with status, freed; the caller ends q and sends the call's one
 * END. With release_q, q's NodeCancels go too (without a group, only they do). The forks go
 * before choice 0, whose prompt KV they share: a decode node that loses choice 0 first fails
 * every fork still waiting for it ("the sibling it shares the prompt with ended", one warning
 * each), where a cancelled fork just goes. */
static void group_end_siblings(tdm_router_t *r, rt_req_t *q, int status, bool fail, bool release_q)
{
    rt_group_t *g = q->group;
    if (!g && release_q)
        rt_release_nodes(r, q, status);
    for (uint32_t i = g ? g->n : 0; i-- > 0;) {
        rt_req_t *s = g->kids[i];
        if (s == q && release_q)
            rt_release_nodes(r, q, status);
        if (!s || s == q)
            continue;
        rt_release_nodes(r, s, status);
        if (fail)
            rt_stream_fail(r, s);
        rt_count_end(r, status,
                     fail ? TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR
                          : TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
        rt_req_free(r, s);
        r->sibling_frees++;
    }
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
    free(q->gbnf);
    for (size_t i = 0; i < q->n_stop; i++)
        free(q->stop[i]);
    free(q->stop);
    free(q->tried);
    rt_stream_free(q);
    if (q->group) {
        q->group->kids[q->choice] = NULL;
        q->group->n_live--;
        group_unref(q->group);
    }
    free(q);
}

/* rt_req_fail with its message made, and body (NULL: none; borrowed) as the END's. */
static void req_fail_with(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes,
                          const ProtobufCMessage *body, const char *msg)
{
    char kv[96];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(status));
    tdm_log_write(&r->log, TDM_LOG_WARN, q->id, kv, "request failed: %s", msg);
    group_end_siblings(r, q, status, true, cancel_nodes);
    rt_stream_fail(r, q);
    rt_send_end(r, q->peer, q->peer_len, q->call_id, status, msg, body);
    rt_count_end(r, status, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
    rt_hist_observe(&r->metrics.e2e, tdm_time_now() - q->t_arrival);
    rt_req_free(r, q);
}

void rt_req_fail(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes, const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    req_fail_with(r, q, status, cancel_nodes, NULL, msg);
}

void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why)
{
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL, "request dropped: %s", why);
    group_end_siblings(r, q, TDM_ECANCELLED, false, true);
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
    rt_sched_check_reserves(r, tdm_time_now());
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
        group_end_siblings(r, q, TDM_EUNAVAILABLE, true, true);
        rt_stream_fail(r, q);
        rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_EUNAVAILABLE, "router shutting down",
                    NULL);
        rt_count_end(r, TDM_EUNAVAILABLE, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
        rt_req_free(r, q);
    }
}

/* ---- GENERATE ---- */

/* What a refusal for length says beyond its message and field: the rest of the END's
 * ErrorDetail body. */
typedef struct refusal {
    uint32_t prompt_tokens;  /* too long for the context: the prompt's tokens */
    uint32_t n_ctx;          /* ... the context length (0: not a length error) */
    uint32_t max_tokens_fit; /* ... output tokens that would fit */
} refusal_t;

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

/* Reads a base-128 varint at b[*i..n) into *v. False when it runs past n or 64 bits. */
static bool wire_varint(const uint8_t *b, size_t n, size_t *i, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; *i < n && shift < 64; shift += 7) {
        *v |= (uint64_t)(b[*i] & 0x7f) << shift;
        if (!(b[(*i)++] & 0x80))
            return true;
    }
    return false;
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
        uint64_t key, len;
        if (!wire_varint(b, n, &i, &key))
            return found;
        switch (key & 7) {
        case 0: /* varint */
            while (i < n && (b[i] & 0x80))
                i++;
            i++;
            continue;
        case 1: i += 8; continue;
        case 5: i += 4; continue;
        case 2:
            if (!wire_varint(b, n, &i, &len) || len > n - i)
                return found;
            if (key >> 3 == field)
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

/* Raw-text input -> *ids. */
static int tokenize_prompt(tdm_router_t *r, const char *prompt, const rt_req_t *q,
                           tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    size_t len = strlen(prompt);
    if (len == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt", "prompt is empty");
    long bad = utf8_invalid_at(prompt, len);
    if (bad >= 0)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt",
                                   "prompt is not valid UTF-8 (byte offset %ld)", bad);
    tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "prompt: %s", prompt);
    tdm_prompt_input_t in = {.text = prompt, .text_len = len};
    int rc = tdm_prompt_encode(r->tok, NULL, &in, ids, n_ids, NULL, err);
    if (rc != TDM_OK) {
        tdm_error_prefix(err, rc, "prompt: ");
        return tdm_error_field(err, "prompt");
    }
    return TDM_OK;
}

/* Checks that every message's role and content is UTF-8 and points msgs[] at them. */
static int chat_check(const Tandem__V1__ChatList *chat, tdm_chat_message_t *msgs, tdm_error_t *err)
{
    for (size_t i = 0; i < chat->n_messages; i++) {
        const Tandem__V1__ChatMessage *cm = chat->messages[i];
        long bad = utf8_invalid_at(cm->content, strlen(cm->content));
        if (bad >= 0) {
            tdm_error_set(err, TDM_EINVALID,
                          "chat.messages[%zu].content is not valid UTF-8 (byte offset %ld)", i,
                          bad);
            return tdm_error_field(err, "chat.messages[%zu].content", i);
        }
        const char *const fields[] = {cm->role, cm->tool_calls, cm->tool_call_id, cm->name};
        const char *const names[] = {"role", "tool_calls", "tool_call_id", "name"};
        for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++)
            if (fields[k] && utf8_invalid_at(fields[k], strlen(fields[k])) >= 0) {
                tdm_error_set(err, TDM_EINVALID, "chat.messages[%zu].%s is not valid UTF-8", i,
                              names[k]);
                return tdm_error_field(err, "chat.messages[%zu].%s", i, names[k]);
            }
        msgs[i] = (tdm_chat_message_t){.role = cm->role,
                                       .content = cm->content,
                                       .tool_calls = cm->tool_calls,
                                       .tool_call_id = cm->tool_call_id,
                                       .name = cm->name};
    }
    if (chat->tools && utf8_invalid_at(chat->tools, strlen(chat->tools)) >= 0)
        return tdm_error_set_field(err, TDM_EINVALID, "chat.tools",
                                   "chat.tools is not valid UTF-8");
    return TDM_OK;
}

/* Chat input -> *ids, rendered with the router's template. */
static int tokenize_chat(tdm_router_t *r, const Tandem__V1__ChatList *chat, const rt_req_t *q,
                         tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    size_t n = chat ? chat->n_messages : 0;
    if (n == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "chat.messages", "chat.messages is empty");
    if (!r->have_template)
        return tdm_error_set_field(err, TDM_EPRECONDITION, "chat",
                                   "chat: the model has no chat template the router knows (%s)",
                                   r->template_error);
    tdm_chat_message_t *msgs = calloc(n, sizeof *msgs);
    if (!msgs)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    char *text = NULL;
    int rc = chat_check(chat, msgs, err);
    if (rc == TDM_OK) {
        tdm_prompt_input_t in = {.messages = msgs, .n_messages = n, .tools = chat->tools};
        rc = tdm_prompt_encode(r->tok, &r->chat, &in, ids, n_ids, &text, err);
        if (rc != TDM_OK) {
            tdm_error_prefix(err, rc, "chat.messages: ");
            tdm_error_field(err, "chat.messages");
        }
    }
    free(msgs);
    if (rc == TDM_OK)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "chat prompt: %s", text);
    free(text);
    return rc;
}

/* Token-id input -> *ids (a copy; left NULL when it cannot fit the context, with *n_ids
 * telling the length for the check after). */
static int tokens_copy(const tdm_router_t *r, const Tandem__V1__TokenList *tokens,
                       tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    size_t n = tokens ? tokens->n_ids : 0;
    if (n == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "tokens.ids", "tokens.ids is empty");
    for (size_t i = 0; i < n; i++)
        if (tokens->ids[i] < 0 || (uint32_t)tokens->ids[i] >= r->n_vocab) {
            tdm_error_set(err, TDM_EINVALID,
                          "tokens.ids[%zu] = %" PRId32 " is out of the vocabulary (0..%" PRIu32 ")",
                          i, tokens->ids[i], r->n_vocab - 1);
            return tdm_error_field(err, "tokens.ids[%zu]", i);
        }
    *n_ids = n;
    if (n >= r->n_ctx)
        return TDM_OK; /* the length check gives the message */
    *ids = malloc(n * sizeof **ids);
    if (!*ids)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    memcpy(*ids, tokens->ids, n * sizeof **ids);
    return TDM_OK;
}

/* Tokenizes the request's input into q->prompt and checks that it leaves room in the
 * context. */
static int tokenize_input(tdm_router_t *r, const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                          refusal_t *why, tdm_error_t *err)
{
    tdm_token_t *ids = NULL;
    size_t n_ids = 0;
    int rc;
    const char *field = "prompt";
    switch (g->input_case) {
    case TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT:
        rc = tokenize_prompt(r, g->prompt, q, &ids, &n_ids, err);
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT:
        rc = tokenize_chat(r, g->chat, q, &ids, &n_ids, err);
        field = "chat.messages";
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS:
        rc = tokens_copy(r, g->tokens, &ids, &n_ids, err);
        field = "tokens.ids";
        break;
    default:
        return tdm_error_set(err, TDM_EINVALID,
                             "input: the request has none; set prompt, chat or tokens");
    }
    if (rc != TDM_OK)
        return rc;
    if (n_ids == 0) {
        free(ids);
        return tdm_error_set_field(err, TDM_EINVALID, field, "prompt: the input has no tokens");
    }
    if (n_ids >= r->n_ctx) {
        free(ids);
        why->prompt_tokens = n_ids > UINT32_MAX ? UINT32_MAX : (uint32_t)n_ids;
        why->n_ctx = r->n_ctx;
        why->max_tokens_fit = 0;
        return tdm_error_set_field(err, TDM_EINVALID, field,
                                   "prompt has %zu tokens; the context is %" PRIu32
                                   " tokens (prompt + max_tokens must fit)",
                                   n_ids, r->n_ctx);
    }
    q->prompt = ids;
    q->n_prompt = (uint32_t)n_ids;
    return TDM_OK;
}

/* q->id: the client's (checked, not in flight for this peer) or a new one. */
static int request_id_assign(tdm_router_t *r, const Tandem__V1__GenerateRequest *g,
                             size_t id_wire_len, rt_req_t *q, tdm_error_t *err)
{
    if (id_wire_len == 0) { /* unset or empty: the router makes one */
        do
            snprintf(q->id, sizeof q->id, "req-%016" PRIx64, random_u64());
        while (rt_req_find(r, q->id));
        return TDM_OK;
    }
    int rc = id_check(g->request_id, id_wire_len, err);
    if (rc != TDM_OK)
        return tdm_error_field(err, "request_id");
    if (find_for_peer(r, g->request_id, q->peer, q->peer_len))
        return tdm_error_set_field(err, TDM_EINVALID, "request_id",
                                   "request_id '%s' is already in flight; use a new id",
                                   g->request_id);
    snprintf(q->id, sizeof q->id, "%s", g->request_id);
    return TDM_OK;
}

/* Checks the stop strings and copies them into q. */
static int stop_copy(const Tandem__V1__GenerateRequest *g, rt_req_t *q, tdm_error_t *err)
{
    if (g->n_stop > TDM_MAX_STOP_STRINGS)
        return tdm_error_set_field(err, TDM_EINVALID, "stop",
                                   "stop: %zu strings given, at most %u allowed", g->n_stop,
                                   TDM_MAX_STOP_STRINGS);
    for (size_t i = 0; i < g->n_stop; i++) {
        size_t len = strlen(g->stop[i]);
        long bad = utf8_invalid_at(g->stop[i], len);
        if (len == 0)
            tdm_error_set(err, TDM_EINVALID, "stop[%zu] is empty", i);
        else if (len > TDM_MAX_STOP_STRING_BYTES)
            tdm_error_set(err, TDM_EINVALID, "stop[%zu] is %zu bytes long, at most %u", i, len,
                          TDM_MAX_STOP_STRING_BYTES);
        else if (bad >= 0)
            tdm_error_set(err, TDM_EINVALID, "stop[%zu] is not valid UTF-8 (byte offset %ld)", i,
                          bad);
        else
            continue;
        return tdm_error_field(err, "stop[%zu]", i);
    }
    if (g->n_stop == 0)
        return TDM_OK;
    q->stop = calloc(g->n_stop, sizeof *q->stop);
    if (!q->stop)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; i < g->n_stop; i++) {
        if (!(q->stop[i] = tdm_strdup(g->stop[i])))
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        q->n_stop = i + 1;
    }
    return TDM_OK;
}

/* q->sp from the request's sampling fields over Tandem's defaults; a seed drawn when the
 * client gave none. */
static int sampling_build(const tdm_router_t *r, const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                          tdm_error_t *err)
{
    tdm_sampling_params_default(&q->sp);
    bool seeded = false;
    if (g->sampling) {
        int rc = tdm_proto_sampling_from(g->sampling, &q->sp, err);
        if (rc != TDM_OK)
            return tdm_error_field(err, "%s",
                                   (g->sampling->set_mask & TDM_PROTO_SET_LOGIT_BIAS) &&
                                           g->sampling->n_logit_bias > TDM_SAMPLING_MAX_LOGIT_BIAS
                                       ? "sampling.logit_bias"
                                       : "sampling.stop_token_ids");
        seeded = g->sampling->has_seed || (g->sampling->set_mask & TDM_PROTO_SET_SEED);
    }
    if (!seeded)
        q->sp.seed = random_u64();
    q->sp.max_tokens = 1; /* decided after tokenization (max_tokens_decide) */
    /* the logit bias first: its entry is named by OpenAI's key, logit_bias["<token id>"] */
    if (tdm_sampling_logit_bias_check(&q->sp, r->n_vocab, NULL, err) != TDM_OK ||
        tdm_sampling_params_validate(&q->sp, r->n_vocab, err) != TDM_OK)
        return tdm_error_nest(err, "sampling"); /* "sampling.top_p must be in (0, 1], ..." */
    return TDM_OK;
}

/* q->sp.max_tokens from the request's max_tokens, which must fit the context the prompt
 * leaves; unset (0): what fits, at most TDM_ROUTER_MAX_TOKENS_DEFAULT. */
static int max_tokens_decide(const tdm_router_t *r, const Tandem__V1__GenerateRequest *g,
                             rt_req_t *q, refusal_t *why, tdm_error_t *err)
{
    uint32_t room = r->n_ctx - q->n_prompt; /* > 0: tokenize_input checked */
    if (g->max_tokens == 0) {
        q->sp.max_tokens =
            (int32_t)(room < TDM_ROUTER_MAX_TOKENS_DEFAULT ? room : TDM_ROUTER_MAX_TOKENS_DEFAULT);
        return TDM_OK;
    }
    if ((uint32_t)g->max_tokens > room) {
        why->prompt_tokens = q->n_prompt;
        why->n_ctx = r->n_ctx;
        why->max_tokens_fit = room;
        return tdm_error_set_field(err, TDM_EINVALID, "max_tokens",
                                   "max_tokens: prompt (%" PRIu32 " tokens) + max_tokens (%" PRId32
                                   ") exceeds the context of %" PRIu32 " tokens; at most %" PRIu32
                                   " tokens can be generated for this prompt",
                                   q->n_prompt, g->max_tokens, r->n_ctx, room);
    }
    q->sp.max_tokens = g->max_tokens;
    return TDM_OK;
}

/* The request's constraint compiled once, here (tdm_constraint_compile: the function
 * `tandem generate -m` calls too), into q->gbnf and q->gbnf_hash; nothing for none. A bad one is
 * refused before anything is scheduled, INVALID_ARGUMENT with the compiler's message and
 * ErrorDetail.field "constraint". */
static int constraint_build(const Tandem__V1__GenerateRequest *g, rt_req_t *q, tdm_error_t *err)
{
    const Tandem__V1__Constraint *c = g->constraint;
    if (!c || c->kind == TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_NONE)
        return TDM_OK;
    tdm_buf_t gbnf = {0};
    const char *text = c->text ? c->text : "";
    int rc = tdm_constraint_compile((int)c->kind, text, strlen(text), &gbnf, &q->gbnf_hash, err);
    if (rc == TDM_OK && !(q->gbnf = tdm_buf_take(&gbnf)))
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    tdm_buf_free(&gbnf);
    if (rc == TDM_EINVALID)
        tdm_error_prefix(err, rc, "constraint (%s): ", tdm_constraint_kind_name((int)c->kind));
    return rc == TDM_OK ? rc : tdm_error_field(err, "constraint");
}

/* n and best_of: n in [1, RT_MAX_CHOICES] (0 = 1), best_of in [n, RT_MAX_CHOICES] (0 = n). The
 * router streams every choice it makes, so best_of > n (pick the n best of best_of) is the HTTP
 * API's: refused here with the way to do it. */
static int choices_check(const Tandem__V1__GenerateRequest *g, tdm_error_t *err)
{
    uint32_t n = g->n ? g->n : 1;
    if (n > RT_MAX_CHOICES)
        return tdm_error_set_field(err, TDM_EINVALID, "n", "n must be in [1, %d], got %" PRIu32,
                                   RT_MAX_CHOICES, g->n);
    if (g->best_of && (g->best_of < n || g->best_of > RT_MAX_CHOICES))
        return tdm_error_set_field(err, TDM_EINVALID, "best_of",
                                   "best_of must be in [n, %d] (n is %" PRIu32 "), got %" PRIu32,
                                   RT_MAX_CHOICES, n, g->best_of);
    if (g->best_of > n)
        return tdm_error_set_field(err, TDM_EINVALID, "best_of",
                                   "best_of > n is not served by the native API (it streams "
                                   "every choice): ask n = %" PRIu32
                                   " with sampling.n_logprobs >= 1 and keep the %" PRIu32
                                   " with the highest sum of logprobs, as the HTTP API does",
                                   g->best_of, n);
    return TDM_OK;
}

/* Validates g and fills q. Returns 0 or the status with *err saying why and naming the field;
 * a refusal for length also fills *why. */
static int build_request(tdm_router_t *r, const Tandem__V1__GenerateRequest *g, size_t id_wire_len,
                         rt_req_t *q, refusal_t *why, tdm_error_t *err)
{
    int rc = request_id_assign(r, g, id_wire_len, q, err);
    if (rc != TDM_OK)
        return rc;
    const char *served = r->cfg->model.name ? r->cfg->model.name : "";
    if (g->model[0] && strcmp(g->model, served) != 0)
        return tdm_error_set_field(err, TDM_ENOTFOUND, "model",
                                   "model '%s' is not served here; this router serves '%s'",
                                   g->model, served);
    if (g->max_tokens < 0)
        return tdm_error_set_field(err, TDM_EINVALID, "max_tokens",
                                   "max_tokens must be >= 1 (or 0: what fits), got %" PRId32,
                                   g->max_tokens);
    if ((rc = choices_check(g, err)) != TDM_OK || (rc = stop_copy(g, q, err)) != TDM_OK ||
        (rc = sampling_build(r, g, q, err)) != TDM_OK ||
        (rc = tokenize_input(r, g, q, why, err)) != TDM_OK ||
        (rc = max_tokens_decide(r, g, q, why, err)) != TDM_OK ||
        (rc = constraint_build(g, q, err)) != TDM_OK)
        return rc;
    q->stream = g->stream;
    q->include_stop_str = g->include_stop_str;
    q->echo = g->echo_token_text;
    q->no_speculation = g->speculative == TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF;
    return TDM_OK;
}

/* Ends a refused GENERATE call: counted, logged (id: the request's, NULL when it has none
 * yet), END with err's status and message and, when err names a field or why (NULL: none) a
 * length, its ErrorDetail. */
static void reply_refused(tdm_router_t *r, const tdm_frame_t *f, const char *id,
                          const tdm_error_t *err, const refusal_t *why)
{
    char kv[96];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(err->code));
    tdm_log_write(&r->log, TDM_LOG_INFO, id, kv, "request refused: %s", err->msg);
    rt_count_end(r, err->code, -1);
    Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
    d.field = (char *)err->field;
    if (why) {
        d.prompt_tokens = why->prompt_tokens;
        d.n_ctx = why->n_ctx;
        d.max_tokens_fit = why->max_tokens_fit;
    }
    tdm_send_t m = {
        .peer = f->peer,
        .peer_len = f->peer_len,
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
        .method = f->method,
        .call_id = f->call_id,
        .status = err->code,
        .message = err->msg,
        .body = err->field[0] || d.n_ctx ? &d.base : NULL,
    };
    if (tdm_sock_send(r->client, &m) != TDM_OK)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, id, NULL, "the refusal was not sent: %s",
                      tdm_sock_errmsg(r->client));
}

/* Frees a request that never entered the table. NULL-safe. */
static void req_discard(rt_req_t *q)
{
    if (!q)
        return;
    free(q->prompt);
    free(q->gbnf);
    for (size_t i = 0; i < q->n_stop; i++)
        free(q->stop[i]);
    free(q->stop);
    free(q->tried);
    free(q);
}

/* A new request for the call f from its decoded body g, validated; NULL after the refusal
 * has been sent. */
static rt_req_t *req_from_call(tdm_router_t *r, const tdm_frame_t *f,
                               const Tandem__V1__GenerateRequest *g, double now, uint64_t now_ms)
{
    tdm_error_t err = {0};
    refusal_t why = {0};
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
        rc = build_request(r, g, id_wire_len, q, &why, &err);
    }
    /* tried and timed_out share one allocation */
    if (rc == TDM_OK && !(q->tried = calloc(2 * (r->n_nodes ? r->n_nodes : 1), sizeof *q->tried)))
        rc = tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    if (rc == TDM_OK)
        q->timed_out = q->tried + (r->n_nodes ? r->n_nodes : 1);
    if (rc == TDM_OK)
        return q;
    reply_refused(r, f, q && q->id[0] ? q->id : NULL, &err, &why);
    req_discard(q);
    return NULL;
}

/* Refuses q, which no decode node up can finish before its deadline (admission control, e:
 * the soonest node's estimate): RESOURCE_EXHAUSTED before anything is dispatched, with
 * ErrorDetail.retry_after_s (whole seconds, at least 1): when the requests ahead will have
 * drained (the earliest start, or later when the batch they make is what is too slow). When
 * q could not finish in time even alone on an idle node, the message says that retrying as
 * it is cannot help. */
static void req_shed(tdm_router_t *r, rt_req_t *q, const rt_admit_estimate_t *e, uint64_t now_ms)
{
    double left_s = q->deadline_ms > now_ms ? (double)(q->deadline_ms - now_ms) / 1000.0 : 0;
    bool never = e->alone_s > left_s;
    double retry = ceil(e->drain_s > e->start_s ? e->drain_s : e->start_s);
    Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
    d.retry_after_s = retry < 1 ? 1 : retry > 86400 ? 86400 : (uint32_t)retry;
    char msg[TDM_ERRMSG_MAX];
    snprintf(msg, sizeof msg,
             "the cluster cannot finish this request before its deadline: earliest start in "
             "~%.1f s, finish in ~%.1f s, %.1f s left; %s %" PRIu32 " s",
             e->start_s, e->finish_s, left_s,
             never ? "alone on an idle node it would still take longer: send a longer "
                     "deadline or a smaller max_tokens; retry after"
                   : "retry after",
             d.retry_after_s);
    r->metrics.shed++;
    req_fail_with(r, q, TDM_ERESOURCE, false, &d.base, msg);
}

/* Hands an accepted request to a decode node, or queues it (FIFO: behind requests already
 * waiting); refuses it when no decode node up could finish it before its deadline. */
static void req_admit(tdm_router_t *r, rt_req_t *q)
{
    rt_admit_estimate_t e;
    uint64_t now_ms = tdm_net_now_ms();
    if (r->cfg->router.admission_control && !rt_admit_ok(r, q, now_ms, &e)) {
        req_shed(r, q, &e, now_ms);
        return;
    }
    int rc = rt_queue_first(r) ? 1 : rt_dispatch(r, q);
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

/* A copy of q (validated, in the table) for choice i of its call: seed + i, not in the table.
 * NULL on out of memory. */
static rt_req_t *req_clone(const tdm_router_t *r, const rt_req_t *q, uint32_t i)
{
    rt_req_t *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    memcpy(c->id, q->id, sizeof c->id);
    memcpy(c->peer, q->peer, q->peer_len);
    c->peer_len = q->peer_len;
    c->call_id = q->call_id;
    c->stream = q->stream;
    c->include_stop_str = q->include_stop_str;
    c->echo = q->echo;
    c->sp = q->sp;
    c->sp.seed = q->sp.seed + i;
    c->deadline_ms = q->deadline_ms;
    c->t_arrival = q->t_arrival;
    c->gbnf_hash = q->gbnf_hash;
    c->choice = i;
    tdm_detok_init(&c->detok, r->tok, false);
    size_t nn = r->n_nodes ? r->n_nodes : 1;
    bool ok = (c->prompt = malloc((size_t)q->n_prompt * sizeof *c->prompt)) != NULL &&
              (!q->gbnf || (c->gbnf = tdm_strdup(q->gbnf)) != NULL) &&
              (!q->n_stop || (c->stop = calloc(q->n_stop, sizeof *c->stop)) != NULL) &&
              (c->tried = calloc(2 * nn, sizeof *c->tried)) != NULL;
    if (ok)
        memcpy(c->prompt, q->prompt, (size_t)q->n_prompt * sizeof *c->prompt);
    c->n_prompt = q->n_prompt;
    for (size_t k = 0; ok && k < q->n_stop; k++, c->n_stop++)
        ok = (c->stop[k] = tdm_strdup(q->stop[k])) != NULL;
    if (!ok) {
        req_discard(c);
        return NULL;
    }
    c->timed_out = c->tried + nn;
    return c;
}

/* Makes q (in the table) choice 0 of n and enters choices 1..n-1 into the table. On out of
 * memory returns TDM_ERESOURCE with the choices made so far in q->group (possibly none). */
static int group_spawn(tdm_router_t *r, rt_req_t *q, uint32_t n)
{
    rt_group_t *g = calloc(1, sizeof *g);
    if (!g)
        return TDM_ERESOURCE;
    g->n = n;
    g->kids[0] = q;
    g->n_live = 1;
    g->refs = 2; /* q, and the intake's hold */
    q->group = g;
    for (uint32_t i = 1; i < n; i++) {
        rt_req_t *c = req_clone(r, q, i);
        if (!c || !hash_insert(r, c)) {
            req_discard(c);
            return TDM_ERESOURCE;
        }
        c->group = g;
        g->kids[i] = c;
        g->n_live++;
        g->refs++;
    }
    return TDM_OK;
}

/* The n choices of q's call, each admitted as a request of its own (choice 0 first, so the
 * others find its decode node to fork on); one refused ends them all. */
static void group_admit(tdm_router_t *r, rt_req_t *q, uint32_t n)
{
    int rc = group_spawn(r, q, n);
    rt_group_t *g = q->group;
    if (rc != TDM_OK) {
        rt_req_fail(r, q, TDM_ERESOURCE, false, "router out of memory");
    } else {
        for (uint32_t i = 0; i < n; i++)
            if (g->kids[i])
                req_admit(r, g->kids[i]);
    }
    if (g)
        group_unref(g);
}

void rt_generate(tdm_router_t *r, const tdm_frame_t *f)
{
    r->metrics.requests_total++;
    double now = tdm_time_now();
    uint64_t now_ms = tdm_net_now_ms();
    tdm_error_t err = {0};
    if (tdm_frame_expired(f, now_ms)) {
        tdm_error_set(&err, TDM_EDEADLINE, "the request's deadline had passed when it arrived");
        reply_refused(r, f, NULL, &err, NULL);
        return;
    }
    Tandem__V1__GenerateRequest *g = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
        f, &tandem__v1__generate_request__descriptor);
    if (!g) {
        tdm_error_set(&err, TDM_EINVALID, "the body does not decode as a GenerateRequest");
        reply_refused(r, f, NULL, &err, NULL);
        return;
    }
    rt_req_t *q = req_from_call(r, f, g, now, now_ms);
    uint32_t n_choices = g->n > 1 ? g->n : 1;
    protobuf_c_message_free_unpacked(&g->base, NULL);
    if (!q)
        return;
    if (!hash_insert(r, q)) {
        tdm_error_set(&err, TDM_ERESOURCE, "router out of memory");
        reply_refused(r, f, q->id, &err, NULL);
        req_discard(q);
        return;
    }
    q->chunk.index = 0;
    r->metrics.prompt_tokens += q->n_prompt;
    char kv[200];
    snprintf(kv, sizeof kv,
             "prompt_tokens=%" PRIu32 " max_tokens=%" PRId32
             " stream=%s stop_strings=%zu n=%" PRIu32,
             q->n_prompt, q->sp.max_tokens, q->stream ? "true" : "false", q->n_stop, n_choices);
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, kv, "request accepted");
    rt_hist_observe_count(&r->metrics.params_n, n_choices);
    rt_hist_observe_count(&r->metrics.params_max_tokens, (uint32_t)q->sp.max_tokens);
    if (n_choices > 1)
        group_admit(r, q, n_choices);
    else
        req_admit(r, q);
}
