/* stream.c - a request's output (stream.h): the reorder buffer, incremental detokenization,
 * stop strings, GenerateChunk streaming and completion.
 *
 * Token events arrive from the prefill node (index 0) and the decode node (1, 2, ...) and may
 * cross; the ones ahead of next_index wait in the reorder buffer. A migrated attempt (its
 * decode node was lost) starts at the next index to deliver, resume_index, instead of 0: the
 * client sees one stream, each index once, and the detokenizer and the held stop-string text
 * carry on across attempts. The delivered ids are kept (rt_req_t.output) for that resume. Each
 * token in order goes to the chunk (ids, logprobs, texts) and its text through the detokenizer to
 * `hold`. Stop strings: the text that could be the beginning of a stop string is held back until it
 * is known not to be one; on a match the text is cut before it (or after it with include_stop_str)
 * and the nodes are cancelled. A streaming request gets one GenerateChunk per batch of events in
 * order; the last message carries usage and timings.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lifecycle.h"
#include "request.h"
#include "scheduler.h"
#include "stats.h"
#include "stream.h"
#include "tandem/worker.h"

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
    tdm_buf_clear(&c->text);
    c->index = index;
}

static void chunk_free(rt_chunk_t *c)
{
    chunk_reset(c, 0);
    free(c->ids);
    free(c->logprobs);
    free(c->tops);
    free(c->texts);
    tdm_buf_free(&c->text);
    memset(c, 0, sizeof *c);
}

/* Frees q's prompt logprobs (plp_take's). */
static void plp_free(rt_req_t *q)
{
    for (size_t i = 0; q->plp_msgs && i < q->n_plp; i++)
        free(q->plp_msgs[i].text);
    for (size_t k = 0; q->plp_tops && k < q->n_plp_tops; k++)
        free(q->plp_tops[k].text);
    free(q->plp);
    free(q->plp_msgs);
    free(q->plp_tops);
    free(q->plp_topp);
    q->plp = NULL;
    q->plp_msgs = NULL;
    q->plp_tops = NULL;
    q->plp_topp = NULL;
    q->n_plp = q->n_plp_tops = 0;
}

void rt_stream_free(rt_req_t *q)
{
    plp_free(q);
    free(q->output);
    q->output = NULL;
    q->cap_output = 0;
    free(q->buf);
    q->buf = NULL;
    q->n_buf = q->cap_buf = 0;
    tdm_buf_free(&q->hold);
    chunk_free(&q->chunk);
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
static char *token_text(const rt_model_t *md, int32_t id)
{
    char small[128];
    int len = tdm_tokenizer_token_bytes(md->tok, id, true, small, sizeof small);
    if (len < 0)
        return tdm_strdup("");
    if ((size_t)len <= sizeof small)
        return utf8_sanitize(small, (size_t)len);
    char *big = malloc((size_t)len);
    if (!big)
        return NULL;
    tdm_tokenizer_token_bytes(md->tok, id, true, big, (size_t)len);
    char *out = utf8_sanitize(big, (size_t)len);
    free(big);
    return out;
}

static Tandem__V1__TopLogprobs *top_make(const rt_model_t *md, const rt_event_t *ev)
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
        h->e[i].text = token_text(md, ev->top[i].token);
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
    m->choice = q->choice;
    m->index = c->index;
    m->n_token_ids = c->n;
    m->token_ids = c->ids;
    m->text = c->text.data ? c->text.data : (char *)"";
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
    if (q->plp && !q->plp_sent && c->index == 0) { /* the call's first chunk */
        m->n_prompt_logprobs = q->n_plp;
        m->prompt_logprobs = q->plp;
    }
}

/* ---- stop strings ---- */

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

/* Removes the first n bytes of b. */
static void buf_drop_front(tdm_buf_t *b, size_t n)
{
    if (n == 0)
        return;
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
    b->data[b->len] = '\0';
}

/* Length of the longest suffix of q's held text that is a proper prefix of a stop string. */
static size_t stop_prefix_held(const rt_req_t *q)
{
    const tdm_buf_t *h = &q->hold;
    size_t keep = 0;
    for (size_t i = 0; i < q->n_stop; i++) {
        size_t sl = strlen(q->stop[i]);
        size_t k = sl - 1 < h->len ? sl - 1 : h->len;
        for (; k > keep; k--)
            if (memcmp(h->data + h->len - k, q->stop[i], k) == 0) {
                keep = k;
                break;
            }
    }
    return keep;
}

