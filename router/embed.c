/* embed.c - EMBED calls in the router (embed.h): intake, one EmbedTask attempt per input, the
 * vectors gathered in input order, retry, deadline, cancel, node loss and shutdown.
 *
 * Where an input runs: a prefill node of the call's model, the one with the fewest embedding
 * tokens outstanding from this router; when the model has no prefill node up (and not
 * suspect), a decode node the same way (docs/architecture.md "Embeddings"). A node computes the
 * input like a prefill, in the same forward passes as its other work, and keeps no KV. At most
 * RT_EMBED_WINDOW inputs of one call are on the nodes at a time, and at most max_running
 * (the node's running batch, from its registration) embedding inputs on one node: the rest wait
 * in the router, the calls served first come first (each one's window in turn), so a flood of
 * inputs waits here instead of filling the nodes' worker queues. A call none of whose inputs is
 * on a node counts as queued, one with any as running (rt_embed_count: the router's
 * requests_queued / requests_running, next to GENERATE's); a new call that would wait while
 * router.max_queue requests already wait is refused RESOURCE_EXHAUSTED "queue full", as a
 * generate request is. An input whose node fails it retryably, or goes down, is sent again
 * (another node when there is one) up to RT_EMBED_TRIES times; then, or on any other failure,
 * the whole call fails with the node's reason. The calls live here, apart from GENERATE's
 * request table: they hold no KV on the router's books and stream nothing.
 */
#include "embed.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nodes.h"
#include "scheduler.h"
#include "tandem/prompt.h"

#define RT_EMBED_TRIES 3u /* attempts per input */

typedef struct rt_embed_call rt_embed_call_t;

/* One input of a call. */
typedef struct rt_embed_item {
    rt_embed_call_t *call;
    uint32_t index;
    int32_t *ids; /* [n] heap */
    uint32_t n;
    uint64_t attempt_id; /* the attempt on a node; 0 = not sent, or done */
    rt_node_t *node;     /* where attempt_id runs */
    uint32_t tries;
    bool done;
    bool resend;                 /* its attempt failed and it waits for a node with room */
    rt_index_entry_t by_attempt; /* in the table's index while attempt_id != 0 */
} rt_embed_item_t;

struct rt_embed_call {
    tdm_list_t link; /* on the table's calls */
    char id[TDM_REQUEST_ID_MAX + 1];
    uint8_t peer[TDM_NET_PEER_MAX];
    size_t peer_len;
    uint64_t call_id;
    rt_model_t *model;
    Tandem__V1__Pooling pooling;
    uint64_t deadline_ms; /* unix ms; 0 = none */
    double t_arrival;
    rt_embed_item_t *items; /* [n_items] */
    uint32_t n_items, n_done, n_inflight, next;
    uint32_t n_resend; /* items with resend set */
    uint32_t n_embd;
    float *vecs; /* [n_items][n_embd] */
    uint64_t prompt_tokens;
};

/* The router's EMBED calls (r->embeds). */
struct rt_embeds {
    tdm_list_t calls;
    rt_index_t by_attempt; /* items by attempt id */
    size_t n_calls;
    bool pumping; /* in pump_all (a call it ends must not start another pass) */
};

/* What item_send did. */
typedef enum { SEND_OK, SEND_NO_ROOM, SEND_NO_NODE } send_result_t;

int tdm_router_embed_check(const int32_t *ids, size_t n, uint32_t n_vocab, uint32_t n_ctx,
                           const char *what, tdm_error_t *err)
{
    if (n == 0 || n > n_ctx)
        return tdm_error_set_field(err, TDM_EINVALID, what,
                                   "%s: %zu tokens; an input is 1..%u tokens (the context)", what,
                                   n, n_ctx);
    for (size_t j = 0; j < n; j++)
        if (ids[j] < 0 || (uint32_t)ids[j] >= n_vocab) {
            char field[TDM_ERRFIELD_MAX];
            snprintf(field, sizeof field, "%s[%zu]", what, j);
            return tdm_error_set_field(err, TDM_EINVALID, field,
                                       "%s: token id %d is outside the vocabulary [0, %u)", field,
                                       ids[j], n_vocab);
        }
    return TDM_OK;
}

