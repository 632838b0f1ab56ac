/* http_openai_out.c - GenerateChunks translated back to OpenAI's answers: the JSON of a whole
 * answer ("text_completion", "chat.completion"; n > 1 and best_of over several choices) and the
 * server-sent events of a stream ("chat.completion.chunk", the error event, [DONE]), with usage
 * (prompt_tokens_details.cached_tokens) and logprobs in OpenAI's shapes. Requests are
 * http_openai.c's.
 */
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_json.h"
#include "http_openai.h"

/* A JSON string of n bytes of s, invalid UTF-8 replaced by U+FFFD (a token can be part of a
 * character). NULL on out of memory. */
static json_t *str_utf8(const char *s, size_t n)
{
    return http_json_text(s, n);
}

static json_t *bytes_array(const char *s)
{
    json_t *a = json_array();
    for (const unsigned char *c = (const unsigned char *)s; a && c && *c; c++)
        json_array_append_new(a, json_integer(*c));
    return a;
}

static uint64_t utf8_chars(const char *s)
{
    uint64_t n = 0;
    for (const unsigned char *c = (const unsigned char *)s; c && *c; c++)
        n += (*c & 0xC0) != 0x80;
    return n;
}

static const char *token_text(const tdm_client_chunk_t *ch, size_t i)
{
    return i < ch->n_token_texts && ch->token_texts[i] ? ch->token_texts[i] : "";
}

/* logprobs of the tokens of ch in OpenAI's shape (completions or chat); NULL when not asked
 * for (json null is then used). */
static json_t *logprobs_json(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch,
                             const tdm_client_chunk_t *plp);

json_t *oai_logprobs_json(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch)
{
    return logprobs_json(q, o, ch, ch);
}

/* oai_logprobs_json, the prompt's entries (completions with echo) taken from plp's prompt
 * logprobs (choice 0's chunk; NULL: none). */
static json_t *logprobs_json(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch,
                             const tdm_client_chunk_t *plp)
{
    if (!q->logprobs)
        return NULL;
    size_t n = ch->n_tokens;
    if (q->kind == OAI_CHAT) {
        json_t *content = json_array();
        for (size_t i = 0; content && i < n; i++) {
            const char *t = token_text(ch, i);
            json_t *top = json_array();
            const tdm_client_token_top_t *tl = i < ch->n_top_logprobs ? &ch->top_logprobs[i] : NULL;
            for (size_t k = 0; top && tl && k < tl->n_entries && (int)k < q->top_logprobs; k++) {
                const tdm_client_top_logprob_t *e = &tl->entries[k];
                json_array_append_new(
                    top, json_pack("{s:o, s:f, s:o}", "token", str_utf8(e->text, strlen(e->text)),
                                   "logprob", (double)e->logprob, "bytes", bytes_array(e->text)));
            }
            double lp = i < ch->n_logprobs ? ch->logprobs[i] : 0.0;
            json_array_append_new(content,
                                  json_pack("{s:o, s:f, s:o, s:o}", "token", str_utf8(t, strlen(t)),
                                            "logprob", lp, "bytes", bytes_array(t), "top_logprobs",
                                            top ? top : json_array()));
        }
        return json_pack("{s:o, s:n}", "content", content ? content : json_array(), "refusal");
    }
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    /* echo (vLLM): the prompt's tokens first, from its prompt logprobs (the first: null) */
    size_t n_plp = q->echo && plp ? plp->n_prompt_logprobs : 0;
    for (size_t i = 0; i < n_plp && tokens && lps && tops && offs; i++) {
        const tdm_client_prompt_logprob_t *p = &plp->prompt_logprobs[i];
        json_array_append_new(tokens, str_utf8(p->text, strlen(p->text)));
        json_array_append_new(lps, p->rank ? json_real(p->logprob) : json_null());
        json_array_append_new(offs, json_integer((json_int_t)o->text_chars));
        o->text_chars += utf8_chars(p->text);
        json_t *d = p->rank ? json_object() : json_null();
        for (size_t k = 0; p->rank && d && k < p->top.n_entries && (int)k < q->top_logprobs; k++) {
            const tdm_client_top_logprob_t *e = &p->top.entries[k];
            json_t *key = str_utf8(e->text, strlen(e->text));
            if (key && !json_object_get(d, json_string_value(key)))
                json_object_set_new(d, json_string_value(key), json_real(e->logprob));
            json_decref(key);
        }
        json_array_append_new(tops, d);
    }
    for (size_t i = 0; i < n && tokens && lps && tops && offs; i++) {
        const char *t = token_text(ch, i);
        json_array_append_new(tokens, str_utf8(t, strlen(t)));
        json_array_append_new(lps, json_real(i < ch->n_logprobs ? ch->logprobs[i] : 0.0));
        json_array_append_new(offs, json_integer((json_int_t)o->text_chars));
        o->text_chars += utf8_chars(t);
        if (q->top_logprobs > 0) {
            json_t *d = json_object();
            const tdm_client_token_top_t *tl = i < ch->n_top_logprobs ? &ch->top_logprobs[i] : NULL;
            for (size_t k = 0; d && tl && k < tl->n_entries && (int)k < q->top_logprobs; k++) {
                const tdm_client_top_logprob_t *e = &tl->entries[k];
                json_t *key = str_utf8(e->text, strlen(e->text));
                if (key && !json_object_get(d, json_string_value(key)))
                    json_object_set_new(d, json_string_value(key), json_real(e->logprob));
                json_decref(key);
            }
            json_array_append_new(tops, d);
        }
    }
    if (q->top_logprobs == 0) {
        json_decref(tops);
        tops = json_null(); /* OpenAI: null when logprobs is 0 */
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens ? tokens : json_array(),
                     "token_logprobs", lps ? lps : json_array(), "top_logprobs",
                     tops ? tops : json_null(), "text_offset", offs ? offs : json_array());
}