/* Moves the held text that cannot be (the start of) a stop string to the chunk. Returns 1
 * and sets *which when a stop string matched (text cut there; the rest is dropped), 0
 * otherwise, TDM_ERESOURCE on out of memory. final: nothing more will come, so nothing is
 * held. While the output has at most min_tokens tokens no stop string is matched (vLLM's
 * min_tokens), though the text that may begin one is still held, so one the next tokens
 * complete matches. */
static int stop_scan(rt_req_t *q, bool final, size_t *which)
{
    tdm_buf_t *h = &q->hold;
    long best = -1;
    size_t best_i = 0;
    size_t n_stop = q->next_index > (uint32_t)q->sp.min_tokens ? q->n_stop : 0;
    for (size_t i = 0; i < n_stop; i++) {
        long p = find_bytes(h->data, h->len, q->stop[i], strlen(q->stop[i]));
        if (p >= 0 && (best < 0 || p < best)) {
            best = p;
            best_i = i;
        }
    }
    if (best >= 0) {
        size_t keep = (size_t)best + (q->include_stop_str ? strlen(q->stop[best_i]) : 0);
        if (tdm_buf_append(&q->chunk.text, h->data, keep) != TDM_OK)
            return TDM_ERESOURCE;
        tdm_buf_clear(h);
        *which = best_i;
        return 1;
    }
    size_t emit = h->len - (final ? 0 : stop_prefix_held(q));
    if (tdm_buf_append(&q->chunk.text, h->data, emit) != TDM_OK)
        return TDM_ERESOURCE;
    buf_drop_front(h, emit);
    return 0;
}

/* ---- sending ---- */

/* Sends m as one STREAM message of q's call; returns tdm_sock_send's code. */
static int send_stream(tdm_router_t *r, const rt_req_t *q, const Tandem__V1__GenerateChunk *m)
{
    tdm_send_t s = {0};
    s.peer = q->peer;
    s.peer_len = q->peer_len;
    s.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM;
    s.method = TANDEM__V1__METHOD__METHOD_GENERATE;
    s.call_id = q->call_id;
    s.body = &m->base;
    return tdm_sock_send(r->client, &s);
}

/* Sends the accumulated chunk as one STREAM message and starts the next. Returns 0, or
 * TDM_EUNAVAILABLE when the client is gone. */
static int send_chunk(tdm_router_t *r, rt_req_t *q)
{
    Tandem__V1__GenerateChunk m;
    chunk_to_msg(q, &m);
    bool plp = m.n_prompt_logprobs > 0;
    Tandem__V1__Usage usage;
    if (q->continuous_usage) { /* the counts as of this chunk (vLLM's continuous_usage_stats) */
        tandem__v1__usage__init(&usage);
        usage.prompt_tokens = q->n_prompt;
        usage.completion_tokens = q->next_index;
        usage.cached_prompt_tokens = q->cached_prompt_tokens;
        m.usage = &usage;
    }
    int rc = send_stream(r, q, &m);
    chunk_reset(&q->chunk, q->next_index);
    if (plp) { /* sent once: the first chunk */
        q->plp_sent = true;
        plp_free(q);
    }
    return rc == TDM_EUNAVAILABLE ? rc : TDM_OK;
}

/* ---- completion ---- */

/* The end of the text: what the detokenizer held back, then a last stop-string scan with
 * nothing held. A stop string found there makes the reason STOP and sets *stop. */
static void flush_tail(rt_req_t *q, int *reason, size_t *stop)
{
    char tail[32];
    size_t tlen = 0;
    if (tdm_detok_flush(&q->detok, tail, sizeof tail, &tlen) == TDM_OK && tlen)
        (void)tdm_buf_append(&q->hold, tail, tlen);
    if (stop_scan(q, true, stop) == 1)
        *reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP;
    else
        *stop = SIZE_MAX;
}

