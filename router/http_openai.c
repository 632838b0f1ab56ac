/* http_openai.c - OpenAI's completions and chat completions requests translated to the
 * router's GenerateRequest (the answers are http_openai_out.c's).
 *
 * Request fields follow OpenAI's API reference (and vLLM's extensions: top_k, min_p,
 * repetition_penalty, stop_token_ids, ignore_eos, include_stop_str_in_output) and Tandem's
 * speculative ("auto" | "off"), and on chat vLLM's chat_template and chat_template_kwargs;
 * unknown fields are ignored as vLLM does. Type errors name the field; range checks are the
 * router's, whose messages name the field too (tdm_error_t's field, OpenAI's name).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "http_openai.h"
#include "http_json.h"
#include "tandem/chat.h"
#include "tandem/sampling.h"

#define OAI_COMPLETION_DEFAULT_MAX_TOKENS 16
#define OAI_MAX_LOGPROBS 20

/* ---- parsing helpers ---- */

const char *oai_type_name(const json_t *v)
{
    if (!v) /* an absent member: json_object_get's NULL */
        return "nothing (the field is missing)";
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* The field's value, or NULL when absent or null. */
static json_t *field(json_t *root, const char *name)
{
    json_t *v = json_object_get(root, name);
    return v && !json_is_null(v) ? v : NULL;
}

/* A number field into *out; false when absent or null. *rc is set on a type error. */
typedef struct parse_ctx {
    json_t *root;
    tdm_error_t *err;
    int rc;
} parse_ctx_t;

static bool get_number(parse_ctx_t *p, const char *name, double *out)
{
    json_t *v = field(p->root, name);
    if (!v || p->rc)
        return false;
    if (!json_is_number(v)) {
        p->rc = tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be a number, got %s", name,
                                    oai_type_name(v));
        return false;
    }
    *out = json_number_value(v);
    return true;
}

/* An integer (or a number with an integral value, as pydantic accepts) in [lo, hi]. */
static bool get_int(parse_ctx_t *p, const char *name, long long lo, long long hi, long long *out)
{
    json_t *v = field(p->root, name);
    if (!v || p->rc)
        return false;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v);
    } else {
        p->rc = tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be an integer, got %s",
                                    name, oai_type_name(v));
        return false;
    }
    if (x < lo || x > hi) {
        p->rc = tdm_error_set_field(p->err, TDM_EINVALID, name,
                                    "%s must be in %lld..%lld, got %lld", name, lo, hi, x);
        return false;
    }
    *out = x;
    return true;
}

static bool get_bool(parse_ctx_t *p, const char *name, bool *out)
{
    json_t *v = field(p->root, name);
    if (!v || p->rc)
        return false;
    if (!json_is_boolean(v)) {
        p->rc = tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be a boolean, got %s",
                                    name, oai_type_name(v));
        return false;
    }
    *out = json_is_true(v);
    return true;
}

static const char *get_string(parse_ctx_t *p, const char *name)
{
    json_t *v = field(p->root, name);
    if (!v || p->rc)
        return NULL;
    if (!json_is_string(v)) {
        p->rc = tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be a string, got %s", name,
                                    oai_type_name(v));
        return NULL;
    }
    return json_string_value(v);
}

static void make_id(char *buf, size_t cap, const char *prefix)
{
    uint8_t r[12] = {0};
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
        uint64_t t = (uint64_t)(tdm_time_now() * 1e9);
        memcpy(r, &t, sizeof t);
    }
    int n = snprintf(buf, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof r && n > 0 && (size_t)n + 2 < cap; i++)
        n += snprintf(buf + n, cap - (size_t)n, "%02x", r[i]);
}

/* ---- inputs ---- */

/* Token ids of a prompt (a JSON array named name) into a new array *ids[*n]. */
static int prompt_ids(parse_ctx_t *p, json_t *v, const char *name, int32_t **ids, size_t *n)
{
    *n = json_array_size(v);
    if (*n == 0)
        return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s is an empty array", name);
    *ids = calloc(*n, sizeof **ids);
    if (!*ids)
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; i < *n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX) {
            char field[48];
            snprintf(field, sizeof field, "%s[%zu]", name, i);
            return tdm_error_set_field(p->err, TDM_EINVALID, field,
                                       "%s must be a token id (an integer >= 0)", field);
        }
        (*ids)[i] = (int32_t)json_integer_value(e);
    }
    return TDM_OK;
}

/* A list of prompts (strings or token-id arrays, 2..OAI_MAX_PROMPTS): one call each, answered
 * as one response (choice p * n + j). The first is also q's own input. */
static int parse_prompt_list(parse_ctx_t *p, oai_req_t *q, json_t *v)
{
    size_t n = json_array_size(v);
    if (n > OAI_MAX_PROMPTS)
        return tdm_error_set_field(p->err, TDM_EINVALID, "prompt",
                                   "prompt: a list of %zu prompts; at most %d per request", n,
                                   OAI_MAX_PROMPTS);
    q->list_ids = calloc(n, sizeof *q->list_ids);
    q->list_n_ids = calloc(n, sizeof *q->list_n_ids);
    if (!q->list_ids || !q->list_n_ids)
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    q->n_prompts = n;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        char name[32];
        snprintf(name, sizeof name, "prompt[%zu]", i);
        if (json_is_array(e)) {
            int rc = prompt_ids(p, e, name, &q->list_ids[i], &q->list_n_ids[i]);
            if (rc != TDM_OK)
                return rc;
        } else if (!json_is_string(e)) {
            return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                       "%s must be a string or an array of token ids, got %s", name,
                                       oai_type_name(e));
        }
    }
    return TDM_OK;
}

static int parse_prompt(parse_ctx_t *p, oai_req_t *q)
{
    json_t *v = field(p->root, "prompt");
    q->n_prompts = 1;
    if (!v)
        return tdm_error_set_field(p->err, TDM_EINVALID, "prompt", "prompt is required");
    if (json_is_array(v) && json_array_size(v) > 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0)))) {
        int rc = parse_prompt_list(p, q, v);
        if (rc != TDM_OK)
            return rc;
    }
    if (json_is_array(v) && json_array_size(v) >= 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0); /* [prompt] or [[ids]], or a list's first */
    if (json_is_string(v)) {
        q->g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        q->g.prompt = (char *)json_string_value(v);
        return TDM_OK;
    }
    if (!json_is_array(v))
        return tdm_error_set_field(
            p->err, TDM_EINVALID, "prompt",
            "prompt must be a string, an array of one string or an array of token "
            "ids, got %s",
            oai_type_name(v));
    size_t n;
    int rc = prompt_ids(p, v, "prompt", &q->ids, &n);
    if (rc != TDM_OK)
        return rc;
    q->tokens.n_ids = n;
    q->tokens.ids = q->ids;
    q->g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS;
    q->g.tokens = &q->tokens;
    return TDM_OK;
}

