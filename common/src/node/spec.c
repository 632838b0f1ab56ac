/* spec.c - the one check of a task's SequenceSpec, shared by the prefill and decode nodes (a
 * node refuses what its peer would refuse, with the same message), and the attempt identity and
 * constraint a task brings. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "tandem/node_spec.h"

/* Sampling parameters of a task: defaults, then the message's fields (set_mask), then
 * max_tokens; validated against n_vocab. TDM_EINVALID naming the field otherwise. m may be
 * NULL (defaults). */
static int sampling_of(const Tandem__V1__SamplingParams *m, int32_t max_tokens, uint32_t n_vocab,
                       tdm_sampling_params_t *out, tdm_error_t *err)
{
    tdm_sampling_params_default(out);
    if (m && tdm_proto_sampling_from(m, out, err) != TDM_OK)
        return TDM_EINVALID;
    if (max_tokens < 1)
        return tdm_error_set(err, TDM_EINVALID, "max_tokens must be >= 1, got %d", max_tokens);
    out->max_tokens = max_tokens;
    return tdm_sampling_params_validate(out, n_vocab, err);
}

int tdm_node_constraint(tdm_grammar_cache_t *cache, const Tandem__V1__Constraint *c,
                        const tdm_grammar_t **g, tdm_error_t *err)
{
    *g = NULL;
    if (!c || c->kind == TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_NONE)
        return TDM_OK;
    if (c->kind != TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR)
        return tdm_error_set(err, TDM_EINVALID,
                             "constraint: kind %d; the router sends nodes GRAMMAR only", c->kind);
    size_t len = c->text ? strlen(c->text) : 0;
    if (len == 0 || len > TDM_GRAMMAR_MAX_TEXT_BYTES)
        return tdm_error_set(err, TDM_EINVALID, "constraint: the grammar has %zu bytes; 1..%u", len,
                             TDM_GRAMMAR_MAX_TEXT_BYTES);
    int rc = tdm_grammar_cache_get(cache, c->text, len, c->hash, g, err);
    if (rc != TDM_OK && err && strncmp(err->msg, "constraint", 10) != 0)
        tdm_error_prefix(err, rc, "constraint: ");
    return rc;
}

int tdm_node_spec_attempt(const Tandem__V1__SequenceSpec *spec, uint64_t router_instance,
                          tdm_node_attempt_t *a, tdm_error_t *err)
{
    memset(a, 0, sizeof *a);
    if (!spec)
        return tdm_error_set(err, TDM_EINVALID, "spec: missing");
    const char *request_id = spec->request_id;
    uint64_t attempt_id = spec->attempt_id;
    size_t len = request_id ? strlen(request_id) : 0;
    if (len == 0 || len >= sizeof a->label)
        return tdm_error_set(err, TDM_EINVALID, "request_id: missing or longer than %zu bytes",
                             sizeof a->label - 1);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)request_id[i] < 0x20 || (unsigned char)request_id[i] > 0x7e)
            return tdm_error_set(err, TDM_EINVALID,
                                 "request_id: byte %zu is 0x%02x; printable ASCII only", i,
                                 (unsigned char)request_id[i]);
    if (attempt_id == 0)
        return tdm_error_set(err, TDM_EINVALID, "attempt_id is 0");
    memcpy(a->label, request_id, len + 1);
    a->attempt_id = attempt_id;
    a->router_instance = router_instance;
    snprintf(a->key, sizeof a->key, "%016" PRIx64, attempt_id);
    return TDM_OK;
}

/* TDM_EINVALID naming what[i] when a token of ids[n] is outside the vocabulary, else 0. */
static int check_tokens(const char *what, const int32_t *ids, size_t n, uint32_t n_vocab,
                        tdm_error_t *err)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= n_vocab)
            return tdm_error_set(err, TDM_EINVALID,
                                 "%s[%zu]: token id %d is outside the vocabulary [0, %u)", what, i,
                                 ids[i], n_vocab);
    return TDM_OK;
}

int tdm_node_spec_check(const Tandem__V1__SequenceSpec *spec, uint32_t n_ctx, uint32_t n_vocab,
                        tdm_sampling_params_t *sp, tdm_error_t *err)
{
    if (!spec)
        return tdm_error_set(err, TDM_EINVALID, "spec: missing");
    size_t n_prompt = spec->n_prompt_tokens, n_output = spec->n_output_tokens;
    if (n_prompt == 0 || n_prompt + 1 > n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt_tokens: %zu tokens; 1..%u fit the context of %u tokens",
                             n_prompt, n_ctx - 1, n_ctx);
    if (check_tokens("prompt_tokens", spec->prompt_tokens, n_prompt, n_vocab, err) != TDM_OK)
        return TDM_EINVALID;
    if (sampling_of(spec->sampling, spec->max_tokens, n_vocab, sp, err) != TDM_OK)
        return TDM_EINVALID;
    if (spec->prompt_logprobs && (spec->prompt_logprobs->top > TDM_SAMPLING_MAX_LOGPROBS ||
                                  spec->prompt_logprobs->top > n_vocab))
        return tdm_error_set(err, TDM_EINVALID, "prompt_logprobs.top: %u; at most %d",
                             spec->prompt_logprobs->top, TDM_SAMPLING_MAX_LOGPROBS);
    /* a migrated request: the output it resumes after is context, and output for max_tokens */
    if (n_prompt + n_output + 1 > n_ctx || n_output >= (size_t)spec->max_tokens)
        return tdm_error_set(err, TDM_EINVALID,
                             "output_tokens: %zu tokens after a prompt of %zu; the context holds "
                             "%u and max_tokens is %d",
                             n_output, n_prompt, n_ctx, spec->max_tokens);
    return check_tokens("output_tokens", spec->output_tokens, n_output, n_vocab, err);
}
