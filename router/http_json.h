/* http_json.h - the HTTP gateway's JSON helpers (http_json.c): JSON into a tdm_buf_t,
 * strings made valid UTF-8, OpenAI's error body from the status table, the served model.
 */
#ifndef TANDEM_ROUTER_HTTP_JSON_H
#define TANDEM_ROUTER_HTTP_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "tandem/base.h"
#include "tandem/kv.h"
#include "tandem/proto.h"

/* Appends the compact JSON text of v (not consumed) to b. TDM_ERESOURCE on out of memory. */
int http_json_append(tdm_buf_t *b, const json_t *v);

/* A JSON string of the n bytes at s (NULL: ""), each byte that is not part of valid UTF-8
 * (and each NUL) replaced by U+FFFD, so that every reply is valid UTF-8 JSON (jansson's
 * json_string refuses invalid UTF-8). New reference, NULL on out of memory. */
json_t *http_json_text(const char *s, size_t n);
/* http_json_text of a NUL-terminated string. */
json_t *http_json_str(const char *s);

typedef struct http_model {
    char name[256];
    char chat_template[32];
    uint64_t fingerprint;
    uint32_t n_ctx, n_vocab;
    uint32_t n_layers, n_kv_heads, head_dim, n_heads, n_embd;
    uint64_t weight_bytes;
    uint32_t kv_block_size;
    int kv_dtype;           /* tdm_kv_dtype_t */
    bool have_groups;       /* the model has sliding-window layers (ModelInfo.layer_windows) */
    tdm_kv_groups_t groups; /* their layer groups (tdm_kv_groups_init), for the nodes that
                               allocate per group (NodeStatus.kv_layer_groups > 1) */
} http_model_t;

/* Fills *m from a ModelInfo. Cannot fail. */
void http_model_from_proto(const Tandem__V1__ModelInfo *mi, http_model_t *m);

/* {"error": {"message", "type", "param", "code"}} for status (a tdm status): type from its row
 * of the status table (tdm_status_info: "invalid_request_error", "authentication_error", ...),
 * code the given one or, when NULL, the row's ("invalid_argument"). param may be NULL. The HTTP
 * status to send it with is the row's http_status. Returns a new reference, NULL on out of
 * memory. */
json_t *http_error_json(int status, const char *code, const char *param, const char *message);

#endif /* TANDEM_ROUTER_HTTP_JSON_H */