/* messages[i].content: a string, null, or an array of {"type": "text", "text": ...} parts
 * (joined with newlines, as vLLM does). */
static int parse_content(parse_ctx_t *p, oai_req_t *q, size_t i, json_t *c, const char **out)
{
    char name[64];
    snprintf(name, sizeof name, "messages[%zu].content", i);
    if (!c || json_is_null(c)) {
        *out = "";
        return TDM_OK;
    }
    if (json_is_string(c)) {
        *out = json_string_value(c);
        return TDM_OK;
    }
    if (!json_is_array(c))
        return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                   "%s must be a string or an array of content parts, got %s", name,
                                   oai_type_name(c));
    tdm_buf_t b = TDM_BUF_INIT;
    size_t j;
    json_t *part;
    json_array_foreach(c, j, part)
    {
        const char *type = json_string_value(json_object_get(part, "type"));
        const char *text = json_string_value(json_object_get(part, "text"));
        if (!json_is_object(part) || !type) {
            tdm_buf_free(&b);
            return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                       "%s[%zu] must be an object with a \"type\"", name, j);
        }
        if (strcmp(type, "text") != 0) {
            tdm_buf_free(&b);
            return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                       "%s[%zu]: content of type '%s' is not supported; only text",
                                       name, j, type);
        }
        if (!text) {
            tdm_buf_free(&b);
            return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s[%zu].text must be a string",
                                       name, j);
        }
        if ((j > 0 && tdm_buf_append(&b, "\n", 1) != TDM_OK) ||
            tdm_buf_append(&b, text, strlen(text)) != TDM_OK) {
            tdm_buf_free(&b);
            return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
        }
    }
    if (!b.data && tdm_buf_append(&b, "", 0) != TDM_OK)
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    q->joined[i] = b.data; /* owned by q */
    *out = b.data;
    return TDM_OK;
}

/* messages[i] (a JSON object m) into q->msgs[i]: role ("developer" read as "system"), content
 * (or tool_calls), the tool fields and past reasoning. */
static int parse_message(parse_ctx_t *p, oai_req_t *q, size_t i, json_t *m)
{
    char name[48];
    snprintf(name, sizeof name, "messages[%zu]", i);
    if (!json_is_object(m))
        return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be an object, got %s", name,
                                   oai_type_name(m));
    json_t *role = json_object_get(m, "role");
    if (!json_is_string(role)) {
        snprintf(name, sizeof name, "messages[%zu].role", i);
        return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be a string", name);
    }
    const char *r = json_string_value(role);
    if (strcmp(r, "developer") == 0)
        r = "system"; /* OpenAI's newer name for system instructions */
    json_t *c = json_object_get(m, "content");
    if ((!c || json_is_null(c)) && !json_object_get(m, "tool_calls") &&
        !json_object_get(m, "function_call")) {
        snprintf(name, sizeof name, "messages[%zu].content", i);
        return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                   "%s is required: a message has content (an assistant message "
                                   "may have tool_calls instead)",
                                   name);
    }
    const char *content = "";
    int rc = parse_content(p, q, i, c, &content);
    if (rc != TDM_OK)
        return rc;
    tandem__v1__chat_message__init(&q->msgs[i]);
    q->msgs[i].role = (char *)r;
    q->msgs[i].content = (char *)content;
    q->msg_ptr[i] = &q->msgs[i];
    rc = oai_tools_message(m, i, &q->msgs[i], &q->tools, p->err);
    if (rc == TDM_OK)
        rc = oai_reasoning_message(m, i, &q->msgs[i], p->err);
    return rc;
}

static int parse_messages(parse_ctx_t *p, oai_req_t *q)
{
    json_t *v = field(p->root, "messages");
    if (!v)
        return tdm_error_set_field(p->err, TDM_EINVALID, "messages", "messages is required");
    if (!json_is_array(v))
        return tdm_error_set_field(p->err, TDM_EINVALID, "messages",
                                   "messages must be an array, got %s", oai_type_name(v));
    size_t n = json_array_size(v);
    if (n == 0)
        return tdm_error_set_field(p->err, TDM_EINVALID, "messages", "messages is empty");
    q->msgs = calloc(n, sizeof *q->msgs);
    q->msg_ptr = calloc(n, sizeof *q->msg_ptr);
    q->joined = calloc(n, sizeof *q->joined);
    if (!q->msgs || !q->msg_ptr || !q->joined)
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    q->chat.n_messages = n; /* so oai_req_clear frees what was joined so far */
    for (size_t i = 0; i < n; i++) {
        int rc = parse_message(p, q, i, json_array_get(v, i));
        if (rc != TDM_OK)
            return rc;
    }
    q->chat.messages = q->msg_ptr;
    q->g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    q->g.chat = &q->chat;
    return TDM_OK;
}

static int parse_stop(parse_ctx_t *p, oai_req_t *q)
{
    json_t *v = field(p->root, "stop");
    if (!v)
        return TDM_OK;
    if (json_is_string(v)) {
        q->stop = calloc(1, sizeof *q->stop);
        if (!q->stop)
            return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
        q->stop[0] = (char *)json_string_value(v);
        q->g.n_stop = 1;
    } else if (json_is_array(v)) {
        size_t n = json_array_size(v);
        q->stop = calloc(n ? n : 1, sizeof *q->stop);
        if (!q->stop)
            return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
        for (size_t i = 0; i < n; i++) {
            json_t *e = json_array_get(v, i);
            if (!json_is_string(e))
                return tdm_error_set_field(p->err, TDM_EINVALID, "stop",
                                           "stop[%zu] must be a string, got %s", i,
                                           oai_type_name(e));
            q->stop[i] = (char *)json_string_value(e);
        }
        q->g.n_stop = n;
    } else {
        return tdm_error_set_field(p->err, TDM_EINVALID, "stop",
                                   "stop must be a string or an array of strings, got %s",
                                   oai_type_name(v));
    }
    q->g.stop = q->stop;
    return TDM_OK;
}

