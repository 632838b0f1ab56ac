/* http_logit_bias.c - OpenAI's logit_bias field ({"<token id>": bias, ...}) into the
 * GenerateRequest's SamplingParams.logit_bias.
 *
 * The gateway checks what it can without the model: the shape, each key a token id written
 * in decimal, each bias a number in [-100, 100], one entry per token id, at most
 * TDM_SAMPLING_MAX_LOGIT_BIAS (300, OpenAI's limit) entries; it does so with the sampler's own
 * tdm_sampling_logit_bias_add. The router checks the ids against the vocabulary and names a
 * bad one as sampling.logit_bias["<id>"], which the gateway maps back to logit_bias["<id>"].
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"
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

int oai_parse_logit_bias(oai_req_t *q, char *param, size_t param_cap, tdm_error_t *err)
{
    json_t *v = json_object_get(q->root, "logit_bias");
    if (!v || json_is_null(v))
        return TDM_OK;
    if (!json_is_object(v))
        return oai_bad_field(err, param, param_cap, "logit_bias",
                             "logit_bias must be an object mapping token ids (as strings) to "
                             "biases in [-100, 100]");
    if (json_object_size(v) > TDM_SAMPLING_MAX_LOGIT_BIAS)
        return oai_bad_field(err, param, param_cap, "logit_bias",
                             "logit_bias has %zu entries, at most %d", json_object_size(v),
                             TDM_SAMPLING_MAX_LOGIT_BIAS);
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
            return oai_bad_field(err, param, param_cap, name,
                                 "%s: the key must be a token id (a decimal integer in [0, %d])",
                                 name, INT32_MAX);
        if (!json_is_number(bias))
            return oai_bad_field(err, param, param_cap, name, "%s must be a number in [-100, 100]",
                                 name);
        double d = json_number_value(bias);
        if (!(d >= -TDM_SAMPLING_MAX_BIAS && d <= TDM_SAMPLING_MAX_BIAS))
            return oai_bad_field(err, param, param_cap, name, "%s must be in [-100, 100], got %g",
                                 name, d);
        if (tdm_sampling_logit_bias_add(&sp, (int32_t)token, (float)d, err) != TDM_OK)
            return oai_bad_field(err, param, param_cap, name, "%s: %s", name, err->msg);
    }
    return bias_store(q, &sp, err);
}
