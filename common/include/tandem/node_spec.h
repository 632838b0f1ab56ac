/* node_spec.h - what a node takes from a task: the SequenceSpec the router sends in
 * DecodeReserve and PrefillTask (one attempt of a request), checked by one function for both
 * node roles, and the attempt's identity every node keys its state by. */
#ifndef TANDEM_NODE_SPEC_H
#define TANDEM_NODE_SPEC_H

#include <stdint.h>

#include "tandem/base.h"
#include "tandem/constraint.h"
#include "tandem/limits.h"
#include "tandem/proto.h"
#include "tandem/sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The constraint of a task (SequenceSpec.constraint) into *g: NULL
 * when c is NULL or of kind NONE; else the compiled grammar from the cache (held until
 * tdm_grammar_cache_release; tdm_node_req_drop releases a request's). Returns 0; TDM_EINVALID
 * naming "constraint" for a kind other than GRAMMAR, a text over TDM_GRAMMAR_MAX_TEXT_BYTES, a
 * hash that does not match the text or a grammar that does not compile; TDM_ERESOURCE. */
int tdm_node_constraint(tdm_grammar_cache_t *cache, const Tandem__V1__Constraint *c,
                        const tdm_grammar_t **g, tdm_error_t *err);

/* One dispatch attempt held by a node (docs/protocol.md "Identities"). The router's attempt id
 * is the key of all node state: the worker's sequence id, the KV reservation and the
 * transfer; the client's request id is only a label carried back on messages and logs, so a
 * request id reused by a client can never reach another attempt's state. */
typedef struct tdm_node_attempt {
    uint64_t attempt_id;      /* never 0 */
    uint64_t router_instance; /* FrameHeader.instance_id of the router that dispatched it */
    char key[17];             /* "%016" PRIx64 of attempt_id: its printable form, for logs */
    char label[TDM_REQUEST_ID_MAX + 1]; /* the client's request id */
} tdm_node_attempt_t;

/* Fills *a from a task's spec (its request_id and attempt_id) and the frame's router instance.
 * TDM_EINVALID naming the field when the spec is missing ("spec: missing"), request_id is
 * empty, too long or not printable ASCII, or attempt_id is 0. */
int tdm_node_spec_attempt(const Tandem__V1__SequenceSpec *spec, uint64_t router_instance,
                          tdm_node_attempt_t *a, tdm_error_t *err);

/* Checks the rest of a task's spec (tdm_node_spec_attempt took its identity) against the node:
 * n_ctx tokens of context at most, token ids in [0, n_vocab). *sp gets the sampling parameters:
 * Tandem's defaults, then the spec's fields (set_mask), then max_tokens. The one check of both
 * node roles, so that a prefill and a decode node never disagree on a task. Returns 0; else
 * TDM_EINVALID with the field and the limit in the message: "spec: missing",
 * "prompt_tokens: N tokens; 1..n_ctx-1 fit the context of n_ctx tokens",
 * "prompt_tokens[i]: token id T is outside the vocabulary [0, n_vocab)", "max_tokens must be
 * >= 1", a "sampling.*" field out of range (tdm_sampling_params_validate), "output_tokens: N
 * tokens after a prompt of P; the context holds n_ctx and max_tokens is M" (a migrated request
 * whose prompt + output + the next token do not fit, or whose output reached max_tokens),
 * "output_tokens[i]: token id ...". */
int tdm_node_spec_check(const Tandem__V1__SequenceSpec *spec, uint32_t n_ctx, uint32_t n_vocab,
                        tdm_sampling_params_t *sp, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_SPEC_H */
