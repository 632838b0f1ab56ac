/* hparams_internal.h - the refusal of what the engine does not implement, shared by the
 * hyperparameter reader's files (internal to libtandem). */
#ifndef TANDEM_GGUF_HPARAMS_INTERNAL_H
#define TANDEM_GGUF_HPARAMS_INTERNAL_H

#include "tandem/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Refuses a model (hp already read from g) that asks for a computation Tandem's forward pass
 * does not do: every `<arch>.` metadata key must be one Tandem reads or knows to leave the
 * forward pass unchanged, and every tensor one the forward pass reads. TDM_OK, or
 * TDM_EINVALID naming the first key or tensor refused and what it would need. */
int tdm_gguf_refuse_unimplemented(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp,
                                  tdm_error_t *err);

/* Whether architecture arch may have mixture-of-experts layers (llama: Mixtral; qwen3moe). */
bool tdm_gguf_arch_has_experts(const char *arch);

/* Reads the expert counts of hp->arch (hp->n_ff already read): n_expert, n_expert_used,
 * n_ff_exp; leaves them 0 for a dense model. TDM_ENOTFOUND or TDM_EINVALID naming the key:
 * qwen3moe without experts, expert_used_count missing, 0 or above expert_count, more than
 * TDM_GGUF_MAX_EXPERTS experts, an expert hidden size of 0 (hparams_moe.c). */
int tdm_gguf_hparams_moe(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err);

/* Checks layer l's router and expert tensors (names and shapes in hparams_moe.c) when
 * hp->n_expert > 0. TDM_ENOTFOUND or TDM_EINVALID naming the tensor. */
int tdm_gguf_check_moe_layer(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, uint32_t l,
                             tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_GGUF_HPARAMS_INTERNAL_H */
