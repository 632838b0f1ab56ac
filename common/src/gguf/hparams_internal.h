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

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_GGUF_HPARAMS_INTERNAL_H */