int rt_embed_init(tdm_router_t *r)
{
    struct rt_embeds *t = calloc(1, sizeof *t);
    if (!t)
        return TDM_ERESOURCE;
    tdm_list_init(&t->calls);
    if (rt_index_init(&t->by_attempt, 64) != TDM_OK) {
        free(t);
        return TDM_ERESOURCE;
    }
    r->embeds = t;
    return TDM_OK;
}

/* ---- a call's end ---- */

/* Counts an ended call (model NULL: refused before its model was known) with its final status
 * and, answered, its prompt tokens. */
static void count_end(tdm_router_t *r, rt_model_t *model, int status, uint64_t prompt_tokens)
{
    size_t s = (size_t)-status < 17 ? (size_t)-status : 2; /* 2: UNKNOWN */
    tdm_router_metrics_t *ms[2] = {&r->metrics, model ? &model->metrics : NULL};
    for (int i = 0; i < 2; i++) {
        if (!ms[i])
            continue;
        ms[i]->embed_requests_by_status[s]++;
        ms[i]->embed_prompt_tokens += prompt_tokens;
        ms[i]->prompt_tokens += prompt_tokens;
        ms[i]->computed_prompt_tokens += prompt_tokens; /* never from the prefix cache */
    }
}

/* Takes item it off its node: the index entry, the node's count and, with cancel, a
 * NodeCancel so the node stops computing it. */
static void item_unsend(tdm_router_t *r, rt_embed_item_t *it, bool cancel)
{
    if (!it->attempt_id)
        return;
    rt_index_remove(&r->embeds->by_attempt, &it->by_attempt);
    rt_node_t *n = it->node;
    n->embed_tokens -= n->embed_tokens >= it->n ? it->n : n->embed_tokens;
    n->embed_inputs -= n->embed_inputs > 0;
    if (cancel && n->up) {
        Tandem__V1__NodeCancel c = TANDEM__V1__NODE_CANCEL__INIT;
        c.request_id = it->call->id;
        c.attempt_id = it->attempt_id;
        c.status = tdm_proto_status_to_wire(TDM_ECANCELLED);
        rt_node_notify(r, n, TANDEM__V1__METHOD__METHOD_NODE_CANCEL, &c.base);
    }
    it->call->n_inflight--;
    it->attempt_id = 0;
    it->node = NULL;
}

static void call_free(tdm_router_t *r, rt_embed_call_t *c)
{
    for (uint32_t i = 0; i < c->n_items; i++) {
        item_unsend(r, &c->items[i], true);
        free(c->items[i].ids);
    }
    if (!tdm_list_is_empty(&c->link)) {
        tdm_list_remove(&c->link);
        r->embeds->n_calls--;
    }
    free(c->items);
    free(c->vecs);
    free(c);
}

/* Ends c with status and the formatted reason (an END to the client), counts it, frees it. */
static void call_fail(tdm_router_t *r, rt_embed_call_t *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void call_fail(tdm_router_t *r, rt_embed_call_t *c, int status, const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char kv[64];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(status));
    tdm_log_write(&r->log, TDM_LOG_INFO, c->id, kv, "embedding call failed: %s", msg);
    tdm_send_t m = {.peer = c->peer,
                    .peer_len = c->peer_len,
                    .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
                    .method = TANDEM__V1__METHOD__METHOD_EMBED,
                    .call_id = c->call_id,
                    .status = status,
                    .message = msg};
    tdm_sock_send(r->client, &m);
    count_end(r, c->model, status, 0);
    call_free(r, c);
}

