/* http_conv.h - HTTP conventions of the gateway (http_conv.c): request ids, CORS,
 * OPTIONS.
 */
#ifndef TANDEM_ROUTER_HTTP_CONV_H
#define TANDEM_ROUTER_HTTP_CONV_H

#include <stdbool.h>
#include <stddef.h>

#include "tandem/config.h"

struct MHD_Connection;
struct MHD_Response;

/* Whether s (NUL-terminated; NULL: no) is a request id a client may choose: 1 to
 * TDM_REQUEST_ID_MAX bytes of 0x21..0x7E. */
bool http_request_id_ok(const char *s);

/* A new id "req-<24 hex digits>" into buf (cap >= 29). Cannot fail. */
void http_request_id_new(char *buf, size_t cap);

/* The Access-Control-Allow-Origin value for the request's Origin: "*" when router.cors_origins
 * has "*", the Origin itself when it is listed (ASCII case ignored), NULL when there is no
 * Origin or it is not allowed (or no CORS is configured). Valid while c's request is. */
const char *http_cors_origin(const tdm_config_t *cfg, struct MHD_Connection *c);

/* Adds what every reply carries: X-Request-Id: rid (when not empty) and, for an allowed
 * Origin, Access-Control-Allow-Origin (Vary: Origin) and Access-Control-Expose-Headers. */
void http_conv_headers(const tdm_config_t *cfg, struct MHD_Connection *c, struct MHD_Response *resp,
                       const char *rid);

/* Answers OPTIONS: 204 with Allow and X-Request-Id: rid; for an allowed Origin also the CORS
 * preflight headers (Allow-Origin, -Methods, -Headers, -Max-Age). Returns MHD's result. */
int http_options(const tdm_config_t *cfg, struct MHD_Connection *c, const char *rid);

#endif /* TANDEM_ROUTER_HTTP_CONV_H */