/* The array field name of the request into *a, with its *n entries (*a NULL when the field is
 * absent or null). of says what the entries are and unit what one is counted as, for the
 * errors ("token ids", "ids"); non_empty refuses an empty array; max is the most entries
 * allowed. Returns TDM_OK, or TDM_EINVALID naming the field. */
static int get_array(parse_ctx_t *p, const char *name, const char *of, const char *unit,
                     bool non_empty, size_t max, json_t **a, size_t *n)
{
    *a = field(p->root, name);
    *n = *a && json_is_array(*a) ? json_array_size(*a) : 0;
    if (!*a)
        return TDM_OK;
    if (!json_is_array(*a) || (non_empty && *n == 0))
        return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be %s array of %s, got %s",
                                   name, non_empty ? "a non-empty" : "an", of,
                                   json_is_array(*a) ? "an empty array" : oai_type_name(*a));
    if (*n > max)
        return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s has %zu %s, at most %zu allowed",
                                   name, *n, unit, max);
    return TDM_OK;
}

/* stop_token_ids: an array of token ids (range checks are the router's). */
static int parse_stop_token_ids(parse_ctx_t *p, oai_req_t *q)
{
    if (p->rc)
        return p->rc;
    json_t *ids;
    size_t n;
    int rc = get_array(p, "stop_token_ids", "token ids", "ids", false, SIZE_MAX, &ids, &n);
    if (rc != TDM_OK || !ids)
        return rc;
    q->stop_ids = calloc(n ? n : 1, sizeof *q->stop_ids);
    if (!q->stop_ids)
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    for (size_t k = 0; k < n; k++) {
        json_t *e = json_array_get(ids, k);
        if (!json_is_integer(e) || json_integer_value(e) < INT32_MIN ||
            json_integer_value(e) > INT32_MAX)
            return tdm_error_set_field(p->err, TDM_EINVALID, "stop_token_ids",
                                       "stop_token_ids[%zu] must be a token id", k);
        q->stop_ids[k] = (int32_t)json_integer_value(e);
    }
    q->sp.stop_token_ids = q->stop_ids;
    q->sp.n_stop_token_ids = n;
    q->sp.set_mask |= TDM_PROTO_SET_STOP_TOKEN_IDS;
    return TDM_OK;
}

/* allowed_token_ids: a non-empty array of at most TDM_SAMPLING_MAX_ALLOWED token ids (the
 * vocabulary bound is the router's), into q->sp. */
static int parse_allowed_ids(parse_ctx_t *p, oai_req_t *q)
{
    json_t *a;
    size_t n;
    int rc = get_array(p, "allowed_token_ids", "token ids", "ids", true, TDM_SAMPLING_MAX_ALLOWED,
                       &a, &n);
    if (rc != TDM_OK || !a)
        return rc;
    if (!(q->allowed_ids = calloc(n, sizeof *q->allowed_ids)))
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(a, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX) {
            char name[40];
            snprintf(name, sizeof name, "allowed_token_ids[%zu]", i);
            if (json_is_integer(e) && json_integer_value(e) > INT32_MAX)
                return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                           "%s: %" JSON_INTEGER_FORMAT
                                           " is not a token id (above 2147483647)",
                                           name, json_integer_value(e));
            return tdm_error_set_field(
                p->err, TDM_EINVALID, name, "%s must be a token id (an integer >= 0), got %s", name,
                json_is_integer(e) ? "a negative integer" : oai_type_name(e));
        }
        q->allowed_ids[i] = (int32_t)json_integer_value(e);
    }
    q->sp.allowed_token_ids = q->allowed_ids;
    q->sp.n_allowed_token_ids = n;
    q->sp.set_mask |= TDM_PROTO_SET_ALLOWED_TOKEN_IDS;
    return TDM_OK;
}

/* bad_words: an array of at most TDM_SAMPLING_MAX_BAD_WORDS strings of 1..256 bytes (the
 * router tokenizes them), into q->bad_words. */
static int parse_bad_words(parse_ctx_t *p, oai_req_t *q)
{
    json_t *b;
    size_t n;
    int rc =
        get_array(p, "bad_words", "strings", "words", false, TDM_SAMPLING_MAX_BAD_WORDS, &b, &n);
    if (rc != TDM_OK || !b)
        return rc;
    if (n && !(q->bad_words = calloc(n, sizeof *q->bad_words)))
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(b, i);
        char name[32];
        snprintf(name, sizeof name, "bad_words[%zu]", i);
        if (!json_is_string(e))
            return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be a string, got %s",
                                       name, oai_type_name(e));
        size_t len = json_string_length(e);
        if (len < 1 || len > TDM_SAMPLING_MAX_BAD_WORD_BYTES)
            return tdm_error_set_field(p->err, TDM_EINVALID, name,
                                       "%s must have 1..%d bytes, got %zu", name,
                                       TDM_SAMPLING_MAX_BAD_WORD_BYTES, len);
        q->bad_words[i] = json_string_value(e);
    }
    q->n_bad_words = n;
    return TDM_OK;
}

/* vLLM's min_tokens (>= 0; at most max_tokens: the router's check), allowed_token_ids (a
 * non-empty array of at most TDM_SAMPLING_MAX_ALLOWED token ids; the vocabulary bound is the
 * router's), bad_words (an array of at most TDM_SAMPLING_MAX_BAD_WORDS strings of 1..256
 * bytes; the router tokenizes them) and truncate_prompt_tokens (-1 or >= 1; the context
 * bound is the router's). */
