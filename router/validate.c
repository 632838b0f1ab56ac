/* validate.c - GENERATE validation in the router: a GenerateRequest checked field by field,
 * tokenized and turned into a request's fields, or refused with a tdm_error_t naming the field
 * at fault (ErrorDetail.field) where the check happens.
 *
 * Tokenization is tdm_prompt_encode (tandem/prompt.h) with the template tdm_chat_template_pick
 * chose at start-up: the one implementation `tandem generate -m` and `tandem tokenize --chat`
 * call too, so they make the same ids of the same input; token-id input is taken as it is.
 */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "request.h"
#include "validate.h"
#include "tandem/constraint.h"
#include "tandem/prompt.h"

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

size_t rt_wire_field_len(const uint8_t *b, size_t n, uint32_t field)
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
static int tokenize_prompt(tdm_router_t *r, const char *prompt, bool truncate, const rt_req_t *q,
                           tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    const rt_model_t *md = q->model;
    size_t len = strlen(prompt);
    if (len == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt", "prompt is empty");
    /* a token stands for at most max_token_bytes bytes, so this prompt has more tokens than
     * the context holds: refused in O(1), before tokenizing megabytes on the router's loop.
     * To be truncated it may hold more tokens than the context, but the router still tokenizes
     * it whole (a tail's tokens are not provably the whole text's for every pre-tokenizer), so
     * it gets the same byte bound: tokenizing costs no more than for a prompt that fits. */
    size_t max_len = (size_t)md->n_ctx * md->max_token_bytes - 1;
    if (truncate && len > max_len)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt",
                                   "prompt is %zu bytes; with truncate_prompt_tokens it may be at "
                                   "most %zu bytes (the context, %" PRIu32 " tokens, times %" PRIu32
                                   " bytes, the longest token of this model)",
                                   len, max_len, md->n_ctx, md->max_token_bytes);
    if (!truncate && len > max_len)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt",
                                   "prompt is %zu bytes, so at least %zu tokens (a token of this "
                                   "model stands for at most %" PRIu32
                                   " bytes); the context is %" PRIu32
                                   " tokens (prompt + max_tokens must fit)",
                                   len, len / md->max_token_bytes, md->max_token_bytes, md->n_ctx);
    long bad = utf8_invalid_at(prompt, len);
    if (bad >= 0)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt",
                                   "prompt is not valid UTF-8 (byte offset %ld)", bad);
    tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "prompt: %s", prompt);
    tdm_prompt_input_t in = {.text = prompt, .text_len = len};
    int rc = tdm_prompt_encode(md->tok, NULL, &in, ids, n_ids, NULL, err);
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
        const char *const fields[] = {cm->role, cm->tool_calls, cm->tool_call_id, cm->name,
                                      cm->reasoning_content};
        const char *const names[] = {"role", "tool_calls", "tool_call_id", "name",
                                     "reasoning_content"};
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
                                       .name = cm->name,
                                       .reasoning_content = cm->reasoning_content};
    }
    if (chat->tools && utf8_invalid_at(chat->tools, strlen(chat->tools)) >= 0)
        return tdm_error_set_field(err, TDM_EINVALID, "chat.tools",
                                   "chat.tools is not valid UTF-8");
    if (chat->continue_final_message && !chat->no_generation_prompt)
        return tdm_error_set_field(err, TDM_EINVALID, "chat.continue_final_message",
                                   "chat.continue_final_message and add_generation_prompt cannot "
                                   "both be true (set no_generation_prompt)");
    if (chat->continue_final_message && chat->n_messages > 0) {
        size_t last = chat->n_messages - 1;
        const char *role = chat->messages[last]->role;
        if (!role || strcmp(role, "assistant") != 0) {
            tdm_error_set(err, TDM_EINVALID,
                          "chat.continue_final_message needs the last message to be an "
                          "assistant message; chat.messages[%zu] has role \"%.32s\"",
                          last, role ? role : "");
            return tdm_error_field(err, "chat.messages[%zu].role", last);
        }
    }
    return TDM_OK;
}

/* The request's own chat_template (compiled through the router's cache) and
 * chat_template_kwargs (parsed) into in; NULL/none when the request has none. */
