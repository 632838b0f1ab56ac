/* validate.h - GENERATE validation (validate.c): from a GenerateRequest to a request's fields,
 * or a refusal naming the field at fault.
 */
#ifndef TANDEM_ROUTER_VALIDATE_H
#define TANDEM_ROUTER_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

#include "router_internal.h"

/* What a refusal for length says beyond its message and field: the rest of the END's
 * ErrorDetail body. All 0 for any other refusal. */
typedef struct rt_refusal {
    uint32_t prompt_tokens;  /* too long for the context: the prompt's tokens */
    uint32_t n_ctx;          /* ... the context length (0: not a length error) */
    uint32_t max_tokens_fit; /* ... output tokens that would fit */
} rt_refusal_t;

/* Validates the GENERATE g (decoded from the frame f, whose raw body tells a request id left
 * unset from an empty one) and fills q: id (the client's, checked, or a new one), choices,
 * stop strings, sampling (a seed drawn when none is given), the prompt's token ids, max_tokens,
 * the compiled constraint, the output flags. Returns 0, or the status with *err saying why
 * and err->field the GenerateRequest path at fault ("stop[1]", "sampling.top_p",
 * "chat.messages[2].content"; "" when the input is missing); a refusal for length also fills
 * *why. INVALID_ARGUMENT, NOT_FOUND (another model), FAILED_PRECONDITION (a chat without a
 * template), RESOURCE_EXHAUSTED (out of memory). What q holds on failure is freed with it. */
int rt_req_validate(tdm_router_t *r, const tdm_frame_t *f, const Tandem__V1__GenerateRequest *g,
                    rt_req_t *q, rt_refusal_t *why, tdm_error_t *err);

/* Length in bytes on the wire of the last top-level length-delimited field `field` of the
 * protobuf message in b[0..n) (protobuf: the last occurrence wins), or 0 when absent or
 * malformed. protobuf-c hands strings over NUL-terminated, so an embedded NUL would silently
 * shorten them: comparing strlen with this length catches it. b may be NULL when n is 0.
 * Cannot fail. Wire format: developers.google.com/protocol-buffers/docs/encoding. */
size_t rt_wire_field_len(const uint8_t *b, size_t n, uint32_t field);

#endif /* TANDEM_ROUTER_VALIDATE_H */