static int parse_request_masks(parse_ctx_t *p, oai_req_t *q)
{
    long long k;
    if (get_int(p, "min_tokens", 0, INT32_MAX, &k)) {
        q->sp.min_tokens = (int32_t)k;
        q->sp.set_mask |= TDM_PROTO_SET_MIN_TOKENS;
    }
    if (get_int(p, "truncate_prompt_tokens", INT32_MIN, INT32_MAX, &k)) {
        if (k == 0 || k < -1)
            return tdm_error_set_field(p->err, TDM_EINVALID, "truncate_prompt_tokens",
                                       "truncate_prompt_tokens must be -1 (the context length) or "
                                       ">= 1 (the last tokens of the prompt kept), got %lld",
                                       k);
        q->g.truncate_prompt_tokens = (int32_t)k;
    }
    if (p->rc)
        return p->rc;
    int rc = parse_allowed_ids(p, q);
    return rc != TDM_OK ? rc : parse_bad_words(p, q);
}

/* The float sampling fields, by their OpenAI/vLLM names. */
static const struct {
    const char *name;
    size_t off; /* of the float in Tandem__V1__SamplingParams */
    uint32_t bit;
} float_fields[] = {
    {"temperature", offsetof(Tandem__V1__SamplingParams, temperature), TDM_PROTO_SET_TEMPERATURE},
    {"top_p", offsetof(Tandem__V1__SamplingParams, top_p), TDM_PROTO_SET_TOP_P},
    {"min_p", offsetof(Tandem__V1__SamplingParams, min_p), TDM_PROTO_SET_MIN_P},
    {"presence_penalty", offsetof(Tandem__V1__SamplingParams, presence_penalty),
     TDM_PROTO_SET_PRESENCE_PENALTY},
    {"frequency_penalty", offsetof(Tandem__V1__SamplingParams, frequency_penalty),
     TDM_PROTO_SET_FREQUENCY_PENALTY},
    {"repetition_penalty", offsetof(Tandem__V1__SamplingParams, repetition_penalty),
     TDM_PROTO_SET_REPETITION_PENALTY},
};

static int parse_sampling(parse_ctx_t *p, oai_req_t *q)
{
    Tandem__V1__SamplingParams *sp = &q->sp;
    double d;
    long long i;
    bool b;
    for (size_t k = 0; k < sizeof float_fields / sizeof float_fields[0]; k++)
        if (get_number(p, float_fields[k].name, &d)) {
            float f = (float)d;
            memcpy((char *)sp + float_fields[k].off, &f, sizeof f);
            sp->set_mask |= float_fields[k].bit;
        }
    if (get_int(p, "top_k", -1, INT32_MAX, &i)) {
        sp->top_k = i < 0 ? 0 : (int32_t)i; /* vLLM: -1 = off */
        sp->set_mask |= TDM_PROTO_SET_TOP_K;
    }
    if (get_int(p, "seed", INT64_MIN, INT64_MAX, &i)) {
        sp->seed = (uint64_t)i;
        sp->has_seed = true;
        sp->set_mask |= TDM_PROTO_SET_SEED;
    }
    if (get_bool(p, "ignore_eos", &b)) {
        sp->ignore_eos = b;
        sp->set_mask |= TDM_PROTO_SET_IGNORE_EOS;
    }
    int rc = parse_stop_token_ids(p, q);
    if (rc == TDM_OK)
        rc = parse_request_masks(p, q);
    return rc != TDM_OK ? rc : oai_parse_logit_bias(q, p->err);
}

static int parse_logprobs(parse_ctx_t *p, oai_req_t *q)
{
    long long k = 0;
    if (q->kind == OAI_COMPLETION) {
        if (get_int(p, "logprobs", 0, OAI_MAX_LOGPROBS, &k)) {
            q->logprobs = true;
            q->top_logprobs = (int)k;
        }
    } else {
        bool on = false;
        get_bool(p, "logprobs", &on);
        bool have_top = get_int(p, "top_logprobs", 0, OAI_MAX_LOGPROBS, &k);
        if (p->rc)
            return p->rc;
        if (have_top && !on && k > 0)
            return tdm_error_set_field(p->err, TDM_EINVALID, "top_logprobs",
                                       "top_logprobs needs logprobs: true");
        q->logprobs = on;
        q->top_logprobs = on ? (int)k : 0;
    }
    if (p->rc)
        return p->rc;
    if (q->logprobs) {
        /* the router reports the sampled token's logprob with n_logprobs >= 1 */
        q->sp.n_logprobs = q->top_logprobs > 0 ? q->top_logprobs : 1;
        q->sp.set_mask |= TDM_PROTO_SET_N_LOGPROBS;
        q->g.echo_token_text = true;
    }
    return TDM_OK;
}

/* n (1..OAI_MAX_CHOICES) and completions' best_of (n..OAI_MAX_CHOICES; not with stream, as
 * vLLM): best_of > n asks the router for the sampled tokens' logprobs to rank the candidates
 * by. After parse_logprobs and oai_tools_parse. */
static int parse_choices(parse_ctx_t *p, oai_req_t *q)
{
    long long n = 1, best = 0;
    get_int(p, "n", LLONG_MIN, LLONG_MAX, &n);
    json_t *bv = field(p->root, "best_of");
    bool best_given = bv && !json_is_null(bv);
    if (best_given && q->kind == OAI_CHAT)
        return tdm_error_set_field(p->err, TDM_EINVALID, "best_of",
                                   "best_of is only supported on /v1/completions");
    if (best_given)
        get_int(p, "best_of", LLONG_MIN, LLONG_MAX, &best);
    if (p->rc)
        return p->rc;
    if (n < 1 || n > OAI_MAX_CHOICES)
        return tdm_error_set_field(p->err, TDM_EINVALID, "n", "n must be from 1 to %d, got %lld",
                                   OAI_MAX_CHOICES, n);
    if (!best_given)
        best = n;
    if (best < n || best > OAI_MAX_CHOICES)
        return tdm_error_set_field(p->err, TDM_EINVALID, "best_of",
                                   "best_of must be from n (%lld) to %d, got %lld", n,
                                   OAI_MAX_CHOICES, best);
    if (best > n && q->stream)
        return tdm_error_set_field(
            p->err, TDM_EINVALID, "best_of",
            "best_of > n is not supported with stream: true (the best are known "
            "only at the end)");
    if (n > 1 && q->tools.parse)
        return tdm_error_set_field(p->err, TDM_EINVALID, "n",
                                   "n > 1 is not supported together with tools");
    q->n = (uint32_t)n;
    q->best_of = (uint32_t)best;
    if (best > n && !q->logprobs) {
        q->sp.n_logprobs = 1; /* the sampled token's logprob, to rank by; not returned */
        q->sp.set_mask |= TDM_PROTO_SET_N_LOGPROBS;
    }
    return TDM_OK;
}