/* Every input is done: the EmbedResponse, then c is freed. */
static void call_complete(tdm_router_t *r, rt_embed_call_t *c)
{
    Tandem__V1__Embedding *rows = calloc(c->n_items, sizeof *rows);
    Tandem__V1__Embedding **rowp = calloc(c->n_items, sizeof *rowp);
    if (!rows || !rowp) {
        free(rows);
        free(rowp);
        call_fail(r, c, TDM_ERESOURCE, "out of memory for the answer");
        return;
    }
    for (uint32_t i = 0; i < c->n_items; i++) {
        tandem__v1__embedding__init(&rows[i]);
        rows[i].index = i;
        rows[i].embedding = c->vecs + (size_t)i * c->n_embd;
        rows[i].n_embedding = c->n_embd;
        rows[i].prompt_tokens = c->items[i].n;
        rowp[i] = &rows[i];
    }
    Tandem__V1__EmbedResponse resp = TANDEM__V1__EMBED_RESPONSE__INIT;
    resp.request_id = c->id;
    resp.model = (char *)(uintptr_t)c->model->cfg->name;
    resp.data = rowp;
    resp.n_data = c->n_items;
    resp.prompt_tokens = (uint32_t)c->prompt_tokens;
    tdm_send_t m = {.peer = c->peer,
                    .peer_len = c->peer_len,
                    .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
                    .method = TANDEM__V1__METHOD__METHOD_EMBED,
                    .call_id = c->call_id,
                    .body = &resp.base};
    if (tdm_sock_send(r->client, &m) != TDM_OK) {
        /* the client still gets an END: a small one */
        char msg[300];
        snprintf(msg, sizeof msg, "the embeddings could not be sent: %s",
                 tdm_sock_errmsg(r->client));
        free(rows);
        free(rowp);
        call_fail(r, c, TDM_EINTERNAL, "%s", msg);
        return;
    }
    count_end(r, c->model, TDM_OK, c->prompt_tokens);
    tdm_log_write(&r->log, TDM_LOG_DEBUG, c->id, NULL,
                  "embeddings done inputs=%u prompt_tokens=%" PRIu64 " seconds=%.4f", c->n_items,
                  c->prompt_tokens, tdm_time_now() - c->t_arrival);
    free(rows);
    free(rowp);
    call_free(r, c);
}

/* ---- dispatch ---- */

/* Embedding inputs node n takes from this router at once: its running batch. */
static uint32_t node_room(const rt_node_t *n)
{
    uint32_t cap = n->max_running ? n->max_running : 1;
    return n->embed_inputs < cap ? cap - n->embed_inputs : 0;
}

/* The node of model m with role for an input: up, not suspect, with room, fewest embedding
 * tokens outstanding; avoid only when no other node qualifies. NULL when none; *up set when a
 * node of the role is up (not suspect), with room or not. */
static rt_node_t *pick_role(tdm_router_t *r, const rt_model_t *m, tdm_node_role_t role,
                            const rt_node_t *avoid, bool *up)
{
    rt_node_t *best = NULL;
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        if (n->model != m || !n->up || n->suspect || n->cfg->role != role)
            continue;
        *up = true;
        if (!node_room(n))
            continue;
        if (!best || (best == avoid && n != avoid) ||
            (n != avoid && n->embed_tokens < best->embed_tokens))
            best = n;
    }
    return best;
}

/* Prefill nodes first; decode nodes when the model has no prefill node up. NULL with *res
 * SEND_NO_ROOM (the nodes up are full) or SEND_NO_NODE (none is up). */
static rt_node_t *pick_node(tdm_router_t *r, const rt_model_t *m, const rt_node_t *avoid,
                            send_result_t *res)
{
    bool prefill_up = false, decode_up = false;
    rt_node_t *n = pick_role(r, m, TDM_NODE_ROLE_PREFILL, avoid, &prefill_up);
    if (!n && !prefill_up)
        n = pick_role(r, m, TDM_NODE_ROLE_DECODE, avoid, &decode_up);
    *res = n ? SEND_OK : prefill_up || decode_up ? SEND_NO_ROOM : SEND_NO_NODE;
    return n;
}

/* Sends item it as a new attempt on a node (not avoid, when another is up). SEND_NO_ROOM when
 * the model's nodes up have no room, SEND_NO_NODE when none is up. */
