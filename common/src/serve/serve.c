/* serve.c - the served model: model, tokenizer and the values the router and the nodes
 * compare at registration, derived in one place (serve.h). */
#include "tandem/serve.h"

#include <inttypes.h>
#include <string.h>

int tdm_served_model_open(tdm_served_model_t *sm, const tdm_config_t *cfg, tdm_error_t *err)
{
    return tdm_served_model_open_at(sm, cfg, 0, err);
}

int tdm_served_model_open_at(tdm_served_model_t *sm, const tdm_config_t *cfg, size_t index,
                             tdm_error_t *err)
{
    memset(sm, 0, sizeof *sm);
    if (index >= cfg->n_models)
        return tdm_error_set(err, TDM_EINVALID, "model index %zu: the config lists %zu models",
                             index, cfg->n_models);
    const char *path = cfg->models[index].path;
    int rc;
    sm->model = tdm_model_load(path, err);
    if (!sm->model) {
        /* "model PATH: why", the path once (the loader's message may start with it) */
        size_t pl = strlen(path);
        if (err && strncmp(err->msg, path, pl) == 0 && strncmp(err->msg + pl, ": ", 2) == 0)
            memmove(err->msg, err->msg + pl + 2, strlen(err->msg + pl + 2) + 1);
        return tdm_error_prefix(err, err ? err->code : TDM_EINVALID, "model %s: ", path);
    }
    const tdm_llama_hparams_t *hp = tdm_model_hparams(sm->model);
    sm->tok = tdm_tokenizer_new(tdm_model_gguf(sm->model), err);
    if (!sm->tok) {
        rc = tdm_error_prefix(err, err ? err->code : TDM_EINVALID, "tokenizer of %s: ", path);
        goto out_close;
    }
    sm->n_vocab = hp->n_vocab;
    int max_ctx = cfg->models[index].max_context;
    if (max_ctx < 0 || (uint32_t)max_ctx > hp->n_ctx_train) {
        rc = tdm_error_set_field(err, TDM_EINVALID, "max_context",
                                 "model %s: max_context %d is past the model's trained context "
                                 "of %" PRIu32 " tokens (the longest Tandem serves it with)",
                                 path, max_ctx, hp->n_ctx_train);
        goto out_close;
    }
    sm->n_ctx = tdm_model_serve_n_ctx(hp, (uint32_t)max_ctx);
    sm->fingerprint = tdm_model_fingerprint(sm->model);
    sm->layout = (tdm_kv_layout_t){hp->n_layers, hp->n_kv_heads, hp->head_dim,
                                   (uint32_t)cfg->kv.block_size, cfg->kv.dtype};
    if ((rc = tdm_kv_layout_check(&sm->layout, err)) != TDM_OK) {
        tdm_error_prefix(err, rc, "model %s: ", path);
        goto out_close;
    }
    if (sm->n_ctx < 2 && max_ctx > 0) {
        rc = tdm_error_set_field(err, TDM_EINVALID, "max_context",
                                 "model %s: max_context %d is too short: at least 2 tokens (a "
                                 "prompt token and an output token)",
                                 path, max_ctx);
        goto out_close;
    }
    if (sm->n_ctx < 2) {
        rc = tdm_error_set(err, TDM_EINVALID, "model %s: context length %" PRIu32 " is too short",
                           path, sm->n_ctx);
        goto out_close;
    }
    return TDM_OK;
out_close:
    tdm_served_model_close(sm);
    return rc;
}

void tdm_served_model_close(tdm_served_model_t *sm)
{
    if (!sm)
        return;
    tdm_tokenizer_destroy(&sm->tok);
    tdm_model_destroy(&sm->model);
    memset(sm, 0, sizeof *sm);
}
