/* request.c - GENERATE requests in the router: validation and tokenization, the request
 * table and queue, the ordered token output (reorder buffer, incremental detokenization,
 * stop strings, GenerateChunk streaming) and how a request ends (completed, failed,
 * cancelled, client gone, deadline, shutdown).
 *
 * Tokenization is tdm_prompt_encode (tandem/prompt.h) with the template tdm_chat_template_pick
 * chose at start-up: the one implementation `tandem generate -m` and `tandem tokenize --chat`
 * call too, so they make the same ids of the same input; token-id input is taken as it is.
 * Stop strings: the text that could be the beginning of a stop string is held back until it
 * is known not to be one; on a match the text is cut before it (or after it with
 * include_stop_str) and the decode node is cancelled.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "router_internal.h"

/* ---- request table and queue ---- */

static size_t id_hash(const char *id)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)id; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    return (size_t)(h ^ (h >> 32));
}

rt_req_t *rt_req_find(tdm_router_t *r, const char *id)
{
    for (rt_req_t *q = r->hash[id_hash(id) & (r->hash_cap - 1)]; q; q = q->hnext)
        if (strcmp(q->id, id) == 0)
            return q;
    return NULL;
}

rt_req_t *rt_req_find_attempt(tdm_router_t *r, const char *id, uint64_t attempt, bool *id_known)
{
    *id_known = false;
    for (rt_req_t *q = r->hash[id_hash(id) & (r->hash_cap - 1)]; q; q = q->hnext)
        if (strcmp(q->id, id) == 0) {
            *id_known = true;
            if (q->attempt_id == attempt && attempt != 0)
                return q;
        }
    return NULL;
}

/* The request in flight with this id from this client connection, or NULL. Two clients may
 * use the same id at once (it is their label); one client may not, or it could not tell its
 * own replies apart. */
static rt_req_t *find_for_peer(tdm_router_t *r, const char *id, const uint8_t *peer,
                               size_t peer_len)
{
    for (rt_req_t *q = r->hash[id_hash(id) & (r->hash_cap - 1)]; q; q = q->hnext)
        if (strcmp(q->id, id) == 0 && q->peer_len == peer_len &&
            memcmp(q->peer, peer, peer_len) == 0)
            return q;
    return NULL;
}

/* Inserts q into the id table (growing it); returns false on out of memory. */
static bool hash_insert(tdm_router_t *r, rt_req_t *q)
{
    if (r->n_reqs + 1 > r->hash_cap) {
        size_t cap = r->hash_cap * 2;
        rt_req_t **h = calloc(cap, sizeof *h);
        if (!h)
            return false;
        for (size_t i = 0; i < r->hash_cap; i++)
            for (rt_req_t *p = r->hash[i], *nx; p; p = nx) {
                nx = p->hnext;
                size_t s = id_hash(p->id) & (cap - 1);
                p->hnext = h[s];
                h[s] = p;
            }
        free(r->hash);
        r->hash = h;
        r->hash_cap = cap;
    }
    size_t s = id_hash(q->id) & (r->hash_cap - 1);
    q->hnext = r->hash[s];
    r->hash[s] = q;
    q->next = r->head;
    if (r->head)
        r->head->prev = q;
    r->head = q;
    r->n_reqs++;
    return true;
}

static void hash_remove(tdm_router_t *r, rt_req_t *q)
{
    for (rt_req_t **pp = &r->hash[id_hash(q->id) & (r->hash_cap - 1)]; *pp; pp = &(*pp)->hnext)
        if (*pp == q) {
            *pp = q->hnext;
            break;
        }
    if (q->prev)
        q->prev->next = q->next;
    else
        r->head = q->next;
    if (q->next)
        q->next->prev = q->prev;
    r->n_reqs--;
}

void rt_queue_push(tdm_router_t *r, rt_req_t *q, bool front)
{
    q->state = RT_QUEUED;
    q->queued = true;
    if (front) {
        q->qprev = NULL;
        q->qnext = r->qhead;
        if (r->qhead)
            r->qhead->qprev = q;
        else
            r->qtail = q;
        r->qhead = q;
    } else {
        q->qnext = NULL;
        q->qprev = r->qtail;
        if (r->qtail)
            r->qtail->qnext = q;
        else
            r->qhead = q;
        r->qtail = q;
    }
    r->n_queued++;
}

void rt_queue_remove(tdm_router_t *r, rt_req_t *q)
{
    if (!q->queued)
        return;
    if (q->qprev)
        q->qprev->qnext = q->qnext;
    else
        r->qhead = q->qnext;
    if (q->qnext)
        q->qnext->qprev = q->qprev;
    else
        r->qtail = q->qprev;
    q->qprev = q->qnext = NULL;
    q->queued = false;
    r->n_queued--;
}

/* ---- chunks ---- */

static void top_free(Tandem__V1__TopLogprobs *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->n_entries; i++)
        free(t->entries[i]->text);
    free(t);
}

static void chunk_reset(rt_chunk_t *c, uint32_t index)
{
    for (size_t i = 0; i < c->n; i++) {
        if (c->tops)
            top_free(c->tops[i]);
        if (c->texts)
            free(c->texts[i]);
    }
    c->n = 0;
    c->text_len = 0;
    if (c->text)
        c->text[0] = '\0';
    c->index = index;
}