static int chat_template_of(rt_model_t *md, const Tandem__V1__ChatList *chat,
                            tdm_prompt_input_t *in, json_t **kwargs, tdm_error_t *err)
{
    *kwargs = NULL;
    if (chat->chat_template && chat->chat_template[0]) {
        in->jinja = rt_template_cache_get(&md->templates, chat->chat_template,
                                          strlen(chat->chat_template), err);
        if (!in->jinja) {
            tdm_error_prefix(err, err->code, "chat.chat_template: ");
            return tdm_error_field(err, "chat.chat_template");
        }
    }
    if (!chat->chat_template_kwargs || !chat->chat_template_kwargs[0])
        return TDM_OK;
    *kwargs = json_loads(chat->chat_template_kwargs, 0, NULL);
    if (!json_is_object(*kwargs)) {
        json_decref(*kwargs);
        *kwargs = NULL;
        return tdm_error_set_field(err, TDM_EINVALID, "chat.chat_template_kwargs",
                                   "chat.chat_template_kwargs must be a JSON object");
    }
    in->template_kwargs = *kwargs;
    return TDM_OK;
}

/* Chat input -> *ids, rendered with the router's template (or the request's own). */
static int tokenize_chat(tdm_router_t *r, const Tandem__V1__ChatList *chat, const rt_req_t *q,
                         tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    rt_model_t *md = q->model;
    size_t n = chat ? chat->n_messages : 0;
    if (n == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "chat.messages", "chat.messages is empty");
    bool own = chat->chat_template && chat->chat_template[0];
    if (!md->have_template && !own)
        return tdm_error_set_field(err, TDM_EPRECONDITION, "chat",
                                   "chat: the model has no chat template the router knows (%s)",
                                   md->template_error);
    tdm_chat_message_t *msgs = calloc(n, sizeof *msgs);
    if (!msgs)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    char *text = NULL;
    json_t *kwargs = NULL;
    bool raised = false;
    tdm_prompt_input_t in = {.messages = msgs,
                             .n_messages = n,
                             .tools = chat->tools,
                             .no_generation_prompt = chat->no_generation_prompt,
                             .continue_final_message = chat->continue_final_message,
                             .raised = &raised};
    int rc = chat_check(chat, msgs, err);
    if (rc == TDM_OK)
        rc = chat_template_of(md, chat, &in, &kwargs, err);
    if (rc == TDM_OK) {
        rc = tdm_prompt_encode(md->tok, md->have_template ? &md->chat : NULL, &in, ids, n_ids,
                               &text, err);
        if (rc != TDM_OK) {
            if (!raised) /* raise_exception's message stays the template's, as on /tokenize */
                tdm_error_prefix(err, rc, "chat.messages: ");
            tdm_error_field(err, "chat.messages");
        }
    }
    json_decref(kwargs);
    free(msgs);
    if (rc == TDM_OK)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL, "chat prompt: %s", text);
    free(text);
    return rc;
}

/* Token-id input -> *ids (a copy; left NULL when it cannot fit the context, with *n_ids
 * telling the length for the check after). */
static int tokens_copy(const rt_model_t *md, const Tandem__V1__TokenList *tokens, bool truncate,
                       tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    size_t n = tokens ? tokens->n_ids : 0;
    if (n == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "tokens.ids", "tokens.ids is empty");
    for (size_t i = 0; i < n; i++)
        if (tokens->ids[i] < 0 || (uint32_t)tokens->ids[i] >= md->n_vocab) {
            tdm_error_set(err, TDM_EINVALID,
                          "tokens.ids[%zu] = %" PRId32 " is out of the vocabulary (0..%" PRIu32 ")",
                          i, tokens->ids[i], md->n_vocab - 1);
            return tdm_error_field(err, "tokens.ids[%zu]", i);
        }
    *n_ids = n;
    if (n >= md->n_ctx && !truncate)
        return TDM_OK; /* the length check gives the message */
    *ids = malloc(n * sizeof **ids);
    if (!*ids)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    memcpy(*ids, tokens->ids, n * sizeof **ids);
    return TDM_OK;
}