static void fill_timings(const rt_req_t *q, double now, Tandem__V1__Timings *t)
{
    tandem__v1__timings__init(t);
    t->queue_s = q->t_dispatch > 0 ? q->t_dispatch - q->t_arrival : 0;
    t->ttft_s = q->t_first > 0 ? q->t_first - q->t_arrival : 0;
    t->decode_s = q->t_first > 0 ? q->t_last - q->t_first : 0;
    t->prefill_s = q->prefill_s;
    t->kv_transfer_s = q->kv_transfer_s;
    t->e2e_s = now - q->t_arrival;
    t->tpot_s = q->next_index > 1 ? t->decode_s / (double)(q->next_index - 1) : 0;
}

/* The final message: the last chunk with the finish fields, then END OK (stream), or the
 * whole answer in END OK. A choice of n > 1 sends its last chunk (stream=false: its whole
 * answer) as a STREAM message, and the last choice to complete the call's END OK after it,
 * without a body. Returns tdm_sock_send's code. */
static int send_final(tdm_router_t *r, const rt_req_t *q, const Tandem__V1__GenerateChunk *m)
{
    if (q->group) {
        int rc = send_stream(r, q, m);
        if (rc == TDM_OK && q->group->n_live == 1)
            rc = rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_OK, NULL, NULL);
        return rc;
    }
    if (!q->stream)
        return rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_OK, NULL, &m->base);
    int rc = send_stream(r, q, m);
    if (rc == TDM_OK)
        rc = rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_OK, NULL, NULL);
    return rc;
}

static void log_finished(tdm_router_t *r, const rt_req_t *q, int reason,
                         const Tandem__V1__Timings *t, bool client_gone)
{
    const char *why = reason == TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP ? "stop" : "length";
    char kv[256];
    snprintf(kv, sizeof kv,
             "finish=%s prompt_tokens=%" PRIu32 " completion_tokens=%" PRIu32
             " cached_tokens=%" PRIu32 " ttft_ms=%.1f e2e_ms=%.1f%s",
             why, q->n_prompt, q->next_index, q->cached_prompt_tokens, t->ttft_s * 1e3,
             t->e2e_s * 1e3, client_gone ? " client=gone" : "");
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, kv, "request finished");
}

/* Fills *m as q's last chunk (the text not yet sent, finish_reason, usage and timings as of
 * now); m points into *usage and *t, which the caller keeps alive while it sends m. */
static void last_chunk(const rt_req_t *q, int reason, Tandem__V1__GenerateChunk *m,
                       Tandem__V1__Usage *usage, Tandem__V1__Timings *t)
{
    tandem__v1__usage__init(usage);
    usage->prompt_tokens = q->n_prompt;
    usage->completion_tokens = q->next_index;
    usage->cached_prompt_tokens = q->cached_prompt_tokens;
    fill_timings(q, tdm_time_now(), t);
    chunk_to_msg(q, m);
    m->finish_reason = (Tandem__V1__FinishReason)reason;
    m->usage = usage;
    m->timings = t;
}

/* The per-request figures of a completed request (the vLLM-compatible histograms). */
static void count_completed(tdm_router_metrics_t *m, const rt_req_t *q,
                            const Tandem__V1__Timings *t, bool again)
{
    rt_hist_observe(&m->decode, t->decode_s);
    rt_hist_observe(&m->inference, t->e2e_s - t->queue_s);
    rt_hist_observe_count(&m->prompt_len, q->n_prompt);
    rt_hist_observe_count(&m->generation_len, q->next_index);
    if (!q->group) {
        rt_hist_observe_count(&m->max_generation_len, q->next_index);
    } else {
        if (!again && q->next_index > q->group->max_generated)
            q->group->max_generated = q->next_index;
        if (q->group->n_live == 1) /* the call's last choice */
            rt_hist_observe_count(&m->max_generation_len, q->group->max_generated);
    }
    rt_hist_observe_count(&m->preemptions_per_request, q->preemptions);
    m->preemptions += q->preemptions;
}

/* Completes q successfully: the rest of the text, the final fields, END OK; frees q.
 * stop: index of the stop string that matched, or SIZE_MAX. */