static void chunk_free(rt_chunk_t *c)
{
    chunk_reset(c, 0);
    free(c->ids);
    free(c->logprobs);
    free(c->tops);
    free(c->texts);
    free(c->text);
    memset(c, 0, sizeof *c);
}

/* Room for one more token (and its optional per-token fields). */
static bool chunk_grow(rt_chunk_t *c, bool logprobs, bool texts)
{
    if (c->n < c->cap)
        return true;
    size_t cap = c->cap ? c->cap * 2 : 16;
    int32_t *ids = realloc(c->ids, cap * sizeof *ids);
    if (!ids)
        return false;
    c->ids = ids;
    if (logprobs) {
        float *lp = realloc(c->logprobs, cap * sizeof *lp);
        if (!lp)
            return false;
        c->logprobs = lp;
        Tandem__V1__TopLogprobs **t = realloc(c->tops, cap * sizeof *t);
        if (!t)
            return false;
        c->tops = t;
    }
    if (texts) {
        char **tx = realloc(c->texts, cap * sizeof *tx);
        if (!tx)
            return false;
        c->texts = tx;
    }
    c->cap = cap;
    return true;
}

/* Appends n bytes to a growable NUL-terminated string (*buf, *len bytes, *cap allocated),
 * doubling from 64 bytes. Returns false on out of memory (the string is unchanged). */
static bool str_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 64;
        while (c < *len + n + 1)
            c *= 2;
        char *t = realloc(*buf, c);
        if (!t)
            return false;
        *buf = t;
        *cap = c;
    }
    if (n)
        memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return true;
}

static bool chunk_text(rt_chunk_t *c, const char *s, size_t n)
{
    return str_append(&c->text, &c->text_len, &c->text_cap, s, n);
}

