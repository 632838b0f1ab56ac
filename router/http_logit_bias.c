/* http_logit_bias.c - OpenAI's logit_bias field ({"<token id>": bias, ...}) into the
 * GenerateRequest's SamplingParams.logit_bias.
 *
 * The gateway checks what it can without the model: the shape, each key a token id written
 * in decimal, each bias a number in [-100, 100], one entry per token id, at most
 * TDM_SAMPLING_MAX_LOGIT_BIAS (300, OpenAI's limit) entries; it does so with the sampler's own
 * tdm_sampling_logit_bias_add. The router checks the ids against the vocabulary and names a
 * bad one as sampling.logit_bias["<id>"], which the gateway maps back to logit_bias["<id>"].
 * Messages read as the other fields' do: the entry, the limit, what was given
 * (logit_bias["5"] must be in [-100, 100], got 100.5).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_openai.h"
#include "tandem/sampling.h"

/* The token id a logit_bias key names: decimal digits only (leading zeros allowed, as
 * Python's int() in vLLM does), at most INT32_MAX. -1 when the key is not one. */
static long long key_token(const char *key)
{
    if (!key[0] || strspn(key, "0123456789") != strlen(key))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(key, NULL, 10);
    return errno || v > INT32_MAX ? -1 : (long long)v;
}

/* Whether sp's logit bias (sorted by token id) has an entry for token. O(log n). */
static bool bias_has(const tdm_sampling_params_t *sp, int32_t token)
{
    size_t lo = 0, hi = sp->n_logit_bias;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (sp->logit_bias[mid].token < token)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < sp->n_logit_bias && sp->logit_bias[lo].token == token;
}

/* q->sp.logit_bias from the entries of sp (sorted, unique), in one block that q owns. */
static int bias_store(oai_req_t *q, const tdm_sampling_params_t *sp, tdm_error_t *err)
{
    size_t n = sp->n_logit_bias;
    if (n == 0)
        return TDM_OK;
    q->bias = malloc(n * (sizeof *q->bias + sizeof **q->bias));
    if (!q->bias)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    Tandem__V1__LogitBias *m = (Tandem__V1__LogitBias *)(q->bias + n);
    for (size_t i = 0; i < n; i++) {
        tandem__v1__logit_bias__init(&m[i]);
        m[i].token_id = sp->logit_bias[i].token;
        m[i].bias = sp->logit_bias[i].bias;
        q->bias[i] = &m[i];
    }
    q->sp.logit_bias = q->bias;
    q->sp.n_logit_bias = n;
    q->sp.set_mask |= TDM_PROTO_SET_LOGIT_BIAS;
    return TDM_OK;
}

int oai_parse_logit_bias(oai_req_t *q, tdm_error_t *err)
{
    json_t *v = json_object_get(q->root, "logit_bias");
    if (!v || json_is_null(v))
        return TDM_OK;
    if (!json_is_object(v))
        return tdm_error_set_field(err, TDM_EINVALID, "logit_bias",
                                   "logit_bias must be an object mapping token ids (as strings) to "
                                   "biases in [-100, 100], got %s",
                                   oai_type_name(v));
    if (json_object_size(v) > TDM_SAMPLING_MAX_LOGIT_BIAS)
        return tdm_error_set_field(err, TDM_EINVALID, "logit_bias",
                                   "logit_bias must have at most %d entries, got %zu",
                                   TDM_SAMPLING_MAX_LOGIT_BIAS, json_object_size(v));
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    const char *key;
    json_t *bias;
    json_object_foreach(v, key, bias)
    {
        char name[48];
        snprintf(name, sizeof name, "logit_bias[\"%.24s\"]", key);
        long long token = key_token(key);
        if (token < 0)
            return tdm_error_set_field(
                err, TDM_EINVALID, name,
                "%s: the key must be a token id (a decimal integer in [0, %d]), "
                "got \"%.24s\"",
                name, INT32_MAX, key);
        if (!json_is_number(bias))
            return tdm_error_set_field(err, TDM_EINVALID, name,
                                       "%s must be a number in [-100, 100], got %s", name,
                                       oai_type_name(bias));
        double d = json_number_value(bias);
        if (!(d >= -TDM_SAMPLING_MAX_BIAS && d <= TDM_SAMPLING_MAX_BIAS))
            return tdm_error_set_field(err, TDM_EINVALID, name, "%s must be in [-100, 100], got %g",
                                       name, d);
        if (bias_has(&sp, (int32_t)token)) /* "5" and "05": the key as the client wrote it */
            return tdm_error_set_field(err, TDM_EINVALID, name,
                                       "%s: each token id must appear once, got %lld twice", name,
                                       token);
        if (tdm_sampling_logit_bias_add(&sp, (int32_t)token, (float)d, err) != TDM_OK)
            return tdm_error_set_field(err, TDM_EINVALID, name, "%s", err->msg);
    }
    return bias_store(q, &sp, err);
}