static void complete(tdm_router_t *r, rt_req_t *q, int reason, size_t stop)
{
    if (stop == SIZE_MAX)
        flush_tail(q, &reason, &stop);
    Tandem__V1__Usage usage;
    Tandem__V1__Timings t;
    Tandem__V1__GenerateChunk m;
    last_chunk(q, reason, &m, &usage, &t);
    if (stop != SIZE_MAX)
        m.stop_reason = q->stop[stop];
    int rc = send_final(r, q, &m);
    log_finished(r, q, reason, &t, rc != TDM_OK);
    rt_count_end(r, q->model, TDM_OK, reason);
    tdm_router_metrics_t *ms[2] = {&r->metrics, &q->model->metrics};
    for (size_t i = 0; i < 2; i++) {
        rt_hist_observe(&ms[i]->e2e, t.e2e_s);
        if (q->next_index > 1)
            rt_hist_observe(&ms[i]->tpot, t.tpot_s);
        if (q->kv_transfer_s > 0)
            rt_hist_observe(&ms[i]->kv_transfer, q->kv_transfer_s);
        count_completed(ms[i], q, &t, i == 1);
    }
    rt_req_free(r, q);
}

bool rt_stream_end_delivered(tdm_router_t *r, rt_req_t *q)
{
    int reason;
    if (q->next_index > 0 &&
        tdm_worker_token_ends(q->model->tok, &q->sp, q->output[q->next_index - 1]))
        reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP;
    else if (q->next_index >= (uint32_t)q->sp.max_tokens)
        reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    else
        return false;
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                  "its %" PRIu32 " tokens delivered end the request; completed without its node",
                  q->next_index);
    rt_release_nodes(r, q, TDM_ECANCELLED);
    complete(r, q, reason, SIZE_MAX);
    return true;
}

void rt_stream_fail(tdm_router_t *r, const rt_req_t *q)
{
    if (!q->stream || q->next_index == 0)
        return;
    Tandem__V1__Usage usage;
    Tandem__V1__Timings t;
    Tandem__V1__GenerateChunk m;
    last_chunk(q, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR, &m, &usage, &t);
    (void)send_stream(r, q, &m); /* a client that is gone misses the END as well */
}

/* ---- delivering tokens in order ---- */

/* The figures an in-order token carries: prefill ones with index 0, TTFT or the gap since
 * the last token. */
static void note_timing(tdm_router_t *r, rt_req_t *q, const rt_event_t *ev)
{
    double now = tdm_time_now();
    tdm_router_metrics_t *ms[2] = {&r->metrics, &q->model->metrics};
    for (size_t i = 0; i < 2; i++) {
        tdm_router_metrics_t *m = ms[i];
        if (ev->index == 0) {
            m->cached_prompt_tokens += ev->cached_prompt_tokens;
            m->computed_prompt_tokens +=
                q->n_prompt > ev->cached_prompt_tokens ? q->n_prompt - ev->cached_prompt_tokens : 0;
            if (ev->prefill_s > 0)
                rt_hist_observe(&m->prefill, ev->prefill_s);
        }
        if (q->t_first == 0)
            rt_hist_observe(&m->ttft, now - q->t_arrival);
        else
            rt_hist_observe(&m->itl, now - q->t_last);
    }
    if (ev->index == 0) {
        q->cached_prompt_tokens = ev->cached_prompt_tokens;
        q->prefill_s = ev->prefill_s;
    }
    if (q->t_first == 0)
        q->t_first = now;
    q->t_last = now;
}

/* Appends the token's id, logprobs and text to the chunk. Returns false on out of memory. */
static bool chunk_add(const tdm_router_t *r, rt_req_t *q, const rt_event_t *ev)
{
    bool lp = q->sp.n_logprobs > 0;
    rt_chunk_t *c = &q->chunk;
    if (!chunk_grow(c, lp, q->echo))
        return false;
    c->ids[c->n] = ev->token;
    if (lp) {
        c->logprobs[c->n] = ev->logprob;
        if (!(c->tops[c->n] = top_make(q->model, ev)))
            return false;
    }
    if (q->echo) {
        if (!(c->texts[c->n] = token_text(q->model, ev->token))) {
            if (lp)
                top_free(c->tops[c->n]);
            return false;
        }
    }
    c->n++;
    return true;
}

