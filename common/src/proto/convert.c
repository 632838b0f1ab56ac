/* convert.c - conversions between proto/tandem.proto messages and Tandem's C structs. */
#include <stdlib.h>
#include <string.h>

#include "tandem/proto.h"

/* p->logit_bias as LogitBias messages in out's storage. */
static void logit_bias_to(const tdm_sampling_params_t *p, tdm_proto_sampling_t *out)
{
    uint32_t n = p->n_logit_bias < TDM_SAMPLING_MAX_LOGIT_BIAS ? p->n_logit_bias
                                                               : TDM_SAMPLING_MAX_LOGIT_BIAS;
    for (uint32_t i = 0; i < n; i++) {
        tandem__v1__logit_bias__init(&out->bias[i]);
        out->bias[i].token_id = p->logit_bias[i].token;
        out->bias[i].bias = p->logit_bias[i].bias;
        out->bias_ptr[i] = &out->bias[i];
    }
    out->m.n_logit_bias = n;
    out->m.logit_bias = n ? out->bias_ptr : NULL;
}

void tdm_proto_sampling_to(const tdm_sampling_params_t *p, tdm_proto_sampling_t *out)
{
    Tandem__V1__SamplingParams *m = &out->m;
    tandem__v1__sampling_params__init(m);
    m->temperature = p->temperature;
    m->top_k = p->top_k;
    m->top_p = p->top_p;
    m->min_p = p->min_p;
    m->repetition_penalty = p->repetition_penalty;
    m->presence_penalty = p->presence_penalty;
    m->frequency_penalty = p->frequency_penalty;
    m->penalty_last_n = p->penalty_last_n;
    m->seed = p->seed;
    m->has_seed = true;
    m->n_stop_token_ids = p->n_stop_token_ids;
    /* protobuf-c's repeated int32 is int32_t *; the source is const only by our contract. */
    m->stop_token_ids = (int32_t *)(uintptr_t)p->stop_token_ids;
    m->ignore_eos = p->ignore_eos;
    m->n_logprobs = p->n_logprobs;
    logit_bias_to(p, out);
    m->min_tokens = p->min_tokens;
    uint32_t n_seqs =
        p->n_bad_seqs < TDM_SAMPLING_MAX_BAD_SEQS ? p->n_bad_seqs : TDM_SAMPLING_MAX_BAD_SEQS;
    uint32_t start = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        uint32_t end = p->bad_end[i] < TDM_SAMPLING_MAX_BAD_TOKENS ? p->bad_end[i]
                                                                   : TDM_SAMPLING_MAX_BAD_TOKENS;
        tandem__v1__bad_word__init(&out->bad[i]);
        out->bad[i].n_ids = end > start ? end - start : 0;
        out->bad[i].ids = (int32_t *)(uintptr_t)&p->bad_tokens[start];
        out->bad_ptr[i] = &out->bad[i];
        start = end > start ? end : start;
    }
    m->n_bad_words = n_seqs;
    m->bad_words = n_seqs ? out->bad_ptr : NULL;
    m->n_allowed_token_ids =
        p->n_allowed < TDM_SAMPLING_MAX_ALLOWED ? p->n_allowed : TDM_SAMPLING_MAX_ALLOWED;
    m->allowed_token_ids = (int32_t *)(uintptr_t)p->allowed;
    m->set_mask = 0xffffffffu;
}

/* qsort order of logit_bias entries: by token id. */
static int bias_cmp(const void *a, const void *b)
{
    int32_t x = ((const tdm_logit_bias_t *)a)->token, y = ((const tdm_logit_bias_t *)b)->token;
    return (x > y) - (x < y);
}

/* m's logit_bias (at most TDM_SAMPLING_MAX_LOGIT_BIAS entries: checked) into p, sorted by
 * token id. */
static void logit_bias_from(const Tandem__V1__SamplingParams *m, tdm_sampling_params_t *p)
{
    for (size_t i = 0; i < m->n_logit_bias; i++) {
        const Tandem__V1__LogitBias *b = m->logit_bias[i];
        p->logit_bias[i] = (tdm_logit_bias_t){.token = b->token_id, .bias = b->bias};
    }
    p->n_logit_bias = (uint32_t)m->n_logit_bias;
    qsort(p->logit_bias, p->n_logit_bias, sizeof p->logit_bias[0], bias_cmp);
}