/* chat_template (a string of at most TDM_CHAT_TEMPLATE_MAX_BYTES: the Jinja source used
 * instead of the model's) and chat_template_kwargs (an object of more template variables), as
 * vLLM takes them. The router compiles and renders them (router/validate.c). */
static int parse_chat_template(parse_ctx_t *p, oai_req_t *q)
{
    json_t *t = field(p->root, "chat_template");
    if (t && !json_is_null(t)) {
        if (!json_is_string(t))
            return tdm_error_set_field(p->err, TDM_EINVALID, "chat_template",
                                       "chat_template must be a string (Jinja source), got %s",
                                       oai_type_name(t));
        if (json_string_length(t) > TDM_CHAT_TEMPLATE_MAX_BYTES)
            return tdm_error_set_field(p->err, TDM_EINVALID, "chat_template",
                                       "chat_template has %zu bytes, more than the limit of %d",
                                       json_string_length(t), TDM_CHAT_TEMPLATE_MAX_BYTES);
        if (json_string_length(t) > 0)
            q->chat_template = json_string_value(t);
    }
    json_t *kw = field(p->root, "chat_template_kwargs");
    if (!kw || json_is_null(kw))
        return TDM_OK;
    if (!json_is_object(kw))
        return tdm_error_set_field(p->err, TDM_EINVALID, "chat_template_kwargs",
                                   "chat_template_kwargs must be an object, got %s",
                                   oai_type_name(kw));
    static const char *const reserved[] = {"messages", "tools"};
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (json_object_get(kw, reserved[i]))
            return tdm_error_set_field(p->err, TDM_EINVALID, "chat_template_kwargs",
                                       "chat_template_kwargs.%s: is set by the request's own %s "
                                       "field",
                                       reserved[i], reserved[i]);
    if (json_object_size(kw) == 0)
        return TDM_OK;
    q->chat_template_kwargs = json_dumps(kw, JSON_COMPACT);
    if (!q->chat_template_kwargs)
        return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    return TDM_OK;
}

/* The value of a vLLM field Tandem cannot apply that asks for nothing (so it is accepted). */
typedef enum neutral {
    NEUTRAL_NONE,  /* null, absent, or an empty array/object/string */
    NEUTRAL_FALSE, /* false */
    NEUTRAL_TRUE,  /* true */
    NEUTRAL_ZERO,  /* 0 */
    NEUTRAL_LEFT,  /* "left" (vLLM's truncation side when truncate_prompt_tokens cuts) */
} neutral_t;

#define ON_COMPLETION 1u
#define ON_CHAT 2u

/* vLLM request fields (tests/vllm_request_fields.tsv) that would change the answer and that
 * Tandem cannot do: refused (400 naming the field) unless their value asks for nothing. */
static const struct {
    const char *name;
    unsigned on; /* ON_COMPLETION | ON_CHAT */
    neutral_t neutral;
    const char *why;
} unsupported[] = {
    {"suffix", ON_COMPLETION, NEUTRAL_NONE, "no fill-in-the-middle"},
    {"use_beam_search", ON_COMPLETION | ON_CHAT, NEUTRAL_FALSE, "no beam search"},
    {"watermarking", ON_COMPLETION | ON_CHAT, NEUTRAL_FALSE, "no watermarking"},
    {"skip_special_tokens", ON_COMPLETION | ON_CHAT, NEUTRAL_TRUE,
     "special tokens are always left out of the text"},
    {"truncation_side", ON_COMPLETION | ON_CHAT, NEUTRAL_LEFT,
     "truncate_prompt_tokens keeps the prompt's last tokens"},
    {"logprob_token_ids", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE,
     "logprobs are of the sampled and top tokens only"},
    {"documents", ON_CHAT, NEUTRAL_NONE, "templates are rendered without documents"},
    {"add_special_tokens", ON_CHAT, NEUTRAL_FALSE,
     "a chat prompt's BOS follows the template and the tokenizer"},
    {"add_special_tokens", ON_COMPLETION, NEUTRAL_TRUE,
     "a text prompt's BOS follows the tokenizer"},
    {"prompt_embeds", ON_COMPLETION, NEUTRAL_NONE, "prompts are text or token ids"},
    {"priority", ON_COMPLETION | ON_CHAT, NEUTRAL_ZERO, "no priority scheduling"},
    {"return_tokens_as_token_ids", ON_COMPLETION | ON_CHAT, NEUTRAL_FALSE,
     "logprobs name tokens by their text"},
    {"return_token_ids", ON_COMPLETION | ON_CHAT, NEUTRAL_FALSE, "answers carry no token ids"},
    {"return_weight_versions", ON_COMPLETION | ON_CHAT, NEUTRAL_FALSE, "no weight versions"},
    {"return_prompt_text", ON_CHAT, NEUTRAL_FALSE, "answers carry no prompt text"},
    {"cache_salt", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE,
     "the prefix cache is shared by every request"},
    {"kv_transfer_params", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE,
     "KV transfer is the cluster's own (docs/protocol.md)"},
    {"ec_transfer_params", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE, "no encoder cache"},
    {"vllm_xargs", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE, "no vLLM extensions"},
    {"repetition_detection", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE, "no repetition detection"},
    {"thinking_token_budget", ON_COMPLETION | ON_CHAT, NEUTRAL_NONE, "no thinking budget"},
};

static bool is_neutral(const json_t *v, neutral_t n)
{
    switch (n) {
    case NEUTRAL_NONE:
        return (json_is_array(v) && json_array_size(v) == 0) ||
               (json_is_object(v) && json_object_size(v) == 0) ||
               (json_is_string(v) && json_string_length(v) == 0);
    case NEUTRAL_FALSE: return json_is_false(v);
    case NEUTRAL_TRUE: return json_is_true(v);
    case NEUTRAL_ZERO: return json_is_number(v) && json_number_value(v) == 0;
    case NEUTRAL_LEFT: return json_is_string(v) && strcmp(json_string_value(v), "left") == 0;
    }
    return false;
}

/* Fields Tandem does not implement: refused when they ask for something, so a client never
 * gets a silently different answer (not for /tokenize, whose own add_special_tokens means
 * something else and which generates nothing). */
