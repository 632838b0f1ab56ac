/* http_conv.c - the HTTP conventions every reply of the gateway follows: X-Request-Id (the
 * client's own when it is a valid id, else the router's), CORS for router.cors_origins
 * (Access-Control-Allow-Origin on replies, OPTIONS preflight) and Retry-After.
 *
 * A request id is 1..TDM_REQUEST_ID_MAX bytes of 0x21..0x7E, the native API's rule
 * (tandem/limits.h), so a client's id can be logged and forwarded as it is.
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <time.h>

#include <microhttpd.h>

#include "http_conv.h"
#include "tandem/limits.h"

/* What a browser may read of a cross-origin reply besides the CORS-safelisted headers. */
#define HTTP_CORS_EXPOSE "X-Request-Id, Retry-After"
#define HTTP_CORS_METHODS "GET, POST, OPTIONS"
#define HTTP_CORS_HEADERS "Authorization, Content-Type, X-Request-Id"
#define HTTP_CORS_MAX_AGE "600"

bool http_request_id_ok(const char *s)
{
    if (!s)
        return false;
    size_t n = 0;
    for (; s[n]; n++)
        if ((unsigned char)s[n] < 0x21 || (unsigned char)s[n] > 0x7E || n >= TDM_REQUEST_ID_MAX)
            return false;
    return n > 0;
}

void http_request_id_new(char *buf, size_t cap)
{
    uint8_t r[12] = {0};
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
        uint64_t t = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)buf;
        memcpy(r, &t, sizeof t);
    }
    int n = snprintf(buf, cap, "req-");
    for (size_t i = 0; i < sizeof r && n > 0 && (size_t)n + 2 < cap; i++)
        n += snprintf(buf + n, cap - (size_t)n, "%02x", r[i]);
}

const char *http_cors_origin(const tdm_config_t *cfg, struct MHD_Connection *c)
{
    if (cfg->router.n_cors_origins == 0)
        return NULL;
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin || !origin[0])
        return NULL;
    for (size_t i = 0; i < cfg->router.n_cors_origins; i++) {
        const char *o = cfg->router.cors_origins[i];
        if (strcmp(o, "*") == 0)
            return "*";
        if (strcasecmp(o, origin) == 0)
            return origin;
    }
    return NULL;
}

/* Access-Control-Allow-Origin for a matching Origin (with Vary: Origin when it is echoed). */
static void add_cors_origin(const char *origin, struct MHD_Response *resp)
{
    MHD_add_response_header(resp, "Access-Control-Allow-Origin", origin);
    if (strcmp(origin, "*") != 0)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_VARY, "Origin");
}

void http_conv_headers(const tdm_config_t *cfg, struct MHD_Connection *c, struct MHD_Response *resp,
                       const char *rid)
{
    if (rid && rid[0])
        MHD_add_response_header(resp, "X-Request-Id", rid);
    const char *origin = http_cors_origin(cfg, c);
    if (origin) {
        add_cors_origin(origin, resp);
        MHD_add_response_header(resp, "Access-Control-Expose-Headers", HTTP_CORS_EXPOSE);
    }
}

int http_options(const tdm_config_t *cfg, struct MHD_Connection *c, const char *rid)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, HTTP_CORS_METHODS);
    if (rid && rid[0])
        MHD_add_response_header(resp, "X-Request-Id", rid);
    const char *origin = http_cors_origin(cfg, c);
    if (origin) {
        /* a preflight: what the browser may send; the headers it asks for are the ones a client
         * of this API sends (the list is what is allowed without asking) */
        const char *asked =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
        add_cors_origin(origin, resp);
        MHD_add_response_header(resp, "Access-Control-Allow-Methods", HTTP_CORS_METHODS);
        MHD_add_response_header(resp, "Access-Control-Allow-Headers",
                                asked && asked[0] ? asked : HTTP_CORS_HEADERS);
        MHD_add_response_header(resp, "Access-Control-Max-Age", HTTP_CORS_MAX_AGE);
    }
    enum MHD_Result ret = MHD_queue_response(c, 204, resp);
    MHD_destroy_response(resp);
    return ret;
}