/* Copies n bytes as valid UTF-8 (each invalid subpart becomes U+FFFD) into a heap string. */
static char *utf8_sanitize(const char *s, size_t n)
{
    char *out = malloc(n * 3 + 1);
    if (!out)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (len) {
            memcpy(out + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    return out;
}

/* The text of one token (special tokens spelled out) as valid UTF-8; heap, NULL on OOM. */
static char *token_text(const tdm_router_t *r, int32_t id)
{
    char small[128];
    int len = tdm_tokenizer_token_bytes(r->tok, id, true, small, sizeof small);
    if (len < 0)
        return tdm_strdup("");
    if ((size_t)len <= sizeof small)
        return utf8_sanitize(small, (size_t)len);
    char *big = malloc((size_t)len);
    if (!big)
        return NULL;
    tdm_tokenizer_token_bytes(r->tok, id, true, big, (size_t)len);
    char *out = utf8_sanitize(big, (size_t)len);
    free(big);
    return out;
}

static Tandem__V1__TopLogprobs *top_make(const tdm_router_t *r, const rt_event_t *ev)
{
    typedef struct holder {
        Tandem__V1__TopLogprobs m; /* first: the holder is freed through &m */
        Tandem__V1__TopLogprob *ptrs[TDM_SAMPLING_MAX_LOGPROBS];
        Tandem__V1__TopLogprob e[TDM_SAMPLING_MAX_LOGPROBS];
    } holder_t;
    holder_t *h = calloc(1, sizeof *h);
    if (!h)
        return NULL;
    tandem__v1__top_logprobs__init(&h->m);
    h->m.entries = h->ptrs;
    for (uint32_t i = 0; i < ev->n_top; i++) {
        tandem__v1__top_logprob__init(&h->e[i]);
        h->e[i].token_id = ev->top[i].token;
        h->e[i].logprob = ev->top[i].logprob;
        h->e[i].text = token_text(r, ev->top[i].token);
        h->ptrs[i] = &h->e[i];
        h->m.n_entries = i + 1;
        if (!h->e[i].text) {
            top_free(&h->m);
            return NULL;
        }
    }
    return &h->m;
}

/* Fills m from q's chunk (pointers into it). */
static void chunk_to_msg(const rt_req_t *q, Tandem__V1__GenerateChunk *m)
{
    const rt_chunk_t *c = &q->chunk;
    tandem__v1__generate_chunk__init(m);
    m->request_id = (char *)q->id;
    m->index = c->index;
    m->n_token_ids = c->n;
    m->token_ids = c->ids;
    m->text = c->text ? c->text : (char *)"";
    if (q->sp.n_logprobs > 0) {
        m->n_logprobs = c->n;
        m->logprobs = c->logprobs;
        m->n_top_logprobs = c->n;
        m->top_logprobs = c->tops;
    }
    if (q->echo) {
        m->n_token_texts = c->n;
        m->token_texts = c->texts;
    }
}

/* ---- ending requests ---- */

void rt_count_end(tdm_router_t *r, int status, int finish)
{
    int code = -status;
    bool known = finish >= 0 && finish < 5;
    if (code >= 0 && code < 17) {
        r->metrics.requests_by_status[code]++;
        r->metrics.requests_by_status_finish[code][known ? finish : 0]++;
    }
    if (known)
        r->metrics.requests_by_finish[finish]++;
}

void rt_node_detach(rt_node_t *n, rt_req_t *q)
{
    for (size_t i = 0; i < n->n_pending; i++)
        if (n->pending[i].req == q)
            n->pending[i].req = NULL;
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
    free(q->buf);
    free(q->hold);
    chunk_free(&q->chunk);
    free(q);
}

void rt_req_release_nodes(tdm_router_t *r, rt_req_t *q, int status)
{
    Tandem__V1__NodeCancel c = TANDEM__V1__NODE_CANCEL__INIT;
    c.request_id = q->id;
    c.attempt_id = q->attempt_id;
    c.status = tdm_proto_status_to_wire(status);
    if (q->prefill && q->prefill->up)
        rt_node_notify(r, q->prefill, TANDEM__V1__METHOD__METHOD_NODE_CANCEL, &c.base);
    if (q->decode) {
        if (q->decode->up)
            rt_node_notify(r, q->decode, TANDEM__V1__METHOD__METHOD_NODE_CANCEL, &c.base);
        rt_node_detach(q->decode, q);
    }
    q->prefill = q->decode = NULL;
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
        rt_req_release_nodes(r, q, status);
    rt_send_end(r, q->peer, q->peer_len, q->call_id, status, msg, NULL);
    rt_count_end(r, status, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
    rt_hist_observe(&r->metrics.e2e, tdm_time_now() - q->t_arrival);
    rt_req_free(r, q);
}

void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why)
{
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL, "request dropped: %s", why);
    rt_req_release_nodes(r, q, TDM_ECANCELLED);
    rt_count_end(r, TDM_ECANCELLED, TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
    rt_req_free(r, q);
}

void rt_client_cancel(tdm_router_t *r, const tdm_frame_t *f)
{
    for (rt_req_t *q = r->head; q; q = q->next)
        if (q->call_id == f->call_id && q->peer_len == f->peer_len &&
            memcmp(q->peer, f->peer, f->peer_len) == 0) {
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
    for (rt_req_t *q = r->head, *nx; q; q = nx) {
        nx = q->next;
        if (q->deadline_ms && now_ms >= q->deadline_ms) {
            char note[TDM_ERRMSG_MAX] = "";
            if (q->state == RT_QUEUED)
                rt_refused_decode_note(r, note, sizeof note);
            rt_req_fail(r, q, TDM_EDEADLINE, true,
                        "deadline exceeded after %.3f s (%s, %" PRIu32 " tokens out)%s%s",
                        tdm_time_now() - q->t_arrival, state_name(q->state), q->next_index,
                        note[0] ? "; " : "", note);
        }
    }
}

void rt_req_shutdown_all(tdm_router_t *r)
{
    while (r->head) {
        rt_req_t *q = r->head;
        rt_req_release_nodes(r, q, TDM_EUNAVAILABLE);
        rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_EUNAVAILABLE, "router shutting down",
                    NULL);
        rt_count_end(r, TDM_EUNAVAILABLE, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
        rt_req_free(r, q);
    }
}

/* ---- output ---- */

static bool hold_append(rt_req_t *q, const char *s, size_t n)
{
    return str_append(&q->hold, &q->hold_len, &q->hold_cap, s, n);
}

/* Position of needle (m bytes) in hay (n bytes), or -1. */
static long find_bytes(const char *hay, size_t n, const char *needle, size_t m)
{
    if (m == 0 || m > n)
        return -1;
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, m) == 0)
            return (long)i;
    return -1;
}

/* Moves the held text that cannot be (the start of) a stop string to the chunk. Returns 1
 * and sets *which when a stop string matched (text cut there; the rest is dropped), 0
 * otherwise, -1 on out of memory. final: nothing more will come, so nothing is held. */
static int stop_scan(rt_req_t *q, bool final, size_t *which)
{
    long best = -1;
    size_t best_i = 0;
    for (size_t i = 0; i < q->n_stop; i++) {
        long p = find_bytes(q->hold, q->hold_len, q->stop[i], strlen(q->stop[i]));
        if (p >= 0 && (best < 0 || p < best)) {
            best = p;
            best_i = i;
        }
    }
    if (best >= 0) {
        size_t keep = (size_t)best + (q->include_stop_str ? strlen(q->stop[best_i]) : 0);
        if (!chunk_text(&q->chunk, q->hold, keep))
            return -1;
        q->hold_len = 0;
        *which = best_i;
        return 1;
    }
    /* longest suffix of hold that is a proper prefix of some stop string */
    size_t keep = 0;
    if (!final)
        for (size_t i = 0; i < q->n_stop; i++) {
            size_t sl = strlen(q->stop[i]);
            size_t k = sl - 1 < q->hold_len ? sl - 1 : q->hold_len;
            for (; k > keep; k--)
                if (memcmp(q->hold + q->hold_len - k, q->stop[i], k) == 0) {
                    keep = k;
                    break;
                }
        }
    size_t emit = q->hold_len - keep;
    if (!chunk_text(&q->chunk, q->hold, emit))
        return -1;
    memmove(q->hold, q->hold + emit, keep);
    q->hold_len = keep;
    return 0;
}

/* Sends the accumulated chunk as one STREAM message and starts the next. Returns 0, or
 * TDM_EUNAVAILABLE when the client is gone. */
static int send_chunk(tdm_router_t *r, rt_req_t *q)
{
    Tandem__V1__GenerateChunk m;
    chunk_to_msg(q, &m);
    tdm_send_t s = {0};
    s.peer = q->peer;
    s.peer_len = q->peer_len;
    s.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM;
    s.method = TANDEM__V1__METHOD__METHOD_GENERATE;
    s.call_id = q->call_id;
    s.body = &m.base;
    int rc = tdm_sock_send(r->client, &s);
    chunk_reset(&q->chunk, q->next_index);
    return rc == TDM_EUNAVAILABLE ? rc : TDM_OK;
}

/* Completes q successfully: the rest of the text, the final fields, END OK; frees q.
 * stop: index of the stop string that matched, or SIZE_MAX. */
static void complete(tdm_router_t *r, rt_req_t *q, int reason, size_t stop)
{
    if (stop == SIZE_MAX) {
        char tail[32];
        size_t tlen = 0;
        if (tdm_detok_flush(&q->detok, tail, sizeof tail, &tlen) == TDM_OK && tlen)
            hold_append(q, tail, tlen);
        if (stop_scan(q, true, &stop) == 1)
            reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP;
        else
            stop = SIZE_MAX;
    }
    double now = tdm_time_now();
    Tandem__V1__Usage usage = TANDEM__V1__USAGE__INIT;
    usage.prompt_tokens = q->n_prompt;
    usage.completion_tokens = q->next_index;
    usage.cached_prompt_tokens = q->cached_prompt_tokens;
    Tandem__V1__Timings t = TANDEM__V1__TIMINGS__INIT;
    t.queue_s = q->t_dispatch > 0 ? q->t_dispatch - q->t_arrival : 0;
    t.ttft_s = q->t_first > 0 ? q->t_first - q->t_arrival : 0;
    t.decode_s = q->t_first > 0 ? q->t_last - q->t_first : 0;
    t.prefill_s = q->prefill_s;
    t.kv_transfer_s = q->kv_transfer_s;
    t.e2e_s = now - q->t_arrival;
    t.tpot_s = q->next_index > 1 ? t.decode_s / (double)(q->next_index - 1) : 0;
    Tandem__V1__GenerateChunk m;
    chunk_to_msg(q, &m);
    m.finish_reason = (Tandem__V1__FinishReason)reason;
    m.usage = &usage;
    m.timings = &t;
    if (stop != SIZE_MAX)
        m.stop_reason = q->stop[stop];
    int rc;
    if (q->stream) {
        tdm_send_t s = {0};
        s.peer = q->peer;
        s.peer_len = q->peer_len;
        s.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM;
        s.method = TANDEM__V1__METHOD__METHOD_GENERATE;
        s.call_id = q->call_id;
        s.body = &m.base;
        rc = tdm_sock_send(r->client, &s);
        if (rc == TDM_OK)
            rc = rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_OK, NULL, NULL);
    } else {
        rc = rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_OK, NULL, &m.base);
    }
    const char *why = reason == TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP ? "stop" : "length";
    char kv[256];
    snprintf(kv, sizeof kv,
             "finish=%s prompt_tokens=%" PRIu32 " completion_tokens=%" PRIu32
             " cached_tokens=%" PRIu32 " ttft_ms=%.1f e2e_ms=%.1f%s",
             why, q->n_prompt, q->next_index, q->cached_prompt_tokens, t.ttft_s * 1e3,
             t.e2e_s * 1e3, rc == TDM_OK ? "" : " client=gone");
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, kv, "request finished");
    rt_count_end(r, TDM_OK, reason);
    rt_hist_observe(&r->metrics.e2e, t.e2e_s);
    if (q->next_index > 1)
        rt_hist_observe(&r->metrics.tpot, t.tpot_s);
    if (q->kv_transfer_s > 0)
        rt_hist_observe(&r->metrics.kv_transfer, q->kv_transfer_s);
    rt_req_free(r, q);
}