static int refuse_unsupported(parse_ctx_t *p, oai_req_t *q)
{
    unsigned on = q->kind == OAI_CHAT ? ON_CHAT : ON_COMPLETION;
    for (size_t i = 0; !q->for_tokenize && i < sizeof unsupported / sizeof unsupported[0]; i++) {
        json_t *v = (unsupported[i].on & on) ? field(p->root, unsupported[i].name) : NULL;
        if (v && !is_neutral(v, unsupported[i].neutral)) {
            char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
            tdm_error_set_field(p->err, TDM_EINVALID, unsupported[i].name,
                                "%s: %.40s is not supported (%s)", unsupported[i].name,
                                text ? text : "this value", unsupported[i].why);
            free(text);
            return TDM_EINVALID;
        }
    }
    if (q->kind == OAI_CHAT) {
        int rc = oai_tools_parse(p->root, &q->tools, p->err);
        if (rc != TDM_OK)
            return rc;
        return parse_chat_template(p, q);
    }
    return TDM_OK;
}

/* q->creq, the client library's request, from the GenerateRequest the parser made (strings
 * and arrays point into q). */
static int client_request(oai_req_t *q, tdm_error_t *err)
{
    tdm_client_request_t *c = &q->creq;
    tdm_client_request_init(c);
    c->request_id = q->g.request_id;
    c->model = q->g.model;
    if (q->g.input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT) {
        c->prompt = q->g.prompt;
    } else if (q->g.input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS) {
        c->token_ids = q->tokens.ids;
        c->n_token_ids = q->tokens.n_ids;
    } else {
        size_t n = q->chat.n_messages;
        q->cmsgs = calloc(n ? n : 1, sizeof *q->cmsgs);
        if (!q->cmsgs)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        for (size_t i = 0; i < n; i++)
            q->cmsgs[i] =
                (tdm_chat_message_t){.role = q->chat.messages[i]->role,
                                     .content = q->chat.messages[i]->content,
                                     .tool_calls = q->chat.messages[i]->tool_calls,
                                     .tool_call_id = q->chat.messages[i]->tool_call_id,
                                     .name = q->chat.messages[i]->name,
                                     .reasoning_content = q->chat.messages[i]->reasoning_content};
        c->messages = q->cmsgs;
        c->n_messages = n;
        c->chat_template = q->chat_template;
        c->chat_template_kwargs = q->chat_template_kwargs;
        c->no_generation_prompt = !q->add_generation_prompt;
        c->continue_final_message = q->continue_final_message;
    }
    c->continuous_usage = q->continuous_usage;
    if (tdm_proto_sampling_from(&q->sp, &c->sampling, err) != TDM_OK) {
        /* OpenAI's body has these at its top level: "sampling.X: ..." is said as "X: ..." */
        static const char nest[] = "sampling.";
        char field[TDM_ERRFIELD_MAX], msg[TDM_ERRMSG_MAX];
        bool nested = strncmp(err->field, nest, sizeof nest - 1) == 0;
        snprintf(field, sizeof field, "%s", err->field + (nested ? sizeof nest - 1 : 0));
        snprintf(msg, sizeof msg, "%s",
                 err->msg + (strncmp(err->msg, nest, sizeof nest - 1) == 0 ? sizeof nest - 1 : 0));
        return tdm_error_set_field(err, TDM_EINVALID, field, "%s", msg);
    }
    c->sampling_set = q->sp.set_mask;
    c->max_tokens = q->g.max_tokens;
    c->stop = (const char *const *)q->g.stop;
    c->n_stop = q->g.n_stop;
    c->stream = q->g.stream;
    c->include_stop_str = q->g.include_stop_str;
    c->echo_token_text = q->g.echo_token_text;
    c->n = q->best_of;
    c->no_speculation = q->g.speculative == TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF;
    c->bad_words = q->bad_words;
    c->n_bad_words = q->n_bad_words;
    c->truncate_prompt_tokens = q->g.truncate_prompt_tokens;
    return oai_tools_request(&q->tools, c, err);
}

/* stream, stream_options, include_stop_str_in_output. */
static int parse_stream(parse_ctx_t *p, oai_req_t *q)
{
    get_bool(p, "stream", &q->stream);
    json_t *so = field(q->root, "stream_options");
    if (!p->rc && so) {
        if (!json_is_object(so))
            return tdm_error_set_field(p->err, TDM_EINVALID, "stream_options",
                                       "stream_options must be an object, got %s",
                                       oai_type_name(so));
        if (!q->stream)
            return tdm_error_set_field(p->err, TDM_EINVALID, "stream_options",
                                       "stream_options is only allowed with stream: true");
        json_t *iu = json_object_get(so, "include_usage");
        if (iu && !json_is_null(iu) && !json_is_boolean(iu))
            return tdm_error_set_field(p->err, TDM_EINVALID, "stream_options.include_usage",
                                       "stream_options.include_usage must be a boolean, got %s",
                                       oai_type_name(iu));
        q->include_usage = json_is_true(iu);
        json_t *cu = json_object_get(so, "continuous_usage_stats");
        if (cu && !json_is_null(cu) && !json_is_boolean(cu))
            return tdm_error_set_field(p->err, TDM_EINVALID,
                                       "stream_options.continuous_usage_stats",
                                       "stream_options.continuous_usage_stats must be a boolean, "
                                       "got %s",
                                       oai_type_name(cu));
        /* vLLM: running usage on every chunk only together with include_usage */
        q->continuous_usage = q->include_usage && json_is_true(cu);
        if (q->continuous_usage && !(q->usage_now = calloc(1, sizeof *q->usage_now)))
            return tdm_error_set(p->err, TDM_ERESOURCE, "out of memory");
    }
    q->g.stream = q->stream;
    bool include_stop = false;
    if (get_bool(p, "include_stop_str_in_output", &include_stop))
        q->g.include_stop_str = include_stop;
    return p->rc;
}

/* speculative: "auto" (the decode node's config) or "off" (Tandem's extension; outputs are the
 * same either way, docs/performance.md). */
