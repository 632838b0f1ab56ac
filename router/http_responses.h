/* http_responses.h - OpenAI's Responses API in the HTTP gateway (http_responses.c):
 * POST /v1/responses translated into the chat request that /v1/chat/completions makes (one
 * prompt path through the chat template, one constraint path for text.format and tools, one
 * tool-call and reasoning parser), run by http_generate.c, and the chat answer written back as
 * a response object or as the Responses stream events; GET and DELETE /v1/responses/{id} from
 * the router's store (responses_store.h). docs/api.md "Responses API" describes them.
 */
#ifndef TANDEM_ROUTER_HTTP_RESPONSES_H
#define TANDEM_ROUTER_HTTP_RESPONSES_H

#include <stdbool.h>

#include <jansson.h>
#include <microhttpd.h>

#include "http_openai.h"
#include "http_server.h"

/* The state of one /v1/responses request, from its body to its last event (http_req_t.resp). */
typedef struct resp_call resp_call_t;

/* POST /v1/responses: the body checked and translated (a refusal names the Responses field:
 * "input[2].type", "tools[0].type", "text.format.type", "previous_response_id"), then run as a
 * chat request by http_generate (r->resp set). */
enum MHD_Result http_responses(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r);

/* GET (del false) or DELETE (del true) /v1/responses/{id}: the stored response object, or
 * {"id", "object": "response", "deleted": true}; 404 naming the id when this router holds
 * none of it. */
enum MHD_Result http_responses_item(tdm_http_t *h, struct MHD_Connection *c, const char *id,
                                    bool del);

/* The chat request body made from the Responses body: JSON text (borrowed from rc) and *len. */
const char *resp_chat_body(const resp_call_t *rc, size_t *len);

/* After oai_parse of resp_chat_body: the response id ("resp_…") as q's id and the chat deltas
 * routed to rc's stream writer (q->on_delta). */
void resp_bind(resp_call_t *rc, oai_req_t *q);

/* An error about the chat request (err->field and the message's first word a chat name:
 * "messages[3].content", "max_completion_tokens", "response_format", "tools[0].function.name")
 * restated in the Responses request's names ("input[1].content", "max_output_tokens",
 * "text.format", "tools[0].name"). Cannot fail. */
void resp_rename(const resp_call_t *rc, tdm_error_t *err);

/* stream=false: the response object from the call's one chunk (o gets its usage and parser
 * state, as oai_sse_chunk; freed with oai_out_clear), stored when the request has store true.
 * The chunk goes through the stream's item writer, so output holds the items a stream of the
 * same text gives (same order, ids, call_ids): text, calls and text again are three items.
 * New reference, NULL on out of memory. */
json_t *resp_whole(resp_call_t *rc, const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch);

/* stream=true: the first events (response.created, response.in_progress) into b. 0 or
 * TDM_ERESOURCE. */
int resp_sse_begin(resp_call_t *rc, const oai_req_t *q, tdm_buf_t *b);

/* stream=true, the call's END (status; message for a failure): the open output item closed,
 * then response.completed (finish stop), response.incomplete (length: incomplete_details.reason
 * "max_output_tokens") or response.failed, into b; a completed or incomplete response is stored
 * when the request has store true. 0 or TDM_ERESOURCE. */
int resp_sse_end(resp_call_t *rc, const oai_req_t *q, const oai_out_t *o, int status,
                 const char *message, tdm_buf_t *b);

/* Frees rc. NULL-safe, nulls *rc_p. */
void resp_call_free(resp_call_t **rc_p);

#endif /* TANDEM_ROUTER_HTTP_RESPONSES_H */