static send_result_t item_send(tdm_router_t *r, rt_embed_item_t *it, const rt_node_t *avoid)
{
    rt_embed_call_t *c = it->call;
    send_result_t res;
    rt_node_t *n = pick_node(r, c->model, avoid, &res);
    if (!n)
        return res;
    if (it->resend) {
        it->resend = false;
        c->n_resend--;
    }
    it->attempt_id = rt_sched_next_attempt(r);
    it->node = n;
    it->tries++;
    rt_index_insert(&r->embeds->by_attempt, &it->by_attempt,
                    rt_index_hash(&it->attempt_id, sizeof it->attempt_id, 0));
    n->embed_tokens += it->n;
    n->embed_inputs++;
    c->n_inflight++;
    Tandem__V1__SequenceSpec spec = TANDEM__V1__SEQUENCE_SPEC__INIT;
    spec.request_id = c->id;
    spec.attempt_id = it->attempt_id;
    spec.prompt_tokens = it->ids;
    spec.n_prompt_tokens = it->n;
    spec.deadline_unix_ms = c->deadline_ms;
    Tandem__V1__EmbedTask t = TANDEM__V1__EMBED_TASK__INIT;
    t.spec = &spec;
    t.pooling = c->pooling;
    rt_node_notify(r, n, TANDEM__V1__METHOD__METHOD_EMBED_TASK, &t.base);
    return SEND_OK;
}

#define NO_NODE_FMT                                                                                \
    "no node of model '%s' is up to compute embeddings (prefill nodes serve them, decode nodes "   \
    "when the model has no prefill node)"

/* The call's next input to send: one waiting to be sent again first, else the next new one;
 * NULL when none is left. */
static rt_embed_item_t *next_item(rt_embed_call_t *c)
{
    for (uint32_t i = 0; c->n_resend && i < c->next; i++)
        if (c->items[i].resend)
            return &c->items[i];
    return c->next < c->n_items ? &c->items[c->next] : NULL;
}

/* Sends the call's next inputs while its window and the nodes have room. false when c failed
 * (and was freed) because no node is up. */
static bool call_pump(tdm_router_t *r, rt_embed_call_t *c)
{
    rt_embed_item_t *it;
    while (c->n_inflight < RT_EMBED_WINDOW && (it = next_item(c)) != NULL) {
        bool fresh = it == &c->items[c->next];
        send_result_t res = item_send(r, it, NULL);
        if (res == SEND_NO_ROOM || (res == SEND_NO_NODE && c->n_inflight > 0))
            return true; /* the rest go when a node has room again */
        if (res == SEND_NO_NODE) {
            call_fail(r, c, TDM_EUNAVAILABLE, NO_NODE_FMT, c->model->cfg->name);
            return false;
        }
        if (fresh)
            c->next++;
    }
    return true;
}

/* Sends what the waiting calls can send, oldest first (after anything that may have made room:
 * an answer, a failure, a call's end, a node up). */
static void pump_all(tdm_router_t *r)
{
    struct rt_embeds *t = r->embeds;
    if (t->pumping)
        return;
    t->pumping = true;
    tdm_list_t *pos, *tmp;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &t->calls)
    {
        rt_embed_call_t *c = TDM_LIST_ENTRY(pos, rt_embed_call_t, link);
        call_pump(r, c); /* false: c failed and was freed; the next is still linked */
    }
    t->pumping = false;
}

void rt_embed_count(const tdm_router_t *r, const rt_model_t *m, size_t *running, size_t *queued)
{
    *running = *queued = 0;
    if (!r->embeds)
        return;
    for (tdm_list_t *e = tdm_list_first(&r->embeds->calls); e;
         e = tdm_list_next(&r->embeds->calls, e)) {
        const rt_embed_call_t *c = TDM_LIST_ENTRY(e, rt_embed_call_t, link);
        if (m && c->model != m)
            continue;
        if (c->n_inflight > 0)
            (*running)++;
        else
            (*queued)++;
    }
}

/* Item it's attempt failed (status, why) on its node: again elsewhere while retryable and under
 * RT_EMBED_TRIES, else the call fails. */