static int parse_speculative(parse_ctx_t *p, oai_req_t *q)
{
    const char *s = get_string(p, "speculative");
    if (!s || strcmp(s, "auto") == 0)
        return p->rc;
    if (strcmp(s, "off") != 0)
        return tdm_error_set_field(p->err, TDM_EINVALID, "speculative",
                                   "speculative must be \"auto\" or \"off\", got \"%.40s\"", s);
    q->g.speculative = TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF;
    return TDM_OK;
}

/* max_tokens (chat: or max_completion_tokens): completions default to OpenAI's 16; a chat
 * without it sends 0, so the router gives what fits (TDM_ROUTER_MAX_TOKENS_DEFAULT at most). */
static int parse_max_tokens(parse_ctx_t *p, oai_req_t *q)
{
    long long mt = 0;
    const char *name = "max_tokens";
    if (q->kind == OAI_CHAT && field(q->root, "max_completion_tokens"))
        name = "max_completion_tokens";
    bool have = get_int(p, name, LLONG_MIN, LLONG_MAX, &mt);
    if (p->rc)
        return p->rc;
    if (have && (mt < 1 || mt > INT32_MAX))
        return tdm_error_set_field(p->err, TDM_EINVALID, name, "%s must be in 1..%d, got %lld",
                                   name, INT32_MAX, mt);
    if (have)
        q->g.max_tokens = (int32_t)mt;
    else if (q->kind == OAI_COMPLETION)
        q->g.max_tokens = OAI_COMPLETION_DEFAULT_MAX_TOKENS;
    return TDM_OK;
}

/* Chat's add_generation_prompt (default true) and continue_final_message (default false), as
 * vLLM takes them: not both true; continue_final_message needs an assistant message last. After
 * parse_messages. */
static int parse_chat_flags(parse_ctx_t *p, oai_req_t *q)
{
    q->add_generation_prompt = true;
    get_bool(p, "add_generation_prompt", &q->add_generation_prompt);
    get_bool(p, "continue_final_message", &q->continue_final_message);
    if (p->rc)
        return p->rc;
    if (q->continue_final_message && q->add_generation_prompt)
        return tdm_error_set_field(p->err, TDM_EINVALID, "continue_final_message",
                                   "continue_final_message and add_generation_prompt cannot both "
                                   "be true (add_generation_prompt defaults to true: set it to "
                                   "false)");
    size_t last = q->chat.n_messages - 1;
    if (q->continue_final_message && strcmp(q->msgs[last].role, "assistant") != 0)
        return tdm_error_set_field(p->err, TDM_EINVALID, "continue_final_message",
                                   "continue_final_message needs the last message to be an "
                                   "assistant message; messages[%zu] has role \"%.32s\"",
                                   last, q->msgs[last].role);
    return TDM_OK;
}

/* Chat's echo (vLLM): the last message's content goes first in the answer when that message has
 * the answer's role: "assistant", or with add_generation_prompt false the last message's own
 * role (vLLM answers in it), so then always. After parse_chat_flags. */
static int parse_chat_echo(parse_ctx_t *p, oai_req_t *q)
{
    bool echo = false;
    get_bool(p, "echo", &echo);
    if (p->rc || !echo)
        return p->rc;
    const Tandem__V1__ChatMessage *m = &q->msgs[q->chat.n_messages - 1];
    if ((!q->add_generation_prompt || strcmp(m->role, "assistant") == 0) && m->content &&
        m->content[0])
        q->chat_echo = m->content;
    return TDM_OK;
}

/* prompt_logprobs (0..OAI_MAX_LOGPROBS alternatives per prompt token; vLLM's -1, the whole
 * vocabulary, is refused by the range): computed in the prefill pass; refused with stream
 * as vLLM does unless 0 (which then returns nothing, as vLLM's stream does). After
 * client_request. */
static int parse_prompt_logprobs(parse_ctx_t *p, oai_req_t *q)
{
    long long k = 0;
    q->prompt_logprobs = -1;
    bool echo_lp = q->echo && q->logprobs; /* vLLM: the prompt's logprobs head the logprobs */
    if (!get_int(p, "prompt_logprobs", 0, OAI_MAX_LOGPROBS, &k)) {
        if (p->rc || !echo_lp)
            return p->rc;
        q->creq.prompt_logprobs = true;
        q->creq.prompt_logprobs_top = (uint32_t)q->top_logprobs;
        return TDM_OK;
    }
    if (q->stream && k > 0)
        return tdm_error_set_field(p->err, TDM_EINVALID, "prompt_logprobs",
                                   "prompt_logprobs is not available with stream: true");
    if (q->stream)
        return TDM_OK;
    q->prompt_logprobs = (int)k;
    q->creq.prompt_logprobs = true;
    q->creq.prompt_logprobs_top = (uint32_t)(echo_lp && q->top_logprobs > k ? q->top_logprobs : k);
    return TDM_OK;
}

/* Completions' echo: the prompt text goes first in the answer. */
static int parse_echo(parse_ctx_t *p, oai_req_t *q)
{
    bool echo = false;
    get_bool(p, "echo", &echo);
    if (p->rc)
        return p->rc;
    if (echo && q->g.input_case != TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT)
        return tdm_error_set_field(p->err, TDM_EINVALID, "echo", "echo needs a text prompt");
    if (echo && q->n_prompts > 1)
        return tdm_error_set_field(p->err, TDM_EINVALID, "echo",
                                   "echo with a list of prompts is not supported");
    if (echo && q->logprobs && q->stream)
        return tdm_error_set_field(p->err, TDM_EINVALID, "echo",
                                   "echo with logprobs is not supported with stream: true (the "
                                   "prompt's logprobs are not streamed)");
    if (echo && q->g.truncate_prompt_tokens != 0) /* the echo would not be the prompt used */
        return tdm_error_set_field(p->err, TDM_EINVALID, "echo",
                                   "echo with truncate_prompt_tokens is not supported");
    if (echo)
        q->echo = q->g.prompt;
    return TDM_OK;
}

