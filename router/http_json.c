/* http_json.c - the HTTP gateway's JSON helpers (http_json.h): compact JSON into a tdm_buf_t,
 * strings made valid UTF-8, OpenAI's error body from the status table, the served model from
 * the router's MODELS answer.
 */
#include <stdio.h>
#include <string.h>

#include "http_json.h"

static int buf_dump_cb(const char *data, size_t size, void *user)
{
    return tdm_buf_append(user, data, size) == TDM_OK ? 0 : -1;
}

int http_json_append(tdm_buf_t *b, const json_t *v)
{
    return json_dump_callback(v, buf_dump_cb, b, JSON_COMPACT) == 0 ? TDM_OK : TDM_ERESOURCE;
}

json_t *http_json_text(const char *s, size_t n)
{
    if (!s)
        return json_string("");
    size_t i = 0;
    uint32_t cp;
    while (i < n) {
        size_t l = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (l == 0 || cp == 0)
            break;
        i += l;
    }
    if (i == n)
        return json_stringn(s, n);
    tdm_buf_t b = TDM_BUF_INIT;
    tdm_buf_append(&b, s, i);
    while (i < n) {
        size_t l = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (l == 0 || cp == 0) {
            tdm_buf_append(&b, "\xef\xbf\xbd", 3); /* U+FFFD for the byte */
            i++;
        } else {
            tdm_buf_append(&b, s + i, l);
            i += l;
        }
    }
    json_t *v = b.data && !b.oom ? json_stringn(b.data, b.len) : NULL;
    tdm_buf_free(&b);
    return v;
}

json_t *http_json_str(const char *s)
{
    return http_json_text(s, s ? strlen(s) : 0);
}

json_t *http_error_json(int status, const char *code, const char *param, const char *message)
{
    const tdm_status_row_t *row = tdm_status_info(status);
    /* the message may quote client input (a URL, a JSON parser's excerpt, a model name) */
    json_t *e = json_object();
    if (!e)
        return NULL;
    json_object_set_new(e, "message", http_json_str(message ? message : ""));
    json_object_set_new(e, "type", json_string(row->oai_type));
    json_object_set_new(e, "param", param && param[0] ? http_json_str(param) : json_null());
    json_object_set_new(e, "code", http_json_str(code ? code : row->oai_code));
    if (json_object_size(e) != 4) { /* out of memory */
        json_decref(e);
        return NULL;
    }
    return json_pack("{s:o}", "error", e);
}

void http_model_from_proto(const Tandem__V1__ModelInfo *mi, http_model_t *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", mi->name ? mi->name : "");
    snprintf(m->chat_template, sizeof m->chat_template, "%s",
             mi->chat_template ? mi->chat_template : "");
    m->fingerprint = mi->fingerprint;
    m->n_ctx = mi->n_ctx;
    m->n_vocab = mi->n_vocab;
    m->n_layers = mi->n_layers;
    m->n_kv_heads = mi->n_kv_heads;
    m->head_dim = mi->head_dim;
    m->n_heads = mi->n_heads;
    m->n_embd = mi->n_embd;
    m->weight_bytes = mi->weight_bytes;
    m->kv_block_size = mi->kv_block_size;
    m->kv_dtype = (int)mi->kv_dtype;
    m->have_groups =
        mi->n_layer_windows > 0 && mi->n_layer_windows == mi->n_layers &&
        tdm_kv_groups_init(&m->groups, mi->n_layers, mi->layer_windows, NULL) == TDM_OK;
}