static void item_retry(tdm_router_t *r, rt_embed_item_t *it, bool retryable, int status,
                       const char *why)
{
    rt_embed_call_t *c = it->call;
    rt_node_t *was = it->node;
    item_unsend(r, it, false);
    send_result_t res = SEND_NO_NODE;
    if (retryable && it->tries < RT_EMBED_TRIES && (res = item_send(r, it, was)) == SEND_OK)
        return;
    if (res == SEND_NO_ROOM) { /* the nodes up are full: it waits for room (pump_all) */
        it->resend = true;
        c->n_resend++;
        return;
    }
    call_fail(r, c, status, "input[%u]: %s", it->index, why);
}

/* The item of attempt (in flight), or NULL. */
static rt_embed_item_t *item_find(tdm_router_t *r, uint64_t attempt)
{
    uint64_t h = rt_index_hash(&attempt, sizeof attempt, 0);
    for (rt_index_entry_t *e = rt_index_first(&r->embeds->by_attempt, h); e; e = rt_index_next(e)) {
        rt_embed_item_t *it = TDM_CONTAINER_OF(e, rt_embed_item_t, by_attempt);
        if (it->attempt_id == attempt)
            return it;
    }
    return NULL;
}

void rt_embed_on_result(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__EmbeddingResult *er = (Tandem__V1__EmbeddingResult *)tdm_frame_unpack(
        f, &tandem__v1__embedding_result__descriptor);
    if (!er)
        return;
    rt_embed_item_t *it = item_find(r, er->attempt_id);
    if (!it || it->node != n) {
        r->metrics.stale_attempt_messages++;
        tdm_log_write(&r->log, TDM_LOG_DEBUG, er->request_id, NULL,
                      "ignoring an EmbeddingResult of attempt %016" PRIx64 " from %s",
                      er->attempt_id, n->cfg->id);
        goto out_free;
    }
    rt_embed_call_t *c = it->call;
    if (er->n_embedding != c->n_embd || er->prompt_tokens != it->n) {
        char why[160];
        snprintf(why, sizeof why,
                 "node '%s' answered %zu values for %u tokens; the model has %u for %u", n->cfg->id,
                 er->n_embedding, er->prompt_tokens, c->n_embd, it->n);
        item_retry(r, it, false, TDM_EINTERNAL, why);
        goto out_free;
    }
    memcpy(c->vecs + (size_t)it->index * c->n_embd, er->embedding, c->n_embd * sizeof(float));
    item_unsend(r, it, false);
    it->done = true;
    c->n_done++;
    c->prompt_tokens += it->n;
    if (c->n_done == c->n_items)
        call_complete(r, c);
    pump_all(r); /* the node has room for one more */
out_free:
    tandem__v1__embedding_result__free_unpacked(er, NULL);
}

bool rt_embed_task_failed(tdm_router_t *r, rt_node_t *n, const Tandem__V1__TaskFailed *tf)
{
    rt_embed_item_t *it = item_find(r, tf->attempt_id);
    if (!it)
        return false;
    if (it->node != n)
        return true; /* not where it runs: stale */
    int status = tdm_proto_status_from_wire(tf->status);
    /* the router checked the input: whatever the node refuses is the cluster's fault */
    if (status != TDM_ERESOURCE && status != TDM_EDEADLINE && status != TDM_EUNAVAILABLE)
        status = TDM_EINTERNAL;
    char why[TDM_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s node '%s' failed: %s", tdm_config_node_role_name(n->cfg->role),
             n->cfg->id, tf->message ? tf->message : "");
    item_retry(r, it, tf->retryable, status, why);
    pump_all(r);
    return true;
}

void rt_embed_node_down(tdm_router_t *r, rt_node_t *n)
{
    tdm_list_t *pos, *tmp;
restart:
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->embeds->calls)
    {
        rt_embed_call_t *c = TDM_LIST_ENTRY(pos, rt_embed_call_t, link);
        for (uint32_t i = 0; i < c->n_items; i++) {
            rt_embed_item_t *it = &c->items[i];
            if (it->attempt_id && it->node == n) {
                char why[160];
                snprintf(why, sizeof why, "node '%s' went down while computing it", n->cfg->id);
                size_t before = r->embeds->n_calls;
                item_retry(r, it, true, TDM_EUNAVAILABLE, why);
                if (r->embeds->n_calls != before)
                    goto restart; /* c was freed */
            }
        }
    }
    pump_all(r);
}