/* The body as a JSON object in q->root. */
static int parse_body(const char *body, size_t len, oai_req_t *q, tdm_error_t *err)
{
    if (len == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "",
                                   "the request body is empty; send a JSON object");
    json_error_t jerr;
    q->root = json_loadb(body, len, 0, &jerr);
    if (!q->root && json_error_code(&jerr) == json_error_null_character)
        return tdm_error_set_field(
            err, TDM_EINVALID, "",
            "a string of the body holds \\u0000 (line %d, column %d): prompts, "
            "messages and stop strings cannot contain NUL characters",
            jerr.line, jerr.column);
    if (!q->root)
        return tdm_error_set_field(err, TDM_EINVALID, "",
                                   "the body is not valid JSON: %s (line %d, column %d)", jerr.text,
                                   jerr.line, jerr.column);
    if (!json_is_object(q->root))
        return tdm_error_set_field(err, TDM_EINVALID, "", "the body must be a JSON object, got %s",
                                   oai_type_name(q->root));
    return TDM_OK;
}

/* model (echoed as the served one when absent), the response id, created. */
static int parse_identity(parse_ctx_t *p, oai_req_t *q, const char *served)
{
    const char *model = get_string(p, "model");
    (void)get_string(p, "user"); /* OpenAI's end-user id: not used, but a string */
    if (p->rc)
        return p->rc;
    snprintf(q->model, sizeof q->model, "%s", model ? model : (served ? served : ""));
    q->g.model = model ? (char *)model : (char *)"";
    make_id(q->id, sizeof q->id, q->kind == OAI_CHAT ? "chatcmpl-" : "cmpl-");
    q->g.request_id = q->id;
    q->created = (long long)time(NULL);
    return TDM_OK;
}

static int parse_all(oai_kind_t kind, bool for_tokenize, const char *body, size_t len,
                     const char *served, oai_req_t *q, tdm_error_t *err);

int oai_parse(oai_kind_t kind, const char *body, size_t len, const char *served, oai_req_t *q,
              tdm_error_t *err)
{
    return parse_all(kind, false, body, len, served, q, err);
}

int oai_parse_tokenize(const char *body, size_t len, const char *served, oai_req_t *q,
                       tdm_error_t *err)
{
    return parse_all(OAI_CHAT, true, body, len, served, q, err);
}

static int parse_all(oai_kind_t kind, bool for_tokenize, const char *body, size_t len,
                     const char *served, oai_req_t *q, tdm_error_t *err)
{
    memset(q, 0, sizeof *q);
    q->kind = kind;
    q->for_tokenize = for_tokenize;
    tandem__v1__generate_request__init(&q->g);
    tandem__v1__sampling_params__init(&q->sp);
    tandem__v1__chat_list__init(&q->chat);
    tandem__v1__token_list__init(&q->tokens);
    q->g.sampling = &q->sp;
    q->n_prompts = 1;
    int rc = parse_body(body, len, q, err);
    parse_ctx_t p = {q->root, err, 0};
    if (rc != TDM_OK || (rc = parse_identity(&p, q, served)) != TDM_OK ||
        (rc = refuse_unsupported(&p, q)) != TDM_OK || (rc = parse_stream(&p, q)) != TDM_OK ||
        (rc = parse_speculative(&p, q)) != TDM_OK || (rc = parse_max_tokens(&p, q)) != TDM_OK ||
        (rc = parse_sampling(&p, q)) != TDM_OK || (rc = parse_stop(&p, q)) != TDM_OK ||
        (rc = parse_logprobs(&p, q)) != TDM_OK || (rc = parse_choices(&p, q)) != TDM_OK ||
        (rc = kind == OAI_CHAT ? parse_messages(&p, q) : parse_prompt(&p, q)) != TDM_OK ||
        (kind == OAI_COMPLETION && (rc = parse_echo(&p, q)) != TDM_OK) ||
        (kind == OAI_CHAT &&
         ((rc = parse_chat_flags(&p, q)) != TDM_OK || (rc = parse_chat_echo(&p, q)) != TDM_OK)) ||
        (rc = client_request(q, err)) != TDM_OK || (rc = oai_parse_structured(q, err)) != TDM_OK ||
        (rc = parse_prompt_logprobs(&p, q)) != TDM_OK) {
        oai_req_clear(q);
        return rc;
    }
    return TDM_OK;
}

void oai_req_clear(oai_req_t *q)
{
    if (!q)
        return;
    if (q->joined)
        for (size_t i = 0; i < q->chat.n_messages; i++)
            free(q->joined[i]);
    free(q->joined);
    free(q->msgs);
    free(q->msg_ptr);
    free(q->ids);
    free(q->stop);
    free(q->stop_ids);
    free(q->bias);
    free(q->allowed_ids);
    free(q->bad_words);
    free(q->cmsgs);
    for (size_t i = 0; q->list_ids && i < q->n_prompts; i++)
        free(q->list_ids[i]);
    free(q->list_ids);
    free(q->list_n_ids);
    free(q->list_rids);
    if (q->creqs != &q->creq)
        free(q->creqs);
    oai_tools_clear(&q->tools);
    free(q->chat_template_kwargs);
    free(q->constraint_text);
    free(q->usage_now);
    free(q->reason_grammar);
    if (q->root)
        json_decref(q->root);
    memset(q, 0, sizeof *q);
}

int oai_prompt_requests(oai_req_t *q)
{
    if (q->n_prompts <= 1) {
        q->creqs = &q->creq;
        return TDM_OK;
    }
    q->creqs = calloc(q->n_prompts, sizeof *q->creqs);
    q->list_rids = calloc(q->n_prompts, sizeof *q->list_rids);
    if (!q->creqs || !q->list_rids)
        return TDM_ERESOURCE;
    json_t *list = json_object_get(q->root, "prompt");
    const char *id = q->creq.request_id ? q->creq.request_id : "";
    for (size_t i = 0; i < q->n_prompts; i++) {
        tdm_client_request_t *c = &q->creqs[i];
        *c = q->creq;
        json_t *e = json_array_get(list, i);
        c->prompt = json_is_string(e) ? json_string_value(e) : NULL;
        c->token_ids = q->list_ids[i];
        c->n_token_ids = q->list_n_ids[i];
        if (i > 0) {
            snprintf(q->list_rids[i], sizeof q->list_rids[i], "%.*s-%zu",
                     (int)(TDM_REQUEST_ID_MAX - 4), id, i);
            c->request_id = q->list_rids[i];
        }
    }
    return TDM_OK;
}

void oai_req_unref(void *q)
{
    oai_req_t *r = q;
    if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0)
        oai_req_destroy(q);
}

void oai_req_destroy(void *q)
{
    oai_req_clear(q);
    free(q);
}