/* Pushes the token through q's detokenizer and appends the text it completes to the held
 * text. Returns false on out of memory. */
static bool detok_push(const tdm_router_t *r, rt_req_t *q, int32_t token)
{
    if (q->render_special && tdm_tokenizer_is_eog(q->model->tok, token))
        return true; /* an end of generation adds no text, whatever render_special says */
    char piece[256];
    size_t plen = 0;
    int rc = tdm_detok_push(&q->detok, token, piece, sizeof piece, &plen);
    if (rc == TDM_ERESOURCE) { /* a long token: a buffer its size */
        int need = tdm_tokenizer_token_bytes(q->model->tok, token, q->render_special, NULL, 0);
        size_t cap = (size_t)(need > 0 ? need : 0) * 3 + 64;
        char *big = malloc(cap);
        if (!big)
            return false;
        rc = tdm_detok_push(&q->detok, token, big, cap, &plen);
        bool ok = rc != TDM_OK || tdm_buf_append(&q->hold, big, plen) == TDM_OK;
        free(big);
        return ok;
    }
    return rc != TDM_OK || tdm_buf_append(&q->hold, piece, plen) == TDM_OK;
}

/* Appends token to q->output (the delivered ids a migration resumes after). Returns false on
 * out of memory. */
static bool output_add(rt_req_t *q, int32_t token)
{
    if (q->next_index == q->cap_output) {
        uint32_t cap = q->cap_output ? q->cap_output * 2 : 64;
        int32_t *o = realloc(q->output, (size_t)cap * sizeof *o);
        if (!o)
            return false;
        q->output = o;
        q->cap_output = cap;
    }
    q->output[q->next_index] = token;
    return true;
}

/* Appends one token in order: chunk fields, text, stop strings. Returns 0, 1 when a stop
 * string matched (*which set), TDM_ERESOURCE on out of memory, or TDM_EINTERNAL for a token
 * outside the vocabulary (a node's fault). */