/* truncate_prompt_tokens: 0 (off), -1 (the context length) or 1..n_ctx. */
static int truncate_check(const rt_model_t *md, const Tandem__V1__GenerateRequest *g,
                          tdm_error_t *err)
{
    int32_t k = g->truncate_prompt_tokens;
    if (k == 0 || k == -1 || (k >= 1 && (uint32_t)k <= md->n_ctx))
        return TDM_OK;
    return tdm_error_set_field(err, TDM_EINVALID, "truncate_prompt_tokens",
                               "truncate_prompt_tokens must be -1 (the context length) or in "
                               "[1, %" PRIu32 "] (the context length), got %" PRId32,
                               md->n_ctx, k);
}

/* Tokenizes the request's input into q->prompt (its last truncate_prompt_tokens tokens when
 * set) and checks that it leaves room in the context. */
static int tokenize_input(tdm_router_t *r, const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                          rt_refusal_t *why, tdm_error_t *err)
{
    const rt_model_t *md = q->model;
    tdm_token_t *ids = NULL;
    size_t n_ids = 0;
    int rc;
    const char *field = "prompt";
    switch (g->input_case) {
    case TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT:
        rc = tokenize_prompt(r, g->prompt, g->truncate_prompt_tokens != 0, q, &ids, &n_ids, err);
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT:
        rc = tokenize_chat(r, g->chat, q, &ids, &n_ids, err);
        field = "chat.messages";
        break;
    case TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS:
        rc = tokens_copy(md, g->tokens, g->truncate_prompt_tokens != 0, &ids, &n_ids, err);
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
        if (g->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT)
            return tdm_error_set_field(err, TDM_EINVALID, field,
                                       "the chat template rendered an empty prompt");
        return tdm_error_set_field(err, TDM_EINVALID, field, "prompt: the input has no tokens");
    }
    if (g->truncate_prompt_tokens != 0) {
        /* vLLM: keep the last k tokens; -1 = the context length (the length check follows) */
        size_t k = g->truncate_prompt_tokens < 0 ? md->n_ctx : (size_t)g->truncate_prompt_tokens;
        if (n_ids > k) {
            memmove(ids, ids + (n_ids - k), k * sizeof *ids);
            n_ids = k;
        }
    }
    if (n_ids >= md->n_ctx) {
        free(ids);
        why->prompt_tokens = n_ids > UINT32_MAX ? UINT32_MAX : (uint32_t)n_ids;
        why->n_ctx = md->n_ctx;
        why->max_tokens_fit = 0;
        return tdm_error_set_field(err, TDM_EINVALID, field,
                                   "prompt has %zu tokens; the context is %" PRIu32
                                   " tokens (prompt + max_tokens must fit)",
                                   n_ids, md->n_ctx);
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
    if (rt_req_find_for_peer(r, g->request_id, q->peer, q->peer_len))
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

/* The words of the request's bad_words (entries with text) tokenized into sp after the token
 * sequences tdm_proto_sampling_from took: at most TDM_SAMPLING_MAX_BAD_WORDS words. */
static int bad_words_build(const rt_model_t *md, const Tandem__V1__SamplingParams *m,
                           tdm_sampling_params_t *sp, tdm_error_t *err)
{
    if (!m || !(m->set_mask & TDM_PROTO_SET_BAD_WORDS))
        return TDM_OK;
    size_t words = 0;
    for (size_t i = 0; i < m->n_bad_words; i++)
        words += m->bad_words[i]->text && m->bad_words[i]->text[0];
    if (words > TDM_SAMPLING_MAX_BAD_WORDS)
        return tdm_error_set_field(err, TDM_EINVALID, "sampling.bad_words",
                                   "sampling.bad_words: %zu words given, at most %d allowed", words,
                                   TDM_SAMPLING_MAX_BAD_WORDS);
    for (size_t i = 0; i < m->n_bad_words; i++) {
        const char *t = m->bad_words[i]->text;
        if (t && t[0]) {
            int rc = tdm_prompt_bad_word(md->tok, t, i, sp, err);
            if (rc == TDM_EINVALID)
                return tdm_error_nest(err, "sampling"); /* "sampling.bad_words[2] is ..." */
            if (rc != TDM_OK)
                return rc;
        }
    }
    return TDM_OK;
}

/* allowed_token_ids every one of which the first step's other masks exclude (a one-token
 * bad word; before min_tokens an end-of-generation token unless ignore_eos, or a stop token
 * id) would leave the sampler no token at all: refused here, naming the fields and before
 * any work, instead of failing on the node (a 400 too, TaskFailed.request_fault, but after a
 * prefill and without the field). The first step's mask is tdm_sampling_request_mask's, the node's
 * own; only the listed ids' bits are looked at, so the end-of-generation ids passed are those among
 * them. */
static int allowed_ids_check(const rt_model_t *md, const tdm_sampling_params_t *sp,
                             tdm_error_t *err)
{
    uint32_t n =
        sp->n_allowed < TDM_SAMPLING_MAX_ALLOWED ? sp->n_allowed : TDM_SAMPLING_MAX_ALLOWED;
    if (n == 0)
        return TDM_OK;
    int32_t eog[TDM_SAMPLING_MAX_ALLOWED];
    uint32_t n_eog = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tdm_tokenizer_is_eog(md->tok, sp->allowed[i]))
            eog[n_eog++] = sp->allowed[i];
    size_t words = ((size_t)md->n_vocab + 31) / 32;
    uint32_t *mask = malloc(words * sizeof *mask);
    if (!mask)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    memset(mask, 0xff, words * sizeof *mask);
    (void)tdm_sampling_request_mask(sp, md->n_vocab, eog, n_eog, NULL, 0, mask);
    bool any = false;
    for (uint32_t i = 0; i < n && !any; i++) {
        uint32_t t = (uint32_t)sp->allowed[i]; /* in [0, n_vocab): validated */
        any = (mask[t / 32] >> (t % 32)) & 1u;
    }
    free(mask);
    if (any)
        return TDM_OK;
    if (sp->min_tokens > 0)
        return tdm_error_set_field(
            err, TDM_EINVALID, "sampling.allowed_token_ids",
            "sampling.allowed_token_ids: none of the %" PRIu32 " listed tokens can be the first "
            "token: each is a one-token bad_words entry, or an end-of-generation token or a "
            "stop_token_ids entry, which min_tokens (%" PRId32 ") rules out until then",
            n, sp->min_tokens);
    return tdm_error_set_field(err, TDM_EINVALID, "sampling.allowed_token_ids",
                               "sampling.allowed_token_ids: none of the %" PRIu32
                               " listed tokens can be sampled: each is a one-token bad_words "
                               "entry",
                               n);
}

/* q->sp from the request's sampling fields over Tandem's defaults; a seed drawn when the
 * client gave none. */
static int sampling_build(const tdm_router_t *r, const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                          tdm_error_t *err)
{
    const rt_model_t *md = q->model;
    int rc;
    tdm_sampling_params_default(&q->sp);
    /* the model's defaults (model.defaults) under what the request sets */
    const tdm_model_defaults_t *d = &md->cfg->defaults;
    q->sp.temperature = (float)d->temperature;
    q->sp.top_p = (float)d->top_p;
    q->sp.top_k = d->top_k;
    q->sp.repetition_penalty = (float)d->repetition_penalty;
    bool seeded = false;
    if (g->sampling) {
        rc = tdm_proto_sampling_from(g->sampling, &q->sp, err); /* sets the field */
        if (rc != TDM_OK)
            return rc;
        seeded = g->sampling->has_seed || (g->sampling->set_mask & TDM_PROTO_SET_SEED);
    }
    if (!seeded)
        q->sp.seed = random_u64();
    rc = bad_words_build(md, g->sampling, &q->sp, err);
    if (rc != TDM_OK)
        return rc;
    /* decided after tokenization (max_tokens_decide), which checks min_tokens against it */
    q->sp.max_tokens = INT32_MAX;
    /* the logit bias first: its entry is named by OpenAI's key, logit_bias["<token id>"] */
    if (tdm_sampling_logit_bias_check(&q->sp, md->n_vocab, NULL, err) != TDM_OK ||
        tdm_sampling_params_validate(&q->sp, md->n_vocab, err) != TDM_OK)
        return tdm_error_nest(err, "sampling"); /* "sampling.top_p must be in (0, 1], ..." */
    rc = allowed_ids_check(md, &q->sp, err);
    if (rc != TDM_OK)
        return rc;
    q->sp.max_tokens = 1;
    return TDM_OK;
}

/* min_tokens must not exceed the max_tokens decided (vLLM refuses it too). */
static int min_tokens_check(const rt_req_t *q, tdm_error_t *err)
{
    if (q->sp.min_tokens <= q->sp.max_tokens)
        return TDM_OK;
    return tdm_error_set_field(err, TDM_EINVALID, "sampling.min_tokens",
                               "sampling.min_tokens must be at most max_tokens (%" PRId32
                               "), got %" PRId32,
                               q->sp.max_tokens, q->sp.min_tokens);
}

/* q->sp.max_tokens from the request's max_tokens, which must fit the context the prompt
 * leaves; unset (0): what fits, at most TDM_ROUTER_MAX_TOKENS_DEFAULT. */
static int max_tokens_decide(const tdm_router_t *r, const Tandem__V1__GenerateRequest *g,
                             rt_req_t *q, rt_refusal_t *why, tdm_error_t *err)
{
    const rt_model_t *md = q->model;
    uint32_t room = md->n_ctx - q->n_prompt; /* > 0: tokenize_input checked */
    if (g->max_tokens == 0) {
        uint32_t dflt = md->cfg->defaults.max_tokens > 0 ? (uint32_t)md->cfg->defaults.max_tokens
                                                         : TDM_ROUTER_MAX_TOKENS_DEFAULT;
        q->sp.max_tokens = (int32_t)(room < dflt ? room : dflt);
        return min_tokens_check(q, err);
    }
    if ((uint32_t)g->max_tokens > room) {
        why->prompt_tokens = q->n_prompt;
        why->n_ctx = md->n_ctx;
        why->max_tokens_fit = room;
        return tdm_error_set_field(err, TDM_EINVALID, "max_tokens",
                                   "max_tokens: prompt (%" PRIu32 " tokens) + max_tokens (%" PRId32
                                   ") exceeds the context of %" PRIu32 " tokens; at most %" PRIu32
                                   " tokens can be generated for this prompt",
                                   q->n_prompt, g->max_tokens, md->n_ctx, room);
    }
    q->sp.max_tokens = g->max_tokens;
    return min_tokens_check(q, err);
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
    /* a budget in bytes before any compiling, whose cost grows with the text */
    size_t len = strlen(text);
    bool regex = c->kind == TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_REGEX;
    unsigned limit = regex ? TDM_CONSTRAINT_MAX_REGEX_BYTES : TDM_CONSTRAINT_MAX_BYTES;
    if (len > limit)
        return tdm_error_set_field(err, TDM_EINVALID, "constraint",
                                   "constraint (%s) is %zu bytes; at most %u are compiled",
                                   tdm_constraint_kind_name((int)c->kind), len, limit);
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

/* GenerateRequest.prompt_logprobs into q (want_plp, plp_ask), q's prompt known. */
static int validate_prompt_logprobs(const Tandem__V1__GenerateRequest *g, rt_req_t *q,
                                    tdm_error_t *err)
{
    tandem__v1__prompt_logprobs_ask__init(&q->plp_ask);
    if (!g->prompt_logprobs)
        return TDM_OK;
    if (g->prompt_logprobs->top > TDM_SAMPLING_MAX_LOGPROBS)
        return tdm_error_set_field(err, TDM_EINVALID, "prompt_logprobs",
                                   "prompt_logprobs must be in 0..%d, got %u",
                                   TDM_SAMPLING_MAX_LOGPROBS, g->prompt_logprobs->top);
    /* the values travel in one message (TDM_NET_MAX_BODY_BYTES): about 30 bytes an entry */
    uint64_t entries = (uint64_t)q->n_prompt * (g->prompt_logprobs->top + 1);
    if (entries > RT_PROMPT_LOGPROBS_MAX_ENTRIES)
        return tdm_error_set_field(
            err, TDM_EINVALID, "prompt_logprobs",
            "prompt_logprobs: %" PRIu32 " prompt tokens x %u entries each = %" PRIu64
            " entries, more than the limit of %u (ask fewer alternatives or a shorter prompt)",
            q->n_prompt, g->prompt_logprobs->top + 1, entries, RT_PROMPT_LOGPROBS_MAX_ENTRIES);
    q->want_plp = true;
    q->plp_ask.top = g->prompt_logprobs->top;
    return TDM_OK;
}

int rt_req_validate(tdm_router_t *r, const tdm_frame_t *f, const Tandem__V1__GenerateRequest *g,
                    rt_req_t *q, rt_refusal_t *why, tdm_error_t *err)
{
    size_t id_wire_len = rt_wire_field_len(f->body, f->body ? f->body_len : 0, 1);
    int rc = request_id_assign(r, g, id_wire_len, q, err);
    if (rc != TDM_OK)
        return rc;
    size_t at = 0;
    uint32_t cp = 0;
    if (g->model[0] && !tdm_text_printable(g->model, TDM_MODEL_NAME_MAX, &at) &&
        tdm_utf8_decode((const unsigned char *)g->model + at, strlen(g->model + at), &cp) &&
        tdm_unicode_is_format(cp))
        /* not quoted: the character would reorder or hide what the message says */
        return tdm_error_set_field(err, TDM_EINVALID, "model",
                                   "model: byte %zu is U+%04" PRIX32 ", an invisible format "
                                   "character (Unicode category Cf: a bidi control, a zero-width "
                                   "character); a model name is 1..%u bytes of printable UTF-8",
                                   at, cp, TDM_MODEL_NAME_MAX);
    if (g->model[0] && !tdm_text_printable(g->model, TDM_MODEL_NAME_MAX, &at))
        /* quoted as it came: every reply's text is made valid UTF-8 when it is sent
         * (tdm_sock_reply_error, U+FFFD for each bad byte) and log lines escape controls */
        return tdm_error_set_field(err, TDM_EINVALID, "model",
                                   "model '%.64s': byte %zu is not printable UTF-8 or past %u "
                                   "bytes; a model name is 1..%u bytes of printable UTF-8",
                                   g->model, at, TDM_MODEL_NAME_MAX, TDM_MODEL_NAME_MAX);
    q->model = g->model[0] ? rt_model_find(r, g->model) : &r->models[0];
    if (!q->model) {
        char names[256] = "";
        for (size_t i = 0, len = 0; i < r->n_models && len < sizeof names; i++)
            len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", i ? ", " : "",
                                    r->models[i].cfg->name);
        q->model = &r->models[0]; /* the request is freed with a tokenizer set */
        return tdm_error_set_field(err, TDM_ENOTFOUND, "model",
                                   "model '%s' is not served here; this router serves %s", g->model,
                                   names);
    }
    if (g->max_tokens < 0)
        return tdm_error_set_field(err, TDM_EINVALID, "max_tokens",
                                   "max_tokens must be >= 1 (or 0: what fits), got %" PRId32,
                                   g->max_tokens);
    if ((rc = choices_check(g, err)) != TDM_OK || (rc = stop_copy(g, q, err)) != TDM_OK ||
        (rc = truncate_check(q->model, g, err)) != TDM_OK ||
        (rc = sampling_build(r, g, q, err)) != TDM_OK ||
        (rc = tokenize_input(r, g, q, why, err)) != TDM_OK ||
        (rc = max_tokens_decide(r, g, q, why, err)) != TDM_OK ||
        (rc = constraint_build(g, q, err)) != TDM_OK)
        return rc;
    q->stream = g->stream;
    q->include_stop_str = g->include_stop_str;
    q->echo = g->echo_token_text;
    q->continuous_usage = g->continuous_usage;
    int plp_rc = validate_prompt_logprobs(g, q, err);
    if (plp_rc != TDM_OK)
        return plp_rc;
    q->render_special = g->render_special;
    tdm_detok_init(&q->detok, q->model->tok, q->render_special);
    q->no_speculation = g->speculative == TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF;
    return TDM_OK;
}