/* Appends one token in order: chunk fields, text, stop strings. Returns 0, 1 when a stop
 * string matched (*which set), -1 on out of memory, -2 for a token outside the vocabulary. */
static int deliver(tdm_router_t *r, rt_req_t *q, const rt_event_t *ev, size_t *which)
{
    if (ev->token < 0 || (uint32_t)ev->token >= r->n_vocab)
        return -2;
    double now = tdm_time_now();
    if (ev->index == 0) {
        q->cached_prompt_tokens = ev->cached_prompt_tokens;
        q->prefill_s = ev->prefill_s;
        r->metrics.cached_prompt_tokens += ev->cached_prompt_tokens;
        if (ev->prefill_s > 0)
            rt_hist_observe(&r->metrics.prefill, ev->prefill_s);
    }
    if (q->t_first == 0) {
        q->t_first = now;
        rt_hist_observe(&r->metrics.ttft, now - q->t_arrival);
    } else {
        rt_hist_observe(&r->metrics.itl, now - q->t_last);
    }
    q->t_last = now;
    bool lp = q->sp.n_logprobs > 0;
    rt_chunk_t *c = &q->chunk;
    if (!chunk_grow(c, lp, q->echo))
        return -1;
    c->ids[c->n] = ev->token;
    if (lp) {
        c->logprobs[c->n] = ev->logprob;
        if (!(c->tops[c->n] = top_make(r, ev)))
            return -1;
    }
    if (q->echo) {
        if (!(c->texts[c->n] = token_text(r, ev->token))) {
            if (lp)
                top_free(c->tops[c->n]);
            return -1;
        }
    }
    c->n++;
    q->next_index++;
    r->metrics.generation_tokens++;
    char piece[256];
    size_t plen = 0;
    int rc = tdm_detok_push(&q->detok, ev->token, piece, sizeof piece, &plen);
    if (rc == TDM_ERESOURCE) {
        int need = tdm_tokenizer_token_bytes(r->tok, ev->token, false, NULL, 0);
        size_t cap = (size_t)(need > 0 ? need : 0) * 3 + 64;
        char *big = malloc(cap);
        if (!big)
            return -1;
        rc = tdm_detok_push(&q->detok, ev->token, big, cap, &plen);
        bool ok = rc != TDM_OK || hold_append(q, big, plen);
        free(big);
        if (!ok)
            return -1;
    } else if (rc == TDM_OK && !hold_append(q, piece, plen)) {
        return -1;
    }
    return stop_scan(q, false, which);
}

