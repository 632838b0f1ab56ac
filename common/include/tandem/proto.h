/* proto.h - the generated protobuf-c messages of proto/tandem.proto (package tandem.v1) and
 * conversions between them and Tandem's C structs (sampling parameters, KV layout, status
 * codes).
 *
 * Ownership: a *_to_proto function fills a caller-owned message whose repeated fields point
 * into caller-provided storage (nothing is allocated), so it is valid as long as the source
 * and the storage are. A *_from_proto function copies into a plain C struct.
 */
#ifndef TANDEM_PROTO_H
#define TANDEM_PROTO_H

#include <stdint.h>

#include "tandem.pb-c.h"

#include "tandem/base.h"
#include "tandem/kv.h"
#include "tandem/sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

/* SamplingParams.set_mask bits: field number - 1. */
#define TDM_PROTO_SET_TEMPERATURE (1u << 0)
#define TDM_PROTO_SET_TOP_K (1u << 1)
#define TDM_PROTO_SET_TOP_P (1u << 2)
#define TDM_PROTO_SET_MIN_P (1u << 3)
#define TDM_PROTO_SET_REPETITION_PENALTY (1u << 4)
#define TDM_PROTO_SET_PRESENCE_PENALTY (1u << 5)
#define TDM_PROTO_SET_FREQUENCY_PENALTY (1u << 6)
#define TDM_PROTO_SET_PENALTY_LAST_N (1u << 7)
#define TDM_PROTO_SET_SEED (1u << 8)
#define TDM_PROTO_SET_STOP_TOKEN_IDS (1u << 10)
#define TDM_PROTO_SET_IGNORE_EOS (1u << 11)
#define TDM_PROTO_SET_N_LOGPROBS (1u << 12)
#define TDM_PROTO_SET_LOGIT_BIAS (1u << 14)
#define TDM_PROTO_SET_MIN_TOKENS (1u << 15)
#define TDM_PROTO_SET_BAD_WORDS (1u << 16)
#define TDM_PROTO_SET_ALLOWED_TOKEN_IDS (1u << 17)

/* A SamplingParams message with the storage of its logit_bias and bad_words entries, so that
 * filling it allocates nothing: use .m (its pointers point into the struct and into the source
 * tdm_sampling_params_t). About 26 KB; a caller's local. */
typedef struct tdm_proto_sampling {
    Tandem__V1__SamplingParams m;
    Tandem__V1__LogitBias bias[TDM_SAMPLING_MAX_LOGIT_BIAS];
    Tandem__V1__LogitBias *bias_ptr[TDM_SAMPLING_MAX_LOGIT_BIAS];
    Tandem__V1__BadWord bad[TDM_SAMPLING_MAX_BAD_SEQS]; /* token sequences (ids point into
                                                           the source's bad_tokens) */
    Tandem__V1__BadWord *bad_ptr[TDM_SAMPLING_MAX_BAD_SEQS];
} tdm_proto_sampling_t;

/* Fills out->m (initialised here) from *p; every field set, set_mask all ones, has_seed true.
 * out->m.stop_token_ids points into p->stop_token_ids and out->m.logit_bias into out, so out
 * is valid while both *p and *out are; bad_words go as token sequences (ids, no text) and
 * allowed_token_ids point into p->allowed. Cannot fail. */
void tdm_proto_sampling_to(const tdm_sampling_params_t *p, tdm_proto_sampling_t *out);

/* Copies m into *p. Fields whose set_mask bit is clear keep the value *p has on entry
 * (so callers start from tdm_sampling_params_default); max_tokens is not part of the message
 * and is left alone. logit_bias entries are taken in any order and stored sorted by token id
 * (the order tdm_sampling_params_validate requires; a repeated id stays repeated, for the
 * validator to name). Returns 0, or TDM_EINVALID naming the field when more than
 * TDM_SAMPLING_MAX_STOP stop token ids ("sampling.stop_token_ids: ...") or more than
 * TDM_SAMPLING_MAX_LOGIT_BIAS logit_bias entries ("sampling.logit_bias: ...") are given, more
 * than TDM_SAMPLING_MAX_ALLOWED allowed_token_ids ("sampling.allowed_token_ids"), or bad-word
 * token sequences over tdm_sampling_bad_seq_add's limits or with both text and ids
 * ("sampling.bad_words[2]"). bad_words entries with text are skipped: words are the router's
 * to tokenize (router/validate.c); only token sequences (ids) are taken. Range checks are
 * tdm_sampling_params_validate's job. */
int tdm_proto_sampling_from(const Tandem__V1__SamplingParams *m, tdm_sampling_params_t *p,
                            tdm_error_t *err);

/* KV layout both ways. _from returns TDM_EINVALID for an unknown dtype (range checks:
 * tdm_kv_layout_check). */
void tdm_proto_layout_to(const tdm_kv_layout_t *l, Tandem__V1__KvLayout *m);
int tdm_proto_layout_from(const Tandem__V1__KvLayout *m, tdm_kv_layout_t *l, tdm_error_t *err);

/* Appends m as Prometheus text exposition format 0.0.4 to *out: "# HELP" and "# TYPE" per
 * family (once for consecutive families of one name: a histogram with several label sets, one
 * MetricFamily each), one sample per line, histograms as cumulative _bucket{le=...}, _sum and
 * _count, label values escaped (backslash, quote, line feed), '\n' line ends. The one renderer of
 * the router's metrics (GET /metrics; native clients that show text). Returns 0, or TDM_ERESOURCE
 * when out holds an out-of-memory (tdm_buf_t.oom). Borrows m. */
int tdm_proto_metrics_text(const Tandem__V1__MetricsResponse *m, tdm_buf_t *out);

/* The family called name in m, or NULL. Points into m. Cannot fail. */
const Tandem__V1__MetricFamily *tdm_proto_metrics_find(const Tandem__V1__MetricsResponse *m,
                                                       const char *name);

/* Every message type of proto/tandem.proto (*n of them), for code that treats them all
 * alike (round-trip tests, fuzzing). Static storage; cannot fail. */
const ProtobufCMessageDescriptor *const *tdm_proto_messages(size_t *n);

/* The name of a FinishReason value: "none" (UNSPECIFIED: the request ended before it
 * started), "stop", "length", "cancelled", "error"; "?" for other values. The finish_reason
 * label of the router's metrics and tdm_client_finish_name's text. Never NULL, cannot fail. */
const char *tdm_proto_finish_name(int reason);

/* Wire status (gRPC code, >= 0) <-> tdm status (0 or negative). Unknown wire codes map to
 * TDM_EINTERNAL... except that the number is kept: -code. */
static inline int tdm_proto_status_to_wire(int tdm_status)
{
    return -tdm_status;
}
static inline int tdm_proto_status_from_wire(int code)
{
    return code <= 0 ? 0 : -code;
}

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_PROTO_H */