/* vLLM's Logprob object {logprob, rank, decoded_token}; -inf is written -9999.0 as vLLM's
 * clamp_prompt_logprobs does (JSON has no infinity). */
static json_t *vllm_logprob(float logprob, uint32_t rank, const char *text)
{
    double lp = isinf(logprob) ? -9999.0 : (double)logprob;
    return json_pack("{s:f, s:I, s:o}", "logprob", lp, "rank", (json_int_t)rank, "decoded_token",
                     str_utf8(text, strlen(text)));
}

/* vLLM's prompt_logprobs of ch: [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...], one
 * entry per prompt token: the first null (it has no prefix), then the token itself and the
 * q->prompt_logprobs most likely (ranked 1..k, as vLLM ranks them). NULL when the request did
 * not ask (json null is then used) or ch has none. */
static json_t *prompt_logprobs_json(const oai_req_t *q, const tdm_client_chunk_t *ch)
{
    if (q->prompt_logprobs < 0 || !ch || ch->n_prompt_logprobs == 0)
        return NULL;
    json_t *a = json_array();
    for (size_t i = 0; a && i < ch->n_prompt_logprobs; i++) {
        const tdm_client_prompt_logprob_t *p = &ch->prompt_logprobs[i];
        if (p->rank == 0) { /* the first token: no prefix */
            json_array_append_new(a, json_null());
            continue;
        }
        json_t *d = json_object();
        char key[16];
        snprintf(key, sizeof key, "%" PRId32, p->token_id);
        if (d)
            json_object_set_new(d, key, vllm_logprob(p->logprob, p->rank, p->text));
        for (size_t j = 0; d && j < p->top.n_entries; j++) {
            const tdm_client_top_logprob_t *e = &p->top.entries[j];
            snprintf(key, sizeof key, "%" PRId32, e->token_id);
            if (!json_object_get(d, key))
                json_object_set_new(d, key, vllm_logprob(e->logprob, (uint32_t)j + 1, e->text));
        }
        json_array_append_new(a, d ? d : json_null());
    }
    return a;
}

/* The chunk of prompt p's candidates that carries its prompt logprobs (choice 0's), or NULL. */
static const tdm_client_chunk_t *plp_chunk(const oai_req_t *q, const tdm_client_chunk_t **chs,
                                           size_t p)
{
    for (uint32_t k = 0; k < q->best_of; k++)
        if (chs[p * q->best_of + k] && chs[p * q->best_of + k]->n_prompt_logprobs > 0)
            return chs[p * q->best_of + k];
    return NULL;
}

/* OpenAI's finish_reason for reason. Never "error", which is not among OpenAI's values (typed
 * clients reject it): a failed stream sends no finish chunk and ends with its error event, as
 * vLLM's does; vLLM's "abort" stands for a call that ended any other way. */
