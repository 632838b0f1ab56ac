/* serve.h - the served model as the router and every node must see it: one loader, so the
 * values they compare at registration (context length, vocabulary, model fingerprint, KV
 * layout) are computed once, the same way, from the same config.
 */
#ifndef TANDEM_SERVE_H
#define TANDEM_SERVE_H

#include <stdint.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A cluster's model, opened for serving. Owns model and tok. */
typedef struct tdm_served_model {
    tdm_model_t *model;     /* cfg->model.path, mmap'd (tdm_model_load; no engine) */
    tdm_tokenizer_t *tok;   /* from the model's GGUF metadata */
    uint32_t n_ctx;         /* tokens per sequence: tdm_model_serve_n_ctx */
    uint32_t n_vocab;       /* tokens in the vocabulary */
    uint64_t fingerprint;   /* tdm_model_fingerprint */
    tdm_kv_layout_t layout; /* the model's n_layers, n_kv_heads, head_dim with the config's
                               kv.block_size and kv.dtype, checked (tdm_kv_layout_check) */
} tdm_served_model_t;

/* Opens cfg's (first) model and tokenizer into *sm and derives the figures above. Errors (*err, the
 * message starting with "model PATH: " or "tokenizer of PATH: "): TDM_ENOTFOUND (no file),
 * TDM_EINVALID (a malformed or unsupported model or tokenizer, a layout the KV cache cannot
 * hold, a context shorter than 2 tokens), TDM_ERESOURCE. On error nothing is left open and
 * *sm is zeroed. Caller closes with tdm_served_model_close. */
int tdm_served_model_open(tdm_served_model_t *sm, const tdm_config_t *cfg, tdm_error_t *err);

/* Like tdm_served_model_open for cfg->models[index] (the KV layout from cfg->kv); TDM_EINVALID
 * for an index past cfg->n_models. */
int tdm_served_model_open_at(tdm_served_model_t *sm, const tdm_config_t *cfg, size_t index,
                             tdm_error_t *err);

/* Frees what *sm holds and zeroes it. NULL-safe. */
void tdm_served_model_close(tdm_served_model_t *sm);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_SERVE_H */
