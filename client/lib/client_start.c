/* client_start.c - starting a Generate call: the request checked (so a bad one fails before it
 * is sent, naming its field), turned into a GenerateRequest and sent as the REQUEST of a new
 * call in the table. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* The monotonic deadline for a call with timeout_s (0 = the client's default, < 0 = none),
 * and the matching absolute deadline in unix ms for the REQUEST (0 = none). */
static void call_deadline(const tdm_client_t *c, double timeout_s, double now, double *deadline,
                          uint64_t *deadline_unix_ms)
{
    double t = timeout_s == 0 ? c->timeout_s : timeout_s;
    if (t < 0 || isnan(t)) {
        *deadline = 0;
        *deadline_unix_ms = 0;
        return;
    }
    *deadline = now + t;
    *deadline_unix_ms = tdm_net_now_ms() + (uint64_t)llround(t * 1000.0);
}

client_call_t *tdm_client_call_new(tdm_client_t *c, int method, call_kind_t kind)
{
    client_call_t *call = calloc(1, sizeof *call);
    if (!call)
        return NULL;
    call->id = c->next_id++;
    call->method = method;
    call->kind = kind;
    tdm_client_result_init(&call->result);
    call->result.call_id = call->id;
    return call;
}

/* Sends call's REQUEST to router i with body, or (NULL) the body it kept. Returns
 * tdm_sock_send's status. */
static int send_to(tdm_client_t *c, client_call_t *call, size_t i, const ProtobufCMessage *given)
{
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = call->method;
    m.call_id = call->id;
    m.deadline_unix_ms = call->deadline_ms;
    m.api_key = c->api_key[0] ? c->api_key : NULL;
    if (given) {
        m.body = given;
        return tdm_sock_send(c->routers[i].sock, &m);
    }
    ProtobufCMessage *body =
        protobuf_c_message_unpack(call->req_desc, NULL, call->body_len, call->body);
    if (!body)
        return TDM_ERESOURCE; /* it was packed here: only memory can fail */
    m.body = body;
    int rc = tdm_sock_send(c->routers[i].sock, &m);
    protobuf_c_message_free_unpacked(body, NULL);
    return rc;
}

int tdm_client_call_resend(tdm_client_t *c, client_call_t *call)
{
    /* the routers in turn, from the one after the call's (or the round robin's next), each
     * once per call (tries counts them); a router with no connection up refuses at once
     * (ZMQ_IMMEDIATE) */
    size_t start = call->router == NO_ROUTER ? c->next_router : call->router + 1;
    for (size_t k = 0; k < c->n_routers && call->tries < c->n_routers; k++) {
        size_t i = (start + k) % c->n_routers;
        if (send_to(c, call, i, NULL) == TDM_OK) {
            c->n_retried += call->tries > 0;
            call->router = i;
            call->tries++;
            c->next_router = (i + 1) % c->n_routers;
            return TDM_OK;
        }
    }
    call->router = NO_ROUTER;
    return TDM_EUNAVAILABLE;
}

void tdm_client_resend_waiting(tdm_client_t *c)
{
    for (size_t i = 0; i < c->n_calls; i++)
        if (c->calls[i]->router == NO_ROUTER && c->calls[i]->tries < c->n_routers)
            (void)tdm_client_call_resend(c, c->calls[i]);
}

/* Sends the REQUEST of call with body and registers it. On failure the call is freed and the
 * error is in c->err. With several routers the packed body is kept for sending again, and a
 * call no router can take now waits in the table (tdm_client_call_resend). */