static void event_from_proto(const Tandem__V1__TokenEvent *p, rt_event_t *e)
{
    memset(e, 0, sizeof *e);
    e->index = p->index;
    e->token = p->token_id;
    e->logprob = p->logprob;
    e->n_top =
        (uint32_t)(p->n_top < TDM_SAMPLING_MAX_LOGPROBS ? p->n_top : TDM_SAMPLING_MAX_LOGPROBS);
    for (uint32_t i = 0; i < e->n_top; i++) {
        e->top[i].token = p->top[i]->token_id;
        e->top[i].logprob = p->top[i]->logprob;
    }
    e->cached_prompt_tokens = p->cached_prompt_tokens;
    e->prefill_s = p->prefill_s;
}

/* Delivers what is in order. Returns true when q was freed. */
static bool flush_in_order(tdm_router_t *r, rt_req_t *q, const rt_event_t *first)
{
    size_t which = SIZE_MAX;
    int rc = deliver(r, q, first, &which);
    while (rc == 0) {
        size_t i = 0;
        while (i < q->n_buf && q->buf[i].index != q->next_index)
            i++;
        if (i == q->n_buf)
            break;
        rt_event_t ev = q->buf[i];
        q->buf[i] = q->buf[--q->n_buf];
        rc = deliver(r, q, &ev, &which);
    }
    if (rc == -1) {
        rt_req_fail(r, q, TDM_ERESOURCE, true, "router out of memory");
        return true;
    }
    if (rc == -2) {
        rt_req_fail(r, q, TDM_EINTERNAL, true,
                    "a node sent token %" PRIu32 " outside the vocabulary (0..%" PRIu32 ")",
                    q->next_index, r->n_vocab - 1);
        return true;
    }
    if (rc == 1) {
        /* a stop string: the decode node (and a prefill node still busy) stop at once */
        rt_req_release_nodes(r, q, TDM_ECANCELLED);
        complete(r, q, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, which);
        return true;
    }
    if (q->finished && q->next_index >= q->completion_tokens) {
        complete(r, q, q->finish_reason, SIZE_MAX);
        return true;
    }
    if (q->stream && q->chunk.n > 0 && send_chunk(r, q) != TDM_OK) {
        rt_req_drop(r, q, "the client is gone");
        return true;
    }
    return false;
}

bool rt_req_token_event(tdm_router_t *r, rt_req_t *q, const Tandem__V1__TokenEvent *p)
{
    if (p->index >= (uint32_t)q->sp.max_tokens) {
        tdm_log_write(&r->log, TDM_LOG_WARN, q->id, NULL,
                      "ignoring token event index %" PRIu32 " >= max_tokens %" PRId32, p->index,
                      q->sp.max_tokens);
        return false;
    }
    if (p->index < q->next_index) {
        r->metrics.duplicate_events++;
        return false;
    }
    rt_event_t ev;
    event_from_proto(p, &ev);
    if (p->index > q->next_index) {
        for (size_t i = 0; i < q->n_buf; i++)
            if (q->buf[i].index == p->index) {
                r->metrics.duplicate_events++;
                return false;
            }
        if (q->n_buf == q->cap_buf) {
            size_t cap = q->cap_buf ? q->cap_buf * 2 : 4;
            rt_event_t *b = realloc(q->buf, cap * sizeof *b);
            if (!b) {
                rt_req_fail(r, q, TDM_ERESOURCE, true, "router out of memory");
                return true;
            }
            q->buf = b;
            q->cap_buf = cap;
        }
        q->buf[q->n_buf++] = ev;
        return false;
    }
    return flush_in_order(r, q, &ev);
}

bool rt_req_finished(tdm_router_t *r, rt_req_t *q, const Tandem__V1__Finished *fin)
{
    q->finished = true;
    q->decode_started = true;
    q->finish_reason = fin->reason == TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH
                           ? TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH
                           : TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP;
    q->completion_tokens = fin->completion_tokens;
    q->kv_transfer_s = fin->kv_transfer_s;
    r->metrics.kv_transfer_bytes += fin->kv_transfer_bytes;
    if (q->next_index >= q->completion_tokens) {
        complete(r, q, q->finish_reason, SIZE_MAX);
        return true;
    }
    return false;
}

/* ---- GENERATE ---- */

/* What a refused GENERATE says beyond its message: the END's ErrorDetail body. */
typedef struct refusal {
    char field[64];          /* the GenerateRequest field at fault, as a path; "" = none */
    uint32_t prompt_tokens;  /* too long for the context: the prompt's tokens */
    uint32_t n_ctx;          /* ... the context length (0: not a length error) */
    uint32_t max_tokens_fit; /* ... output tokens that would fit */
} refusal_t;

/* Names the field at fault in *why (printf-style path) and returns status, so that a check
 * reads `return at_field(why, tdm_error_set(err, ...), "stop[%zu]", i)`. */