static const char *finish_name(int reason)
{
    switch (reason) {
    case TDM_CLIENT_FINISH_STOP: return "stop";
    case TDM_CLIENT_FINISH_LENGTH: return "length";
    default: return "abort";
    }
}

static json_t *usage_json(const oai_out_t *o)
{
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", (int)o->prompt_tokens,
                     "completion_tokens", (int)o->completion_tokens, "total_tokens",
                     (int)(o->prompt_tokens + o->completion_tokens), "prompt_tokens_details",
                     "cached_tokens", (int)o->cached_tokens);
}

static void take_final(oai_out_t *o, const tdm_client_chunk_t *ch)
{
    o->finish_reason = (int)ch->finish_reason;
    if (ch->usage) {
        o->prompt_tokens = ch->usage->prompt_tokens;
        o->completion_tokens = ch->usage->completion_tokens;
        o->cached_tokens = ch->usage->cached_prompt_tokens;
    }
    if (ch->timings) {
        o->ttft_s = ch->timings->ttft_s;
        o->tpot_s = ch->timings->tpot_s;
    }
}

/* The common part of a streamed chunk; the caller adds "choices". */
static json_t *chunk_base(const oai_req_t *q)
{
    json_t *c = json_pack("{s:s, s:s, s:I, s:o}", "id", q->id, "object",
                          q->kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)q->created, "model", http_json_str(q->model));
    if (c && q->usage_now && q->usage_now->set) {
        const oai_usage_now_t *u = q->usage_now;
        json_object_set_new(c, "usage",
                            json_pack("{s:i, s:i, s:i}", "prompt_tokens", (int)u->prompt_tokens,
                                      "completion_tokens", (int)u->completion_tokens,
                                      "total_tokens",
                                      (int)(u->prompt_tokens + u->completion_tokens)));
    } else if (c && q->include_usage) {
        json_object_set_new(c, "usage", json_null());
    }
    return c;
}

/* Appends "data: {chunk with one choice}\n\n". delta_or_text: the chat delta (consumed) or
 * the completion text; logprobs consumed (NULL = null); finish NULL = null. */