void rt_embed_timers(tdm_router_t *r, uint64_t now_ms)
{
    tdm_list_t *pos, *tmp;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->embeds->calls)
    {
        rt_embed_call_t *c = TDM_LIST_ENTRY(pos, rt_embed_call_t, link);
        if (c->deadline_ms && now_ms >= c->deadline_ms)
            call_fail(r, c, TDM_EDEADLINE,
                      "deadline passed while computing embeddings (%u of %u inputs done)",
                      c->n_done, c->n_items);
    }
    pump_all(r); /* a node that came up, calls that ended */
}

void rt_embed_shutdown(tdm_router_t *r)
{
    if (!r->embeds)
        return;
    tdm_list_t *pos, *tmp;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->embeds->calls)
    call_fail(r, TDM_LIST_ENTRY(pos, rt_embed_call_t, link), TDM_EUNAVAILABLE,
              "router shutting down");
}

void rt_embed_fini(tdm_router_t *r)
{
    if (!r->embeds)
        return;
    tdm_list_t *pos, *tmp;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->embeds->calls)
    call_free(r, TDM_LIST_ENTRY(pos, rt_embed_call_t, link));
    rt_index_fini(&r->embeds->by_attempt);
    free(r->embeds);
    r->embeds = NULL;
}

bool rt_embed_cancel(tdm_router_t *r, const tdm_frame_t *f)
{
    tdm_list_t *pos, *tmp;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->embeds->calls)
    {
        rt_embed_call_t *c = TDM_LIST_ENTRY(pos, rt_embed_call_t, link);
        if (c->call_id == f->call_id && c->peer_len == f->peer_len &&
            memcmp(c->peer, f->peer, f->peer_len) == 0) {
            tdm_log_write(&r->log, TDM_LOG_DEBUG, c->id, NULL, "embedding call cancelled");
            count_end(r, c->model, TDM_ECANCELLED, 0);
            call_free(r, c);
            pump_all(r);
            return true;
        }
    }
    return false;
}

/* ---- intake ---- */

/* The call's inputs from the request, tokenized and checked (TDM_EINVALID naming the field). */
static int take_inputs(rt_embed_call_t *c, const Tandem__V1__EmbedRequest *q, tdm_error_t *err)
{
    const rt_model_t *m = c->model;
    bool texts = q->n_texts > 0;
    for (uint32_t i = 0; i < c->n_items; i++) {
        rt_embed_item_t *it = &c->items[i];
        it->call = c;
        it->index = i;
        char what[48];
        if (texts) {
            snprintf(what, sizeof what, "texts[%u]", i);
            const char *s = q->texts[i] ? q->texts[i] : "";
            if (!s[0])
                return tdm_error_set_field(err, TDM_EINVALID, what,
                                           "%s: empty; an input is 1..%u tokens", what, m->n_ctx);
            /* a token stands for at most max_token_bytes bytes: a longer text has more tokens
             * than the context, refused before tokenizing it on the router's loop */
            size_t len = strlen(s), max_len = (size_t)m->n_ctx * m->max_token_bytes - 1;
            if (len > max_len)
                return tdm_error_set_field(err, TDM_EINVALID, what,
                                           "%s is %zu bytes, so more than %u tokens (a token of "
                                           "this model stands for at most %u bytes); an input is "
                                           "1..%u tokens",
                                           what, len, m->n_ctx, m->max_token_bytes, m->n_ctx);
            tdm_prompt_input_t in = {.text = s, .text_len = len};
            tdm_token_t *ids = NULL;
            size_t n = 0;
            int rc = tdm_prompt_encode(m->tok, NULL, &in, &ids, &n, NULL, err);
            if (rc != TDM_OK)
                return tdm_error_field(err, "%s", what);
            it->ids = ids;
            it->n = (uint32_t)(n < UINT32_MAX ? n : UINT32_MAX);
            if (tdm_router_embed_check(it->ids, n, m->n_vocab, m->n_ctx, what, err) != TDM_OK)
                return TDM_EINVALID;
        } else {
            snprintf(what, sizeof what, "token_inputs[%u].ids", i);
            const Tandem__V1__TokenList *tl = q->token_inputs[i];
            size_t n = tl ? tl->n_ids : 0;
            if (tdm_router_embed_check(tl ? tl->ids : NULL, n, m->n_vocab, m->n_ctx, what, err) !=
                TDM_OK)
                return TDM_EINVALID;
            it->ids = malloc(n * sizeof *it->ids);
            if (!it->ids)
                return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
            memcpy(it->ids, tl->ids, n * sizeof *it->ids);
            it->n = (uint32_t)n;
        }
    }
    return TDM_OK;
}