static int at_field(refusal_t *why, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int at_field(refusal_t *why, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why->field, sizeof why->field, fmt, ap);
    va_end(ap);
    return status;
}

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
 * makes longer than strlen): 1..TDM_ROUTER_REQUEST_ID_MAX printable ASCII characters without
 * spaces. TDM_EINVALID naming the first bad byte, or the length, otherwise. */
static int id_check(const char *id, size_t id_wire_len, tdm_error_t *err)
{
    size_t n = strlen(id);
    for (size_t i = 0; i < id_wire_len && i <= TDM_ROUTER_REQUEST_ID_MAX; i++) {
        unsigned char ch = i < n ? (unsigned char)id[i] : 0; /* past strlen: the NUL */
        if (ch <= 0x20 || ch >= 0x7f)
            return tdm_error_set(err, TDM_EINVALID,
                                 "request_id: byte %zu is 0x%02x; request ids are 1..%u printable "
                                 "ASCII characters without spaces",
                                 i, ch, TDM_ROUTER_REQUEST_ID_MAX);
    }
    if (n > TDM_ROUTER_REQUEST_ID_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "request_id is %zu bytes; request ids are 1..%u printable ASCII "
                             "characters without spaces",
                             n, TDM_ROUTER_REQUEST_ID_MAX);
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
                           tdm_token_t **ids, size_t *n_ids, refusal_t *why, tdm_error_t *err)
{
    size_t len = strlen(prompt);
    if (len == 0)
        return at_field(why, tdm_error_set(err, TDM_EINVALID, "prompt is empty"), "prompt");
    long bad = utf8_invalid_at(prompt, len);
    if (bad >= 0)
        return at_field(
            why,
            tdm_error_set(err, TDM_EINVALID, "prompt is not valid UTF-8 (byte offset %ld)", bad),
            "prompt");
    tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "prompt: %s", prompt);
    tdm_prompt_input_t in = {.text = prompt, .text_len = len};
    int rc = tdm_prompt_encode(r->tok, NULL, &in, ids, n_ids, NULL, err);
    if (rc != TDM_OK)
        return at_field(why, tdm_error_prefix(err, rc, "prompt: "), "prompt");
    return TDM_OK;
}

/* Checks that every message's role and content is UTF-8 and points msgs[] at them. */
static int chat_check(const Tandem__V1__ChatList *chat, tdm_chat_message_t *msgs, refusal_t *why,
                      tdm_error_t *err)
{
    for (size_t i = 0; i < chat->n_messages; i++) {
        const Tandem__V1__ChatMessage *cm = chat->messages[i];
        long bad = utf8_invalid_at(cm->content, strlen(cm->content));
        if (bad >= 0)
            return at_field(why,
                            tdm_error_set(err, TDM_EINVALID,
                                          "chat.messages[%zu].content is not valid UTF-8 (byte "
                                          "offset %ld)",
                                          i, bad),
                            "chat.messages[%zu].content", i);
        if (utf8_invalid_at(cm->role, strlen(cm->role)) >= 0)
            return at_field(
                why,
                tdm_error_set(err, TDM_EINVALID, "chat.messages[%zu].role is not valid UTF-8", i),
                "chat.messages[%zu].role", i);
        msgs[i] = (tdm_chat_message_t){cm->role, cm->content};
    }
    return TDM_OK;
}

/* Chat input -> *ids, rendered with the router's template. */
static int tokenize_chat(tdm_router_t *r, const Tandem__V1__ChatList *chat, const rt_req_t *q,
                         tdm_token_t **ids, size_t *n_ids, refusal_t *why, tdm_error_t *err)
{
    size_t n = chat ? chat->n_messages : 0;
    if (n == 0)
        return at_field(why, tdm_error_set(err, TDM_EINVALID, "chat.messages is empty"),
                        "chat.messages");
    if (!r->have_template)
        return at_field(why,
                        tdm_error_set(err, TDM_EPRECONDITION,
                                      "chat: the model has no chat template the router knows (%s)",
                                      r->template_error),
                        "chat");
    tdm_chat_message_t *msgs = calloc(n, sizeof *msgs);
    if (!msgs)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    char *text = NULL;
    int rc = chat_check(chat, msgs, why, err);
    if (rc == TDM_OK) {
        tdm_prompt_input_t in = {.messages = msgs, .n_messages = n};
        rc = tdm_prompt_encode(r->tok, &r->chat, &in, ids, n_ids, &text, err);
        if (rc != TDM_OK)
            at_field(why, tdm_error_prefix(err, rc, "chat.messages: "), "chat.messages");
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
                       tdm_token_t **ids, size_t *n_ids, refusal_t *why, tdm_error_t *err)
{
    size_t n = tokens ? tokens->n_ids : 0;
    if (n == 0)
        return at_field(why, tdm_error_set(err, TDM_EINVALID, "tokens.ids is empty"), "tokens.ids");
    for (size_t i = 0; i < n; i++)
        if (tokens->ids[i] < 0 || (uint32_t)tokens->ids[i] >= r->n_vocab)
            return at_field(why,
                            tdm_error_set(err, TDM_EINVALID,
                                          "tokens.ids[%zu] = %" PRId32
                                          " is out of the vocabulary (0..%" PRIu32 ")",
                                          i, tokens->ids[i], r->n_vocab - 1),
                            "tokens.ids[%zu]", i);
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
        rc = tokenize_prompt(r, g->prompt, q, &ids, &n_ids, why, err);
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT:
        rc = tokenize_chat(r, g->chat, q, &ids, &n_ids, why, err);
        field = "chat.messages";
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS:
        rc = tokens_copy(r, g->tokens, &ids, &n_ids, why, err);
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
        return at_field(why, tdm_error_set(err, TDM_EINVALID, "prompt: the input has no tokens"),
                        "%s", field);
    }
    if (n_ids >= r->n_ctx) {
        free(ids);
        why->prompt_tokens = n_ids > UINT32_MAX ? UINT32_MAX : (uint32_t)n_ids;
        why->n_ctx = r->n_ctx;
        why->max_tokens_fit = 0;
        return at_field(why,
                        tdm_error_set(err, TDM_EINVALID,
                                      "prompt has %zu tokens; the context is %" PRIu32
                                      " tokens (prompt + max_tokens must fit)",
                                      n_ids, r->n_ctx),
                        "%s", field);
    }
    q->prompt = ids;
    q->n_prompt = (uint32_t)n_ids;
    return TDM_OK;
}