int tdm_proto_sampling_from(const Tandem__V1__SamplingParams *m, tdm_sampling_params_t *p,
                            tdm_error_t *err)
{
    uint32_t set = m->set_mask;
    if (m->n_stop_token_ids > TDM_SAMPLING_MAX_STOP)
        return tdm_error_set_field(err, TDM_EINVALID, "sampling.stop_token_ids",
                                   "sampling.stop_token_ids: %zu ids given, at most %d allowed",
                                   m->n_stop_token_ids, TDM_SAMPLING_MAX_STOP);
    if ((set & TDM_PROTO_SET_LOGIT_BIAS) && m->n_logit_bias > TDM_SAMPLING_MAX_LOGIT_BIAS)
        return tdm_error_set_field(err, TDM_EINVALID, "sampling.logit_bias",
                                   "sampling.logit_bias: %zu entries given, at most %d allowed",
                                   m->n_logit_bias, TDM_SAMPLING_MAX_LOGIT_BIAS);
    if (set & TDM_PROTO_SET_TEMPERATURE)
        p->temperature = m->temperature;
    if (set & TDM_PROTO_SET_TOP_K)
        p->top_k = m->top_k;
    if (set & TDM_PROTO_SET_TOP_P)
        p->top_p = m->top_p;
    if (set & TDM_PROTO_SET_MIN_P)
        p->min_p = m->min_p;
    if (set & TDM_PROTO_SET_REPETITION_PENALTY)
        p->repetition_penalty = m->repetition_penalty;
    if (set & TDM_PROTO_SET_PRESENCE_PENALTY)
        p->presence_penalty = m->presence_penalty;
    if (set & TDM_PROTO_SET_FREQUENCY_PENALTY)
        p->frequency_penalty = m->frequency_penalty;
    if (set & TDM_PROTO_SET_PENALTY_LAST_N)
        p->penalty_last_n = m->penalty_last_n;
    if ((set & TDM_PROTO_SET_SEED) || m->has_seed)
        p->seed = m->seed;
    if (set & TDM_PROTO_SET_STOP_TOKEN_IDS) {
        p->n_stop_token_ids = (uint32_t)m->n_stop_token_ids;
        if (m->n_stop_token_ids)
            memcpy(p->stop_token_ids, m->stop_token_ids,
                   m->n_stop_token_ids * sizeof(p->stop_token_ids[0]));
    }
    if (set & TDM_PROTO_SET_IGNORE_EOS)
        p->ignore_eos = m->ignore_eos;
    if (set & TDM_PROTO_SET_N_LOGPROBS)
        p->n_logprobs = m->n_logprobs;
    if (set & TDM_PROTO_SET_LOGIT_BIAS)
        logit_bias_from(m, p);
    if (set & TDM_PROTO_SET_MIN_TOKENS)
        p->min_tokens = m->min_tokens;
    if (set & TDM_PROTO_SET_ALLOWED_TOKEN_IDS) {
        if (m->n_allowed_token_ids > TDM_SAMPLING_MAX_ALLOWED)
            return tdm_error_set_field(err, TDM_EINVALID, "sampling.allowed_token_ids",
                                       "sampling.allowed_token_ids: %zu ids given, at most %d "
                                       "allowed",
                                       m->n_allowed_token_ids, TDM_SAMPLING_MAX_ALLOWED);
        p->n_allowed = (uint32_t)m->n_allowed_token_ids;
        if (m->n_allowed_token_ids)
            memcpy(p->allowed, m->allowed_token_ids, m->n_allowed_token_ids * sizeof *p->allowed);
    }
    if (set & TDM_PROTO_SET_BAD_WORDS) {
        p->n_bad_seqs = 0;
        for (size_t i = 0; i < m->n_bad_words; i++) {
            const Tandem__V1__BadWord *b = m->bad_words[i];
            bool text = b->text && b->text[0];
            if (text && b->n_ids > 0) {
                tdm_error_set(err, TDM_EINVALID,
                              "sampling.bad_words[%zu]: give a word (text) or a token sequence "
                              "(ids), not both",
                              i);
                return tdm_error_field(err, "sampling.bad_words[%zu]", i);
            }
            if (text)
                continue; /* a word: the router's to tokenize */
            if (b->n_ids > UINT32_MAX ||
                tdm_sampling_bad_seq_add(p, b->ids, (uint32_t)b->n_ids, err) != TDM_OK) {
                tdm_error_set(err, TDM_EINVALID,
                              "sampling.bad_words[%zu]: %zu token ids; at most %d sequences of "
                              "1..%d ids in all",
                              i, b->n_ids, TDM_SAMPLING_MAX_BAD_SEQS, TDM_SAMPLING_MAX_BAD_TOKENS);
                return tdm_error_field(err, "sampling.bad_words[%zu]", i);
            }
        }
    }
    return 0;
}

void tdm_proto_layout_to(const tdm_kv_layout_t *l, Tandem__V1__KvLayout *m)
{
    tandem__v1__kv_layout__init(m);
    m->n_layers = l->n_layers;
    m->n_kv_heads = l->n_kv_heads;
    m->head_dim = l->head_dim;
    m->block_size = l->block_size;
    m->dtype = (Tandem__V1__KvDtype)l->dtype;
}

int tdm_proto_layout_from(const Tandem__V1__KvLayout *m, tdm_kv_layout_t *l, tdm_error_t *err)
{
    if (m->dtype != TANDEM__V1__KV_DTYPE__KV_DTYPE_F32 &&
        m->dtype != TANDEM__V1__KV_DTYPE__KV_DTYPE_F16 &&
        m->dtype != TANDEM__V1__KV_DTYPE__KV_DTYPE_Q8)
        return tdm_error_set(err, TDM_EINVALID, "layout.dtype: unknown value %d", (int)m->dtype);
    l->n_layers = m->n_layers;
    l->n_kv_heads = m->n_kv_heads;
    l->head_dim = m->head_dim;
    l->block_size = m->block_size;
    l->dtype = (tdm_kv_dtype_t)m->dtype;
    return 0;
}

const char *tdm_proto_finish_name(int reason)
{
    switch (reason) {
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED: return "none";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return "cancelled";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "?";
    }
}