/* The request's checks that need no allocation, and the call's model. */
static int check_request(tdm_router_t *r, const Tandem__V1__EmbedRequest *q, rt_model_t **model,
                         tdm_error_t *err)
{
    *model = q->model && q->model[0] ? rt_model_find(r, q->model) : &r->models[0];
    if (!*model)
        return tdm_error_set_field(err, TDM_ENOTFOUND, "model", "model '%.200s' is not served here",
                                   q->model);
    if (q->n_texts && q->n_token_inputs)
        return tdm_error_set_field(err, TDM_EINVALID, "token_inputs",
                                   "token_inputs: give texts or token_inputs, not both");
    size_t n = q->n_texts + q->n_token_inputs;
    if (n == 0 || n > RT_EMBED_MAX_INPUTS)
        return tdm_error_set_field(err, TDM_EINVALID, q->n_texts ? "texts" : "token_inputs",
                                   "%s: %zu inputs; a call takes 1..%u",
                                   q->n_texts ? "texts" : "token_inputs", n, RT_EMBED_MAX_INPUTS);
    /* the answer is one EmbedResponse frame: n vectors of n_embd floats (and a few bytes of
     * framing each) must fit TDM_NET_MAX_BODY_BYTES */
    uint32_t n_embd = tdm_model_hparams((*model)->model)->n_embd;
    size_t max_n = (TDM_NET_MAX_BODY_BYTES - 4096u) / ((size_t)n_embd * 4u + 32u);
    if (n > max_n)
        return tdm_error_set_field(err, TDM_EINVALID, q->n_texts ? "texts" : "token_inputs",
                                   "%s: %zu inputs; the answer of a call holds at most %zu vectors "
                                   "of %u floats (%u bytes a frame)",
                                   q->n_texts ? "texts" : "token_inputs", n, max_n, n_embd,
                                   TDM_NET_MAX_BODY_BYTES);
    if (q->pooling != TANDEM__V1__POOLING__POOLING_LAST &&
        q->pooling != TANDEM__V1__POOLING__POOLING_MEAN)
        return tdm_error_set_field(err, TDM_EINVALID, "pooling",
                                   "pooling: %d is not LAST (0) or MEAN (1)", (int)q->pooling);
    if (q->request_id && strlen(q->request_id) > TDM_REQUEST_ID_MAX)
        return tdm_error_set_field(err, TDM_EINVALID, "request_id",
                                   "request_id is %zu bytes; at most %u", strlen(q->request_id),
                                   TDM_REQUEST_ID_MAX);
    for (const char *p = q->request_id ? q->request_id : ""; *p; p++)
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f)
            return tdm_error_set_field(err, TDM_EINVALID, "request_id",
                                       "request_id: request ids are printable ASCII characters "
                                       "without spaces");
    return TDM_OK;
}

/* Whether a new call of model m would wait (its nodes up are full) while router.max_queue
 * requests, GENERATE's and EMBED's, already wait: then RESOURCE_EXHAUSTED "queue full" in *err
 * (429 over HTTP, as a generate request's). */
static bool queue_full(tdm_router_t *r, rt_model_t *m, tdm_error_t *err)
{
    size_t running, queued;
    rt_embed_count(r, NULL, &running, &queued);
    size_t waiting = r->n_queued + queued;
    send_result_t room;
    (void)pick_node(r, m, NULL, &room);
    if (room != SEND_NO_ROOM || waiting < (size_t)r->cfg->router.max_queue)
        return false;
    r->metrics.queue_full++;
    m->metrics.queue_full++;
    tdm_error_set(err, TDM_ERESOURCE, "queue full (%zu requests waiting)", waiting);
    return true;
}