/* q->id: the client's (checked, not in flight for this peer) or a new one. */
static int request_id_assign(tdm_router_t *r, const Tandem__V1__GenerateRequest *g,
                             size_t id_wire_len, rt_req_t *q, refusal_t *why, tdm_error_t *err)
{
    if (id_wire_len == 0) { /* unset or empty: the router makes one */
        do
            snprintf(q->id, sizeof q->id, "req-%016" PRIx64, random_u64());
        while (rt_req_find(r, q->id));
        return TDM_OK;
    }
    int rc = id_check(g->request_id, id_wire_len, err);
    if (rc != TDM_OK)
        return at_field(why, rc, "request_id");
    if (find_for_peer(r, g->request_id, q->peer, q->peer_len))
        return at_field(why,
                        tdm_error_set(err, TDM_EINVALID,
                                      "request_id '%s' is already in flight; use a new id",
                                      g->request_id),
                        "request_id");
    snprintf(q->id, sizeof q->id, "%s", g->request_id);
    return TDM_OK;
}

/* Checks the stop strings and copies them into q. */
static int stop_copy(const Tandem__V1__GenerateRequest *g, rt_req_t *q, refusal_t *why,
                     tdm_error_t *err)
{
    if (g->n_stop > TDM_ROUTER_MAX_STOP)
        return at_field(why,
                        tdm_error_set(err, TDM_EINVALID,
                                      "stop: %zu strings given, at most %u allowed", g->n_stop,
                                      TDM_ROUTER_MAX_STOP),
                        "stop");
    for (size_t i = 0; i < g->n_stop; i++) {
        size_t len = strlen(g->stop[i]);
        long bad = utf8_invalid_at(g->stop[i], len);
        if (len == 0)
            tdm_error_set(err, TDM_EINVALID, "stop[%zu] is empty", i);
        else if (len > TDM_ROUTER_MAX_STOP_BYTES)
            tdm_error_set(err, TDM_EINVALID, "stop[%zu] is %zu bytes long, at most %u", i, len,
                          TDM_ROUTER_MAX_STOP_BYTES);
        else if (bad >= 0)
            tdm_error_set(err, TDM_EINVALID, "stop[%zu] is not valid UTF-8 (byte offset %ld)", i,
                          bad);
        else
            continue;
        return at_field(why, TDM_EINVALID, "stop[%zu]", i);
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

/* The sampling field tdm_sampling_params_validate refuses in p: each field is tried alone on
 * the defaults (which are valid), so the one validator decides. "" when none alone fails. */
static const char *sampling_bad_field(const tdm_sampling_params_t *p, uint32_t n_vocab)
{
#define SP_FIELD(name)                                                                             \
    {                                                                                              \
#name, offsetof(tdm_sampling_params_t, name), sizeof p->name                               \
    }
    static const struct {
        const char *name;
        size_t off, size;
    } fields[] = {
        SP_FIELD(temperature),
        SP_FIELD(top_k),
        SP_FIELD(top_p),
        SP_FIELD(min_p),
        SP_FIELD(repetition_penalty),
        SP_FIELD(presence_penalty),
        SP_FIELD(frequency_penalty),
        SP_FIELD(penalty_last_n),
        SP_FIELD(n_stop_token_ids),
        SP_FIELD(stop_token_ids),
        SP_FIELD(n_logprobs),
    };
#undef SP_FIELD
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        tdm_sampling_params_t one;
        tdm_sampling_params_default(&one);
        memcpy((char *)&one + fields[i].off, (const char *)p + fields[i].off, fields[i].size);
        if (fields[i].off == offsetof(tdm_sampling_params_t, stop_token_ids))
            one.n_stop_token_ids = p->n_stop_token_ids; /* the ids in use */
        if (tdm_sampling_params_validate(&one, n_vocab, NULL) != TDM_OK)
            return fields[i].name;
    }
    return "";
}

/* q->sp from the request's sampling fields over Tandem's defaults; a seed drawn when the
 * client gave none. */
static int sampling_build(const tdm_router_t *r, const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                          refusal_t *why, tdm_error_t *err)
{
    tdm_sampling_params_default(&q->sp);
    bool seeded = false;
    if (g->sampling) {
        int rc = tdm_proto_sampling_from(g->sampling, &q->sp, err);
        if (rc != TDM_OK)
            return at_field(why, rc, "sampling.stop_token_ids");
        seeded = g->sampling->has_seed || (g->sampling->set_mask & TDM_PROTO_SET_SEED);
    }
    if (!seeded)
        q->sp.seed = random_u64();
    q->sp.max_tokens = 1; /* decided after tokenization (max_tokens_decide) */
    int rc = tdm_sampling_params_validate(&q->sp, r->n_vocab, err);
    if (rc != TDM_OK) {
        const char *name = sampling_bad_field(&q->sp, r->n_vocab);
        return at_field(why, tdm_error_prefix(err, rc, "sampling: "), "%s%s",
                        name[0] ? "sampling." : "sampling", name);
    }
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
        return at_field(
            why,
            tdm_error_set(err, TDM_EINVALID,
                          "max_tokens: prompt (%" PRIu32 " tokens) + max_tokens (%" PRId32
                          ") exceeds the context of %" PRIu32 " tokens; at most %" PRIu32
                          " tokens can be generated for this prompt",
                          q->n_prompt, g->max_tokens, r->n_ctx, room),
            "max_tokens");
    }
    q->sp.max_tokens = g->max_tokens;
    return TDM_OK;
}