int oai_emit_choice_at(const oai_req_t *q, uint32_t index, tdm_buf_t *b, json_t *delta,
                       const char *text, size_t text_len, json_t *logprobs, const char *finish)
{
    if (q->on_delta) { /* a Responses request: its own events (http_responses.c) */
        json_decref(logprobs);
        return q->on_delta(q->delta_arg, delta, finish, b);
    }
    json_t *c = chunk_base(q);
    json_t *choice = json_pack("{s:i}", "index", (int)index);
    if (!c || !choice) {
        json_decref(c);
        json_decref(choice);
        json_decref(delta);
        json_decref(logprobs);
        return TDM_ERESOURCE;
    }
    if (q->kind == OAI_CHAT)
        json_object_set_new(choice, "delta", delta ? delta : json_object());
    else
        json_object_set_new(choice, "text", str_utf8(text ? text : "", text ? text_len : 0));
    json_object_set_new(choice, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    json_object_set_new(c, "choices", json_pack("[o]", choice));
    int rc = tdm_buf_append(b, "data: ", 6);
    if (rc == TDM_OK)
        rc = http_json_append(b, c);
    if (rc == TDM_OK)
        rc = tdm_buf_append(b, "\n\n", 2);
    json_decref(c);
    return rc;
}

/* continuous_usage: the counts the chunks written next carry (completion_tokens: completion of
 * them, 0 before the first token). */
static void usage_now_set(const oai_req_t *q, const tdm_client_chunk_t *ch, bool completion)
{
    if (!q->usage_now || !ch->usage)
        return;
    q->usage_now->set = true;
    q->usage_now->prompt_tokens = ch->usage->prompt_tokens;
    q->usage_now->completion_tokens = completion ? ch->usage->completion_tokens : 0;
    q->usage_now->cached_tokens = ch->usage->cached_prompt_tokens;
}

/* A streamed chat chunk through the reasoning parser (o->reason, made at the first): the
 * reasoning it settles goes out as delta.reasoning_content (unless include_reasoning is false),
 * the answer's text into *answer for the content and tool-call path. */
static int reasoning_sse(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch,
                         tdm_buf_t *b, tdm_buf_t *answer)
{
    if (!o->reason) {
        if (!(o->reason = calloc(1, sizeof *o->reason)))
            return TDM_ERESOURCE;
        oai_reason_init(o->reason, q->reasoning);
    }
    tdm_buf_t thought = TDM_BUF_INIT;
    int rc = oai_reason_feed(o->reason, ch->text, strlen(ch->text),
                             ch->finish_reason != TDM_CLIENT_FINISH_NONE, &thought, answer);
    if (rc == TDM_OK && thought.len > 0 && !q->hide_reasoning)
        rc = oai_emit_choice_at(
            q, o->index, b,
            json_pack("{s:o}", "reasoning_content", str_utf8(thought.data, thought.len)), NULL, 0,
            NULL, NULL);
    tdm_buf_free(&thought);
    return rc == TDM_OK && answer->oom ? TDM_ERESOURCE : rc;
}

int oai_sse_chunk(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch, tdm_buf_t *b)
{
    int rc = TDM_OK;
    if (!o->started) {
        o->started = true;
        usage_now_set(q, ch, false);
        if (q->kind == OAI_CHAT)
            rc = oai_emit_choice_at(q, o->index, b,
                                    json_pack("{s:s, s:s}", "role", "assistant", "content", ""),
                                    NULL, 0, NULL, NULL);
        if (rc == TDM_OK && q->kind == OAI_CHAT && q->chat_echo)
            rc = oai_emit_choice_at(
                q, o->index, b,
                json_pack("{s:o}", "content", str_utf8(q->chat_echo, strlen(q->chat_echo))), NULL,
                0, NULL, NULL);
        else if (q->kind == OAI_COMPLETION && q->echo)
            rc = oai_emit_choice_at(q, o->index, b, NULL, q->echo, strlen(q->echo), NULL, NULL);
    }
    usage_now_set(q, ch, true);
    tdm_client_chunk_t split;
    tdm_buf_t answer = TDM_BUF_INIT;
    if (rc == TDM_OK && q->kind == OAI_CHAT && q->reasoning != OAI_REASONING_NONE) {
        rc = reasoning_sse(q, o, ch, b, &answer);
        split = *ch;
        split.text = answer.data ? answer.data : "";
        ch = &split;
    }
    bool has_content = ch->text[0] != '\0' || (q->logprobs && ch->n_tokens > 0);
    if (rc == TDM_OK && q->tools.parse) {
        rc = oai_tools_sse(q, o, ch, b);
    } else if (rc == TDM_OK && has_content) {
        json_t *lp = oai_logprobs_json(q, o, ch);
        if (q->kind == OAI_CHAT)
            rc = oai_emit_choice_at(
                q, o->index, b, json_pack("{s:o}", "content", str_utf8(ch->text, strlen(ch->text))),
                NULL, 0, lp, NULL);
        else
            rc = oai_emit_choice_at(q, o->index, b, NULL, ch->text, strlen(ch->text), lp, NULL);
    }
    if (rc == TDM_OK && ch->finish_reason == TDM_CLIENT_FINISH_ERROR && !o->finished) {
        o->finished = true; /* the error event that follows (oai_sse_end) ends the choice */
        take_final(o, ch);
    } else if (rc == TDM_OK && ch->finish_reason != TDM_CLIENT_FINISH_NONE && !o->finished) {
        o->finished = true;
        take_final(o, ch);
        const char *tools_finish = oai_tools_finish(o, ch->finish_reason);
        rc = oai_emit_choice_at(q, o->index, b, NULL, "", 0, NULL,
                                tools_finish ? tools_finish : finish_name(ch->finish_reason));
    }
    tdm_buf_free(&answer);
    return rc;
}

int oai_sse_end(const oai_req_t *q, oai_out_t *o, int status, const char *message, tdm_buf_t *b)
{
    int rc = TDM_OK;
    if (status == TDM_OK && q->include_usage) {
        json_t *c = chunk_base(q);
        if (!c)
            return TDM_ERESOURCE;
        json_object_set_new(c, "choices", json_array());
        json_object_set_new(c, "usage", usage_json(o));
        rc = tdm_buf_append(b, "data: ", 6);
        if (rc == TDM_OK)
            rc = http_json_append(b, c);
        if (rc == TDM_OK)
            rc = tdm_buf_append(b, "\n\n", 2);
        json_decref(c);
    } else if (status != TDM_OK) {
        json_t *e = http_error_json(status, NULL, NULL,
                                    message && message[0] ? message : tdm_strerror(status));
        if (!e)
            return TDM_ERESOURCE;
        rc = tdm_buf_append(b, "data: ", 6);
        if (rc == TDM_OK)
            rc = http_json_append(b, e);
        if (rc == TDM_OK)
            rc = tdm_buf_append(b, "\n\n", 2);
        json_decref(e);
    }
    if (rc == TDM_OK)
        rc = tdm_buf_append(b, "data: [DONE]\n\n", 14);
    return rc;
}

/* The response object without choices and usage; NULL on out of memory. */
static json_t *response_base(const oai_req_t *q)
{
    return json_pack("{s:s, s:s, s:I, s:o}", "id", q->id, "object",
                     q->kind == OAI_CHAT ? "chat.completion" : "text_completion", "created",
                     (json_int_t)q->created, "model", http_json_str(q->model));
}

/* A chat answer's message from its text (the answer after any reasoning): tool calls parsed
 * when the request has tools (*n_calls), the echoed last message first (vLLM). */
static json_t *chat_message_json(const oai_req_t *q, const char *text, bool cut, size_t *n_calls)
{
    if (q->tools.parse) {
        json_t *m = oai_tools_message_json(q, text, cut, n_calls);
        json_t *c = m ? json_object_get(m, "content") : NULL;
        if (q->chat_echo && m) { /* vLLM: the echo goes before the parsed content */
            tdm_buf_t t = TDM_BUF_INIT;
            tdm_buf_append(&t, q->chat_echo, strlen(q->chat_echo));
            if (json_is_string(c))
                tdm_buf_append(&t, json_string_value(c), json_string_length(c));
            json_object_set_new(m, "content", str_utf8(t.data ? t.data : "", t.len));
            tdm_buf_free(&t);
        }
        return m;
    }
    tdm_buf_t t = TDM_BUF_INIT;
    if (q->chat_echo)
        tdm_buf_append(&t, q->chat_echo, strlen(q->chat_echo));
    tdm_buf_append(&t, text, strlen(text));
    json_t *m = json_pack("{s:s, s:o, s:n}", "role", "assistant", "content",
                          str_utf8(t.data ? t.data : "", t.len), "refusal");
    tdm_buf_free(&t);
    return m;
}

/* One choice of a non-streaming answer from its whole chunk ch, as choice `index`. */
static json_t *choice_json(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch,
                           uint32_t index, const tdm_client_chunk_t *plp)
{
    json_t *choice = json_pack("{s:i}", "index", (int)index);
    if (!choice)
        return NULL;
    json_t *lp = logprobs_json(q, o, ch, plp);
    size_t n_calls = 0;
    const char *text = ch->text;
    tdm_buf_t thought = TDM_BUF_INIT, answer = TDM_BUF_INIT;
    bool reasons = q->kind == OAI_CHAT && q->reasoning != OAI_REASONING_NONE;
    if (reasons) {
        oai_reason_t rp;
        oai_reason_init(&rp, q->reasoning);
        (void)oai_reason_feed(&rp, ch->text, strlen(ch->text), true, &thought, &answer);
        oai_reason_free(&rp);
        text = answer.data ? answer.data : "";
    }
    if (q->kind == OAI_CHAT) {
        json_object_set_new(
            choice, "message",
            chat_message_json(q, text, ch->finish_reason == TDM_CLIENT_FINISH_LENGTH, &n_calls));
    } else {
        tdm_buf_t t = TDM_BUF_INIT;
        if (q->echo)
            tdm_buf_append(&t, q->echo, strlen(q->echo));
        tdm_buf_append(&t, ch->text, strlen(ch->text));
        json_object_set_new(choice, "text", str_utf8(t.data ? t.data : "", t.len));
        tdm_buf_free(&t);
    }
    json_t *msg = json_object_get(choice, "message");
    const char *answer_text = json_string_value(json_object_get(msg, "content"));
    if (reasons && msg && answer_text && !answer_text[0] && thought.len > 0)
        json_object_set_new(msg, "content", json_null()); /* all of it was reasoning */
    if (reasons && msg)
        json_object_set_new(msg, "reasoning_content",
                            thought.len > 0 && !q->hide_reasoning
                                ? str_utf8(thought.data, thought.len)
                                : json_null());
    tdm_buf_free(&thought);
    tdm_buf_free(&answer);
    json_object_set_new(choice, "logprobs", lp ? lp : json_null());
    if (q->kind == OAI_COMPLETION && q->prompt_logprobs >= 0) { /* vLLM: on each choice */
        json_t *pl = prompt_logprobs_json(q, plp);
        json_object_set_new(choice, "prompt_logprobs", pl ? pl : json_null());
    }
    bool called = n_calls > 0 && ch->finish_reason == TDM_CLIENT_FINISH_STOP;
    json_object_set_new(choice, "finish_reason",
                        json_string(called ? "tool_calls" : finish_name(ch->finish_reason)));
    return choice;
}

json_t *oai_response(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch)
{
    take_final(o, ch);
    json_t *r = response_base(q);
    json_t *choice = r ? choice_json(q, o, ch, 0, ch) : NULL;
    if (!choice) {
        json_decref(r);
        return NULL;
    }
    json_object_set_new(r, "choices", json_pack("[o]", choice));
    if (q->kind == OAI_CHAT && q->prompt_logprobs >= 0) { /* vLLM: on the response */
        json_t *pl = prompt_logprobs_json(q, ch);
        json_object_set_new(r, "prompt_logprobs", pl ? pl : json_null());
    }
    json_object_set_new(r, "usage", usage_json(o));
    return r;
}

void oai_usage_sum(const oai_req_t *q, const oai_out_t *outs, oai_out_t *sum)
{
    sum->prompt_tokens = sum->completion_tokens = sum->cached_tokens = 0;
    for (size_t i = 0; i < oai_candidates(q); i++) {
        const oai_out_t *o = &outs[i];
        sum->completion_tokens += o->completion_tokens;
        if (i % q->best_of == 0) { /* the prompt's choices share its prefill */
            sum->prompt_tokens += o->prompt_tokens;
            sum->cached_tokens += o->cached_tokens;
        }
    }
    sum->ttft_s = outs[0].ttft_s;
    sum->tpot_s = outs[0].tpot_s;
    sum->finish_reason = outs[0].finish_reason;
}

/* The sum of ch's sampled-token logprobs: best_of's ranking. */
static double cumulative_logprob(const tdm_client_chunk_t *ch)
{
    double s = 0;
    for (size_t i = 0; i < ch->n_logprobs; i++)
        s += ch->logprobs[i];
    return s;
}

/* order[n] := the n best of prompt p's candidates (indices into chs), highest cumulative
 * logprob first; candidate order when best_of == n. */
static void pick_best(const oai_req_t *q, size_t p, const tdm_client_chunk_t **chs, size_t *order)
{
    size_t base = p * q->best_of;
    bool taken[OAI_MAX_CHOICES] = {false};
    for (uint32_t j = 0; j < q->n; j++) {
        size_t best = SIZE_MAX;
        for (uint32_t k = 0; k < q->best_of; k++) {
            if (taken[k])
                continue;
            if (q->best_of == q->n || best == SIZE_MAX ||
                cumulative_logprob(chs[base + k]) > cumulative_logprob(chs[base + best])) {
                best = k;
                if (q->best_of == q->n)
                    break;
            }
        }
        taken[best] = true;
        order[j] = base + best;
    }
}

json_t *oai_response_multi(const oai_req_t *q, oai_out_t *outs, const tdm_client_chunk_t **chs,
                           oai_out_t *sum)
{
    for (size_t i = 0; i < oai_candidates(q); i++)
        take_final(&outs[i], chs[i]);
    oai_usage_sum(q, outs, sum);
    json_t *r = response_base(q);
    json_t *choices = json_array();
    if (!r || !choices) {
        json_decref(r);
        json_decref(choices);
        return NULL;
    }
    for (size_t p = 0; p < q->n_prompts; p++) {
        size_t order[OAI_MAX_CHOICES];
        pick_best(q, p, chs, order);
        for (uint32_t j = 0; j < q->n; j++) {
            json_t *c = choice_json(q, &outs[order[j]], chs[order[j]], (uint32_t)p * q->n + j,
                                    plp_chunk(q, chs, p));
            if (!c || json_array_append_new(choices, c) != 0) {
                json_decref(r);
                json_decref(choices);
                return NULL;
            }
        }
    }
    json_object_set_new(r, "choices", choices);
    if (q->kind == OAI_CHAT && q->prompt_logprobs >= 0) {
        json_t *pl = prompt_logprobs_json(q, plp_chunk(q, chs, 0));
        json_object_set_new(r, "prompt_logprobs", pl ? pl : json_null());
    }
    json_object_set_new(r, "usage", usage_json(sum));
    return r;
}