/* A refused call: END with the status, the message and an ErrorDetail naming the field. */
static void reply_refused(tdm_router_t *r, const tdm_frame_t *f, const tdm_error_t *err)
{
    tdm_log_write(&r->log, TDM_LOG_INFO, NULL, NULL, "embedding request refused: %s", err->msg);
    Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
    d.field = (char *)err->field;
    tdm_send_t m = {.peer = f->peer,
                    .peer_len = f->peer_len,
                    .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
                    .method = f->method,
                    .call_id = f->call_id,
                    .status = err->code,
                    .message = err->msg,
                    .body = err->field[0] ? &d.base : NULL};
    tdm_sock_send(r->client, &m);
    count_end(r, NULL, err->code, 0);
}

void rt_embed(tdm_router_t *r, const tdm_frame_t *f)
{
    tdm_error_t err = {0};
    if (tdm_frame_expired(f, tdm_net_now_ms())) {
        tdm_error_set(&err, TDM_EDEADLINE, "the request's deadline had passed when it arrived");
        reply_refused(r, f, &err);
        return;
    }
    Tandem__V1__EmbedRequest *q =
        (Tandem__V1__EmbedRequest *)tdm_frame_unpack(f, &tandem__v1__embed_request__descriptor);
    if (!q) {
        tdm_error_set(&err, TDM_EINVALID, "the EmbedRequest does not decode");
        reply_refused(r, f, &err);
        return;
    }
    rt_model_t *model = NULL;
    rt_embed_call_t *c = NULL;
    if (r->shut) {
        tdm_error_set(&err, TDM_EUNAVAILABLE, "router shutting down");
        goto out_refuse;
    }
    if (check_request(r, q, &model, &err) != TDM_OK)
        goto out_refuse;
    c = calloc(1, sizeof *c);
    if (c)
        tdm_list_init(&c->link);
    uint32_t n_items = (uint32_t)(q->n_texts + q->n_token_inputs);
    uint32_t n_embd = tdm_model_hparams(model->model)->n_embd;
    if (!c || !(c->items = calloc(n_items, sizeof *c->items)) ||
        !(c->vecs = malloc((size_t)n_items * n_embd * sizeof *c->vecs))) {
        tdm_error_set(&err, TDM_ERESOURCE, "out of memory for %u inputs", n_items);
        goto out_refuse;
    }
    c->model = model;
    c->n_items = n_items;
    c->n_embd = n_embd;
    c->pooling = q->pooling;
    c->call_id = f->call_id;
    memcpy(c->peer, f->peer, f->peer_len);
    c->peer_len = f->peer_len;
    /* none given: router.request_timeout_s, as for GENERATE */
    c->deadline_ms =
        f->deadline_unix_ms
            ? f->deadline_unix_ms
            : tdm_net_now_ms() + (uint64_t)(r->cfg->router.request_timeout_s * 1000.0 + 0.5);
    c->t_arrival = tdm_time_now();
    if (q->request_id && q->request_id[0])
        snprintf(c->id, sizeof c->id, "%s", q->request_id);
    else
        snprintf(c->id, sizeof c->id, "emb-%016" PRIx64, rt_sched_next_attempt(r));
    if (take_inputs(c, q, &err) != TDM_OK || queue_full(r, model, &err))
        goto out_refuse;
    tandem__v1__embed_request__free_unpacked(q, NULL);
    tdm_list_push_back(&r->embeds->calls, &c->link);
    r->embeds->n_calls++;
    tdm_log_write(&r->log, TDM_LOG_DEBUG, c->id, NULL, "embedding call inputs=%u model=%s",
                  c->n_items, c->model->cfg->name);
    pump_all(r); /* after the calls waiting before it */
    return;

out_refuse:
    if (c)
        call_free(r, c);
    tandem__v1__embed_request__free_unpacked(q, NULL);
    reply_refused(r, f, &err);
}