/* Validates g and fills q. Returns 0 or the status with *err saying why and *why naming the
 * field. */
static int build_request(tdm_router_t *r, const Tandem__V1__GenerateRequest *g, size_t id_wire_len,
                         rt_req_t *q, refusal_t *why, tdm_error_t *err)
{
    int rc = request_id_assign(r, g, id_wire_len, q, why, err);
    if (rc != TDM_OK)
        return rc;
    const char *served = r->cfg->model.name ? r->cfg->model.name : "";
    if (g->model[0] && strcmp(g->model, served) != 0)
        return at_field(why,
                        tdm_error_set(err, TDM_ENOTFOUND,
                                      "model '%s' is not served here; this router serves '%s'",
                                      g->model, served),
                        "model");
    if (g->max_tokens < 0)
        return at_field(why,
                        tdm_error_set(err, TDM_EINVALID,
                                      "max_tokens must be >= 1 (or 0: what fits), got %" PRId32,
                                      g->max_tokens),
                        "max_tokens");
    if ((rc = stop_copy(g, q, why, err)) != TDM_OK ||
        (rc = sampling_build(r, g, q, why, err)) != TDM_OK ||
        (rc = tokenize_input(r, g, q, why, err)) != TDM_OK ||
        (rc = max_tokens_decide(r, g, q, why, err)) != TDM_OK)
        return rc;
    q->stream = g->stream;
    q->include_stop_str = g->include_stop_str;
    q->echo = g->echo_token_text;
    return TDM_OK;
}

/* Ends a refused GENERATE call: counted, logged (id: the request's, NULL when it has none
 * yet), END with status and message and, when why names something, its ErrorDetail. */
static void reply_refused(tdm_router_t *r, const tdm_frame_t *f, const char *id, int status,
                          const refusal_t *why, const char *msg)
{
    char kv[96];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(status));
    tdm_log_write(&r->log, TDM_LOG_INFO, id, kv, "request refused: %s", msg);
    rt_count_end(r, status, -1);
    Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
    if (why) {
        d.field = (char *)why->field;
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
        .status = status,
        .message = msg,
        .body = why && (why->field[0] || why->n_ctx) ? &d.base : NULL,
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
    if (rc == TDM_OK && !(q->tried = calloc(r->n_nodes ? r->n_nodes : 1, sizeof *q->tried)))
        rc = tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    if (rc == TDM_OK)
        return q;
    reply_refused(r, f, q && q->id[0] ? q->id : NULL, rc, &why, err.msg);
    req_discard(q);
    return NULL;
}

/* Hands an accepted request to a decode node, or queues it (FIFO: behind requests already
 * waiting). */
static void req_admit(tdm_router_t *r, rt_req_t *q)
{
    int rc = r->qhead ? 1 : rt_dispatch(r, q);
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

void rt_generate(tdm_router_t *r, const tdm_frame_t *f)
{
    r->metrics.requests_total++;
    double now = tdm_time_now();
    uint64_t now_ms = tdm_net_now_ms();
    if (tdm_frame_expired(f, now_ms)) {
        reply_refused(r, f, NULL, TDM_EDEADLINE, NULL,
                      "the request's deadline had passed when it arrived");
        return;
    }
    Tandem__V1__GenerateRequest *g = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
        f, &tandem__v1__generate_request__descriptor);
    if (!g) {
        reply_refused(r, f, NULL, TDM_EINVALID, NULL,
                      "the body does not decode as a GenerateRequest");
        return;
    }
    rt_req_t *q = req_from_call(r, f, g, now, now_ms);
    protobuf_c_message_free_unpacked(&g->base, NULL);
    if (!q)
        return;
    if (!hash_insert(r, q)) {
        reply_refused(r, f, q->id, TDM_ERESOURCE, NULL, "router out of memory");
        req_discard(q);
        return;
    }
    q->chunk.index = 0;
    r->metrics.prompt_tokens += q->n_prompt;
    char kv[200];
    snprintf(kv, sizeof kv,
             "prompt_tokens=%" PRIu32 " max_tokens=%" PRId32 " stream=%s stop_strings=%zu",
             q->n_prompt, q->sp.max_tokens, q->stream ? "true" : "false", q->n_stop);
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, kv, "request accepted");
    req_admit(r, q);
}