int tdm_client_call_send(tdm_client_t *c, client_call_t *call, const ProtobufCMessage *body,
                         double timeout_s)
{
    double now = tdm_time_now();
    uint64_t deadline_ms;
    call_deadline(c, timeout_s, now, &call->deadline, &deadline_ms);
    call->deadline_ms = deadline_ms;
    bool keep = c->n_routers > 1; /* one router: nothing is ever sent again */
    if (keep) {
        call->req_desc = body->descriptor;
        call->body_len = protobuf_c_message_get_packed_size(body);
        call->body = malloc(call->body_len ? call->body_len : 1);
    }
    int rc = !keep || call->body ? tdm_client_call_add(c, call) : TDM_ERESOURCE;
    if (rc != TDM_OK) {
        tdm_client_call_free(call);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    if (keep)
        protobuf_c_message_pack(body, call->body);
    call->t_start = now;
    if (c->n_routers > 1) {
        call->router = NO_ROUTER;
        (void)tdm_client_call_resend(c, call); /* else it waits for a router */
        return TDM_OK;
    }
    call->router = 0;
    call->tries = 1;
    rc = send_to(c, call, 0, body);
    if (rc != TDM_OK) {
        tdm_client_call_remove(c, call);
        tdm_client_call_free(call);
        return tdm_error_set(&c->err, rc, "client: sending the %s request to %s failed: %s",
                             tdm_net_method_name(call->method), c->endpoint,
                             tdm_sock_errmsg(c->routers[0].sock));
    }
    return TDM_OK;
}

/* Sets c->err to TDM_EINVALID with the message and c->err_field to the request field at fault
 * (a GenerateRequest path, as ErrorDetail.field). Returns TDM_EINVALID. */
static int bad_request(tdm_client_t *c, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad_request(tdm_client_t *c, const char *field, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char msg[TDM_ERRMSG_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(c->err_field, sizeof c->err_field, "%s", field);
    return tdm_error_set(&c->err, TDM_EINVALID, "%s", msg);
}

/* Checks the input of a request: exactly one of prompt, messages and token_ids. */
static int input_check(tdm_client_t *c, const tdm_client_request_t *req)
{
    int inputs = (req->prompt != NULL) + (req->n_messages > 0) + (req->n_token_ids > 0);
    if (inputs != 1)
        return bad_request(c, "",
                           "request: give exactly one of prompt, messages and token_ids (%d given)",
                           inputs);
    if (req->n_messages > 0 && !req->messages)
        return bad_request(c, "chat.messages", "messages is NULL");
    for (size_t i = 0; i < req->n_messages; i++)
        if (!req->messages[i].role ||
            (!req->messages[i].content &&
             !(req->messages[i].tool_calls && req->messages[i].tool_calls[0])))
            return bad_request(c, "chat.messages", "messages[%zu] has a NULL role or content", i);
    if (req->n_token_ids > 0 && !req->token_ids)
        return bad_request(c, "tokens.ids", "token_ids is NULL");
    return TDM_OK;
}

/* Checks what this library can check of a request; the router checks the rest. */
static int request_check(tdm_client_t *c, const tdm_client_request_t *req)
{
    int rc = input_check(c, req);
    if (rc != TDM_OK)
        return rc;
    if (req->max_tokens < 0)
        return bad_request(c, "max_tokens",
                           "max_tokens must be >= 0 (0 = what the context leaves), got %d",
                           (int)req->max_tokens);
    if (req->n_stop > TDM_MAX_STOP_STRINGS)
        return bad_request(c, "stop", "stop: %zu strings given, at most %d allowed", req->n_stop,
                           TDM_MAX_STOP_STRINGS);
    for (size_t i = 0; i < req->n_stop; i++) {
        size_t len = req->stop[i] ? strlen(req->stop[i]) : 0;
        if (len < 1 || len > TDM_MAX_STOP_STRING_BYTES) {
            char field[32];
            snprintf(field, sizeof field, "stop[%zu]", i);
            return bad_request(c, field, "stop[%zu] must have 1..%d bytes, got %zu", i,
                               TDM_MAX_STOP_STRING_BYTES, len);
        }
    }
    if (req->sampling.n_stop_token_ids > TDM_SAMPLING_MAX_STOP)
        return bad_request(c, "sampling.stop_token_ids",
                           "sampling.stop_token_ids: %u ids given, at most %d allowed",
                           (unsigned)req->sampling.n_stop_token_ids, TDM_SAMPLING_MAX_STOP);
    if (req->n > 16)
        return bad_request(c, "n", "n must be from 1 to 16, got %u", (unsigned)req->n);
    if (req->n_bad_words > TDM_SAMPLING_MAX_BAD_WORDS)
        return bad_request(c, "sampling.bad_words",
                           "sampling.bad_words: %zu words given, at most %d allowed",
                           req->n_bad_words, TDM_SAMPLING_MAX_BAD_WORDS);
    for (size_t i = 0; i < req->n_bad_words; i++) {
        size_t len = req->bad_words && req->bad_words[i] ? strlen(req->bad_words[i]) : 0;
        if (len < 1 || len > TDM_SAMPLING_MAX_BAD_WORD_BYTES) {
            char field[40];
            snprintf(field, sizeof field, "sampling.bad_words[%zu]", i);
            return bad_request(c, field, "sampling.bad_words[%zu] must have 1..%d bytes, got %zu",
                               i, TDM_SAMPLING_MAX_BAD_WORD_BYTES, len);
        }
    }
    if ((req->sampling_set & TDM_PROTO_SET_ALLOWED_TOKEN_IDS) &&
        req->sampling.n_allowed > TDM_SAMPLING_MAX_ALLOWED)
        return bad_request(c, "sampling.allowed_token_ids",
                           "sampling.allowed_token_ids: %u ids given, at most %d allowed",
                           (unsigned)req->sampling.n_allowed, TDM_SAMPLING_MAX_ALLOWED);
    if (isnan(req->timeout_s))
        return bad_request(c, "", "timeout_s is NaN");
    if ((int)req->constraint_kind < TDM_CLIENT_CONSTRAINT_NONE ||
        (int)req->constraint_kind > TDM_CLIENT_CONSTRAINT_CHOICE)
        return bad_request(c, "constraint", "constraint: kind %d is not a constraint kind",
                           (int)req->constraint_kind);
    if (req->constraint_kind != TDM_CLIENT_CONSTRAINT_NONE &&
        req->constraint_kind != TDM_CLIENT_CONSTRAINT_JSON_OBJECT && !req->constraint)
        return bad_request(c, "constraint", "constraint: kind %d needs constraint text",
                           (int)req->constraint_kind);
    return TDM_OK;
}

/* m (initialised here) pointing at the strings of cm; NULL strings become "". */
static void chat_message_to_proto(const tdm_chat_message_t *cm, Tandem__V1__ChatMessage *m)
{
    tandem__v1__chat_message__init(m);
    /* protobuf-c message fields are not const; the message is only read while packing */
    m->role = (char *)(uintptr_t)cm->role;
    m->content = (char *)(uintptr_t)str_or_empty(cm->content);
    m->tool_calls = (char *)(uintptr_t)str_or_empty(cm->tool_calls);
    m->tool_call_id = (char *)(uintptr_t)str_or_empty(cm->tool_call_id);
    m->name = (char *)(uintptr_t)str_or_empty(cm->name);
    m->reasoning_content = (char *)(uintptr_t)str_or_empty(cm->reasoning_content);
}

/* req's constraint in *c (its text points into req), or NULL for none. */
static Tandem__V1__Constraint *constraint_of(const tdm_client_request_t *req,
                                             Tandem__V1__Constraint *c)
{
    if (req->constraint_kind == TDM_CLIENT_CONSTRAINT_NONE)
        return NULL;
    tandem__v1__constraint__init(c);
    c->kind = (Tandem__V1__ConstraintKind)req->constraint_kind;
    c->text = (char *)(uintptr_t)str_or_empty(req->constraint);
    return c;
}

/* The bad_words entries of a request: its words (text), then sampling's token sequences. */
typedef struct client_bad_words {
    Tandem__V1__BadWord words[TDM_SAMPLING_MAX_BAD_WORDS];
    Tandem__V1__BadWord *ptr[TDM_SAMPLING_MAX_BAD_WORDS + TDM_SAMPLING_MAX_BAD_SEQS];
} client_bad_words_t;

/* The SamplingParams of req in *out (pointing into req, out and bw): only the fields named in
 * req->sampling_set; the router uses its defaults for the others. req->bad_words are sent
 * (as text) whenever there are any. */
static Tandem__V1__SamplingParams *sampling_to_proto(const tdm_client_request_t *req,
                                                     tdm_proto_sampling_t *out,
                                                     client_bad_words_t *bw)
{
    tdm_proto_sampling_to(&req->sampling, out);
    Tandem__V1__SamplingParams *sp = &out->m;
    sp->set_mask = req->sampling_set & TDM_CLIENT_SAMPLING_ALL;
    sp->has_seed = (sp->set_mask & TDM_PROTO_SET_SEED) != 0;
    if (!(sp->set_mask & TDM_PROTO_SET_STOP_TOKEN_IDS))
        sp->n_stop_token_ids = 0;
    if (!(sp->set_mask & TDM_PROTO_SET_LOGIT_BIAS))
        sp->n_logit_bias = 0;
    if (!(sp->set_mask & TDM_PROTO_SET_ALLOWED_TOKEN_IDS))
        sp->n_allowed_token_ids = 0;
    size_t n_seqs = (sp->set_mask & TDM_PROTO_SET_BAD_WORDS) ? sp->n_bad_words : 0;
    size_t n = 0; /* request_check: n_bad_words <= TDM_SAMPLING_MAX_BAD_WORDS */
    for (size_t i = 0; i < req->n_bad_words && i < TDM_SAMPLING_MAX_BAD_WORDS; i++) {
        tandem__v1__bad_word__init(&bw->words[i]);
        bw->words[i].text = (char *)(uintptr_t)req->bad_words[i];
        bw->ptr[n++] = &bw->words[i];
    }
    for (size_t i = 0; i < n_seqs; i++)
        bw->ptr[n++] = sp->bad_words[i];
    sp->n_bad_words = n;
    sp->bad_words = n ? bw->ptr : NULL;
    if (n)
        sp->set_mask |= TDM_PROTO_SET_BAD_WORDS;
    return sp;
}

/* Builds the GenerateRequest of req and sends it as call. */
static int generate_send(tdm_client_t *c, client_call_t *call, const tdm_client_request_t *req)
{
    Tandem__V1__GenerateRequest m = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    Tandem__V1__TokenList tokens = TANDEM__V1__TOKEN_LIST__INIT;
    tdm_proto_sampling_t sps;
    Tandem__V1__ChatMessage *msgs = NULL;
    Tandem__V1__ChatMessage **msg_ptrs = NULL;

    /* protobuf-c message fields are not const; the message is only read while packing */
    m.request_id = (char *)(uintptr_t)str_or_empty(req->request_id);
    m.model = (char *)(uintptr_t)str_or_empty(req->model);
    if (req->prompt) {
        m.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        m.prompt = (char *)(uintptr_t)req->prompt;
    } else if (req->n_messages > 0) {
        msgs = calloc(req->n_messages, sizeof *msgs);
        msg_ptrs = calloc(req->n_messages, sizeof *msg_ptrs);
        if (!msgs || !msg_ptrs) {
            free(msgs);
            free(msg_ptrs);
            tdm_client_call_free(call);
            return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
        }
        for (size_t i = 0; i < req->n_messages; i++) {
            chat_message_to_proto(&req->messages[i], &msgs[i]);
            msg_ptrs[i] = &msgs[i];
        }
        chat.n_messages = req->n_messages;
        chat.messages = msg_ptrs;
        chat.tools = (char *)(uintptr_t)str_or_empty(req->tools);
        chat.chat_template = (char *)(uintptr_t)str_or_empty(req->chat_template);
        chat.chat_template_kwargs = (char *)(uintptr_t)str_or_empty(req->chat_template_kwargs);
        chat.no_generation_prompt = req->no_generation_prompt;
        chat.continue_final_message = req->continue_final_message;
        m.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
        m.chat = &chat;
    } else {
        tokens.n_ids = req->n_token_ids;
        tokens.ids = (int32_t *)(uintptr_t)req->token_ids;
        m.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS;
        m.tokens = &tokens;
    }
    client_bad_words_t bw;
    m.sampling = sampling_to_proto(req, &sps, &bw);
    m.truncate_prompt_tokens = req->truncate_prompt_tokens;
    m.max_tokens = req->max_tokens;
    m.n_stop = req->n_stop;
    m.stop = (char **)(uintptr_t)req->stop;
    m.stream = req->stream;
    m.n = req->n;
    m.include_stop_str = req->include_stop_str;
    m.render_special = req->render_special;
    m.echo_token_text = req->echo_token_text;
    m.continuous_usage = req->continuous_usage;
    Tandem__V1__PromptLogprobsAsk plp = TANDEM__V1__PROMPT_LOGPROBS_ASK__INIT;
    plp.top = req->prompt_logprobs_top;
    if (req->prompt_logprobs)
        m.prompt_logprobs = &plp;
    m.speculative = req->no_speculation ? TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF
                                        : TANDEM__V1__SPECULATIVE__SPECULATIVE_AUTO;
    Tandem__V1__Constraint cons;
    m.constraint = constraint_of(req, &cons);

    int rc = tdm_client_call_send(c, call, &m.base, req->timeout_s);
    free(msgs);
    free(msg_ptrs);
    return rc;
}

int tdm_client_generate_begin(tdm_client_t *c, const tdm_client_request_t *req,
                              tdm_client_chunk_fn on_chunk, tdm_client_done_fn on_done, void *user,
                              bool sync, client_call_t **out)
{
    tdm_error_clear(&c->err);
    c->err_field[0] = '\0';
    int rc = request_check(c, req);
    if (rc != TDM_OK)
        return rc;
    client_call_t *call =
        tdm_client_call_new(c, TANDEM__V1__METHOD__METHOD_GENERATE, CALL_GENERATE);
    if (!call)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    call->on_chunk = on_chunk;
    call->on_done = on_done;
    call->user = user;
    call->sync = sync;
    call->stream = req->stream;
    call->n = req->n;
    call->text_cap = 64;
    call->result.text = malloc(call->text_cap);
    if (!call->result.text) {
        tdm_client_call_free(call);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    call->result.text[0] = '\0';
    rc = generate_send(c, call, req);
    if (rc != TDM_OK)
        return rc;
    *out = call;
    return TDM_OK;
}

int tdm_client_generate_start(tdm_client_t *c, const tdm_client_request_t *req,
                              tdm_client_chunk_fn on_chunk, tdm_client_done_fn on_done, void *user,
                              uint64_t *call_id)
{
    if (!on_done)
        return tdm_error_set(&c->err, TDM_EINVALID, "client: on_done is NULL");
    client_call_t *call;
    int rc = tdm_client_generate_begin(c, req, on_chunk, on_done, user, false, &call);
    if (rc == TDM_OK && call_id)
        *call_id = call->id;
    return rc;
}
