/* hparams_moe.c - the mixture-of-experts hyperparameters and tensors of a GGUF model.
 *
 * As llama.cpp reads them (src/llama-model.cpp, src/models/qwen3moe.cpp, src/models/llama.cpp):
 * `<arch>.expert_count` experts per layer, `<arch>.expert_used_count` of them per token; the
 * router `blk.N.ffn_gate_inp.weight` [n_embd, n_expert] and the experts stacked in 3-D tensors
 * `blk.N.ffn_{gate,up}_exps.weight` [n_embd, n_ff_exp, n_expert] and
 * `blk.N.ffn_down_exps.weight` [n_ff_exp, n_embd, n_expert] (ggml order: ne[0] is the input of
 * a projection, ne[2] the expert). qwen3moe always has experts, an expert's hidden size is
 * `expert_feed_forward_length` (else n_ff / n_expert_used, as the reference defaults it); a
 * `llama` file with experts (Mixtral) uses `feed_forward_length` for them. Other architectures
 * keep refusing expert keys and tensors (hparams_refuse.c).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "gguf/hparams_internal.h"

bool tdm_gguf_arch_has_experts(const char *arch)
{
    return strcmp(arch, "llama") == 0 || strcmp(arch, "qwen3moe") == 0;
}

/* <arch>.suffix as u32 into *out; *found tells whether it is present. */
static int get_count(const tdm_gguf_t *g, const char *arch, const char *suffix, uint32_t *out,
                     bool *found, tdm_error_t *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    *out = 0;
    int rc = tdm_gguf_get_u32(g, key, out, err);
    *found = rc == TDM_OK;
    if (rc == TDM_ENOTFOUND) {
        tdm_error_clear(err);
        return TDM_OK;
    }
    return rc;
}

int tdm_gguf_hparams_moe(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    const char *a = hp->arch;
    if (!tdm_gguf_arch_has_experts(a))
        return TDM_OK; /* a non-zero count is refused by tdm_gguf_refuse_unimplemented */
    bool qwen = strcmp(a, "qwen3moe") == 0, has_count, has_used, has_ff;
    int rc;
    if ((rc = get_count(g, a, "expert_count", &hp->n_expert, &has_count, err)) ||
        (rc = get_count(g, a, "expert_used_count", &hp->n_expert_used, &has_used, err)))
        return rc;
    if (hp->n_expert == 0) {
        if (qwen)
            return tdm_error_set(err, has_count ? TDM_EINVALID : TDM_ENOTFOUND,
                                 "metadata '%s.expert_count' is %s: a qwen3moe model needs "
                                 "experts (1..%d)",
                                 a, has_count ? "0" : "missing", TDM_GGUF_MAX_EXPERTS);
        if (hp->n_expert_used != 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "metadata '%s.expert_used_count' is %" PRIu32
                                 " but %s.expert_count is 0 or missing",
                                 a, hp->n_expert_used, a);
        return TDM_OK;
    }
    if (hp->n_expert > TDM_GGUF_MAX_EXPERTS)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s.expert_count' is %" PRIu32 ", more than %d experts", a,
                             hp->n_expert, TDM_GGUF_MAX_EXPERTS);
    if (!has_used)
        return tdm_error_set(err, TDM_ENOTFOUND,
                             "metadata '%s.expert_used_count' is missing (needed with "
                             "%s.expert_count %" PRIu32 ")",
                             a, a, hp->n_expert);
    if (hp->n_expert_used == 0 || hp->n_expert_used > hp->n_expert)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s.expert_used_count' must be in 1..%s.expert_count "
                             "(%" PRIu32 "), got %" PRIu32,
                             a, a, hp->n_expert, hp->n_expert_used);
    hp->n_ff_exp = hp->n_ff;
    if (qwen) {
        if ((rc = get_count(g, a, "expert_feed_forward_length", &hp->n_ff_exp, &has_ff, err)))
            return rc;
        if (!has_ff)
            hp->n_ff_exp = hp->n_ff / hp->n_expert_used;
    }
    if (hp->n_ff_exp == 0)
        return tdm_error_set(err, TDM_EINVALID, "metadata '%s.%s' gives experts a hidden size of 0",
                             a,
                             qwen && has_ff ? "expert_feed_forward_length" : "feed_forward_length");
    return TDM_OK;
}

/* Tensor name of layer l exists with ne = {ne0, ne1, ne2, 1} and a type Tandem computes with. */
static int check_tensor3(const tdm_gguf_t *g, const char *name, uint64_t ne0, uint64_t ne1,
                         uint64_t ne2, tdm_error_t *err)
{
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, name);
    if (!t)
        return tdm_error_set(err, TDM_ENOTFOUND, "tensor '%s' is missing", name);
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1)
        return tdm_error_set(err, TDM_EINVALID,
                             "tensor '%s' has shape [%" PRIu64 ", %" PRIu64 ", %" PRIu64
                             ", %" PRIu64 "], expected [%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]",
                             name, t->ne[0], t->ne[1], t->ne[2], t->ne[3], ne0, ne1, ne2);
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(t->type);
    if (!ti || !ti->supported)
        return tdm_error_set(err, TDM_EINVALID,
                             "tensor '%s' has type %s, which Tandem cannot compute with", name,
                             ti ? ti->name : "?");
    return TDM_OK;
}

int tdm_gguf_check_moe_layer(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, uint32_t l,
                             tdm_error_t *err)
{
    const uint64_t E = hp->n_embd, F = hp->n_ff_exp, X = hp->n_expert;
    const struct {
        const char *suffix;
        uint64_t ne0, ne1, ne2;
    } ts[] = {
        {"ffn_gate_inp.weight", E, X, 1},
        {"ffn_gate_exps.weight", E, F, X},
        {"ffn_up_exps.weight", E, F, X},
        {"ffn_down_exps.weight", F, E, X},
    };
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        char name[96];
        snprintf(name, sizeof name, "blk.%" PRIu32 ".%s", l, ts[i].suffix);
        int rc = check_tensor3(g, name, ts[i].ne0, ts[i].ne1, ts[i].ne2, err);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}