static int deliver(tdm_router_t *r, rt_req_t *q, const rt_event_t *ev, size_t *which)
{
    if (ev->token < 0 || (uint32_t)ev->token >= q->model->n_vocab)
        return TDM_EINTERNAL;
    note_timing(r, q, ev);
    if (!output_add(q, ev->token) || !chunk_add(r, q, ev))
        return TDM_ERESOURCE;
    q->next_index++;
    r->metrics.generation_tokens++;
    q->model->metrics.generation_tokens++;
    if (!detok_push(r, q, ev->token))
        return TDM_ERESOURCE;
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

/* Delivers first and then the buffered events that follow it in order. Returns deliver's
 * code for the last one delivered. */
static int deliver_in_order(tdm_router_t *r, rt_req_t *q, const rt_event_t *first, size_t *which)
{
    int rc = deliver(r, q, first, which);
    while (rc == 0) {
        size_t i = 0;
        while (i < q->n_buf && q->buf[i].index != q->next_index)
            i++;
        if (i == q->n_buf)
            break;
        rt_event_t ev = q->buf[i];
        q->buf[i] = q->buf[--q->n_buf];
        rc = deliver(r, q, &ev, which);
    }
    return rc;
}

/* Delivers what is in order, then ends q or sends its chunk. Returns true when q was freed. */
static bool flush_in_order(tdm_router_t *r, rt_req_t *q, const rt_event_t *first)
{
    size_t which = SIZE_MAX;
    int rc = deliver_in_order(r, q, first, &which);
    if (rc == TDM_ERESOURCE) {
        rt_req_fail(r, q, TDM_ERESOURCE, true, "router out of memory");
        return true;
    }
    if (rc == TDM_EINTERNAL) {
        rt_req_fail(r, q, TDM_EINTERNAL, true,
                    "a node sent token %" PRIu32 " outside the vocabulary (0..%" PRIu32 ")",
                    q->next_index, q->model->n_vocab - 1);
        return true;
    }
    if (rc == 1) {
        /* a stop string: the decode node (and a prefill node still busy) stop at once */
        rt_release_nodes(r, q, TDM_ECANCELLED);
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

/* Keeps an event ahead of next_index in the reorder buffer (a duplicate is counted and
 * dropped). Returns true when q was freed (out of memory). */
static bool buffer_event(tdm_router_t *r, rt_req_t *q, const rt_event_t *ev)
{
    for (size_t i = 0; i < q->n_buf; i++)
        if (q->buf[i].index == ev->index) {
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
    q->buf[q->n_buf++] = *ev;
    return false;
}

/* The prompt logprobs of q's index-0 event p, with each token's text, into q->plp (kept until
 * the first chunk carries them). Out of memory leaves none (the answer then has none). Returns
 * false, with none and *too_big their packed bytes, when they would not fit in one message
 * (RT_PROMPT_LOGPROBS_MAX_BYTES); the caller fails q. */
static bool plp_take(const tdm_router_t *r, rt_req_t *q, const Tandem__V1__TokenEvent *p,
                     size_t *too_big)
{
    size_t n = p->n_prompt_logprobs, n_top = 0;
    bool ok = n + 1 == q->n_prompt; /* a node's message is checked, never trusted */
    for (size_t i = 0; ok && i < n; i++) {
        const Tandem__V1__PromptLogprob *e = p->prompt_logprobs[i];
        ok = e->n_top <= q->plp_ask.top && e->token_id == q->prompt[i + 1];
        n_top += e->n_top;
    }
    if (!ok) {
        tdm_log_write(&r->log, TDM_LOG_WARN, q->id, NULL,
                      "ignoring prompt logprobs that do not match the prompt (%zu entries)", n);
        return true;
    }
    /* the client's list has the first prompt token too (rank 0: no logprob), for its text */
    Tandem__V1__PromptLogprob *m = q->plp_msgs = calloc(n + 1, sizeof *m);
    Tandem__V1__TopLogprob *tops = q->plp_tops = calloc(n_top + 1, sizeof *tops);
    Tandem__V1__TopLogprob **topp = q->plp_topp = calloc(n_top + 1, sizeof *topp);
    q->plp = calloc(n + 1, sizeof *q->plp);
    q->n_plp = n + 1; /* plp_free frees the texts of n_plp entries, n_top tops (calloc'd: NULL) */
    q->n_plp_tops = n_top;
    if (!m || !tops || !topp || !q->plp) {
        plp_free(q);
        return true;
    }
    tandem__v1__prompt_logprob__init(&m[0]);
    m[0].token_id = q->prompt[0];
    m[0].text = token_text(q->model, q->prompt[0]);
    q->plp[0] = &m[0];
    size_t k = 0;
    for (size_t i = 1; i <= n; i++) {
        const Tandem__V1__PromptLogprob *e = p->prompt_logprobs[i - 1];
        tandem__v1__prompt_logprob__init(&m[i]);
        m[i].token_id = e->token_id;
        m[i].logprob = e->logprob;
        m[i].rank = e->rank;
        m[i].text = token_text(q->model, e->token_id);
        m[i].top = topp + k;
        m[i].n_top = e->n_top;
        for (size_t j = 0; j < e->n_top; j++, k++) {
            tandem__v1__top_logprob__init(&tops[k]);
            tops[k].token_id = e->top[j]->token_id;
            tops[k].logprob = e->top[j]->logprob;
            tops[k].text = token_text(q->model, e->top[j]->token_id);
            topp[k] = &tops[k];
        }
        q->plp[i] = &m[i];
    }
    /* the entries with their texts travel in the call's first chunk: one message */
    size_t bytes = 0;
    for (size_t i = 0; i <= n; i++)
        bytes += protobuf_c_message_get_packed_size(&m[i].base) + 8;
    if (bytes > RT_PROMPT_LOGPROBS_MAX_BYTES) {
        plp_free(q);
        *too_big = bytes;
        return false;
    }
    return true;
}

/* A token event for q (from its prefill or decode node). Returns true when q was freed. */
static bool token_event(tdm_router_t *r, rt_req_t *q, const Tandem__V1__TokenEvent *p)
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
    size_t plp_bytes = 0;
    if (p->index == 0 && q->want_plp && !q->plp && !q->plp_sent && p->n_prompt_logprobs > 0 &&
        !plp_take(r, q, p, &plp_bytes)) {
        char msg[TDM_ERRMSG_MAX];
        snprintf(msg, sizeof msg,
                 "prompt_logprobs: the prompt's logprobs with their token texts take %zu bytes, "
                 "more than the %u a message may carry (ask fewer alternatives or a shorter "
                 "prompt)",
                 plp_bytes, RT_PROMPT_LOGPROBS_MAX_BYTES);
        Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
        d.field = "prompt_logprobs";
        rt_req_fail_body(r, q, TDM_EINVALID, true, &d.base, msg);
        return true;
    }
    rt_event_t ev;
    event_from_proto(p, &ev);
    if (p->index > q->next_index)
        return buffer_event(r, q, &ev);
    return flush_in_order(r, q, &ev);
}

void rt_stream_on_token(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__TokenEvent *ev =
        (Tandem__V1__TokenEvent *)tdm_frame_unpack(f, &tandem__v1__token_event__descriptor);
    if (!ev)
        return;
    rt_req_t *q = rt_req_for_event(r, n, ev->request_id, ev->attempt_id, true, true, "token");
    /* the prefill node's first token may come before the reservation's answer: the
     * PrefillTask goes with the DecodeReserve */
    if (q && q->state != RT_RUNNING && !(q->state == RT_RESERVING && n == q->prefill)) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, ev->request_id, NULL,
                      "ignoring token %" PRIu32 " from %s (request not running yet)", ev->index,
                      n->cfg->id);
    } else if (q) {
        if (n == q->decode && ev->index > q->resume_index)
            q->decode_started = true;
        if (n == q->prefill && ev->index == q->resume_index)
            q->prefilled = true;
        token_event(r, q, ev);
    }
    protobuf_c_message_free_unpacked(&ev->base, NULL);
}

/* A node-reported KV transfer time, in seconds, or 0 where it is not a finite, non-negative
 * value below a day (a faulty or hostile node must not poison the kv_transfer histogram). */
static double node_seconds(double s)
{
    return isfinite(s) && s >= 0 && s < 86400.0 ? s : 0;
}

/* Finished for q. Returns true when q was freed. */
static bool finished(tdm_router_t *r, rt_req_t *q, const Tandem__V1__Finished *fin)
{
    q->finished = true;
    q->decode_started = true;
    q->finish_reason = fin->reason == TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH
                           ? TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH
                           : TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP;
    q->completion_tokens = fin->completion_tokens;
    q->preemptions = fin->preemptions;
    if (q->kv_transfer_s == 0) /* the decode node's estimate, until the prefill node measured */
        q->kv_transfer_s = node_seconds(fin->kv_transfer_s);
    r->metrics.kv_transfer_bytes += fin->kv_transfer_bytes;
    if (q->next_index >= q->completion_tokens) {
        complete(r, q, q->finish_reason, SIZE_MAX);
        return true;
    }
    return false;
}

void rt_stream_on_finished(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__Finished *fin =
        (Tandem__V1__Finished *)tdm_frame_unpack(f, &tandem__v1__finished__descriptor);
    if (!fin)
        return;
    rt_req_t *q = rt_req_for_event(r, n, fin->request_id, fin->attempt_id, false, true, "Finished");
    if (q && q->state != RT_RUNNING)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, fin->request_id, NULL,
                      "ignoring Finished from %s (request not running yet)", n->cfg->id);
    else if (q)
        finished(r, q, fin);
    protobuf_c_message_free_unpacked(&fin->base, NULL);
}

void rt_stream_on_kv_shipped(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__KvShipped *ks =
        (Tandem__V1__KvShipped *)tdm_frame_unpack(f, &tandem__v1__kv_shipped__descriptor);
    if (!ks)
        return;
    rt_req_t *q = rt_req_for_event(r, n, ks->request_id, ks->attempt_id, true, false, "KvShipped");
    if (q) { /* its KV acknowledged: the sender-measured transfer time */
        q->kv_transfer_s = node_seconds(ks->kv_transfer_s);
        tdm_log_write(&r->log, TDM_LOG_DEBUG, ks->request_id, NULL,
                      "KV shipped by %s bytes=%" PRIu64 " seconds=%.4f", n->cfg->id,
                      ks->kv_transfer_bytes, ks->kv_transfer_s);
    }
    protobuf_c_message_free_unpacked(&ks->base, NULL);
}
