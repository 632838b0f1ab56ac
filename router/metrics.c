/* metrics.c - renders the router's figures as Prometheus text exposition format 0.0.4 and
 * answers METHOD_METRICS with it.
 *
 * Assumptions: it runs on the router's thread (the state is read without locks) and is not on
 * a hot path (a scrape every few seconds), so the text is built in a growing heap buffer.
 * Names follow Prometheus's conventions (base units, _total for counters; `promtool check
 * metrics` has nothing to say about the output, tests/unit/test_router.c checks it). Families
 * are always announced with HELP and TYPE, even when they have no sample yet (node gauges
 * while no node is up).
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "router_internal.h"

/* ---- a growing text buffer ---- */

typedef struct sb {
    char *p;
    size_t len, cap;
    bool oom; /* an allocation failed: everything after it is dropped */
} sb_t;

static bool sb_reserve(sb_t *b, size_t more)
{
    if (b->oom)
        return false;
    if (b->len + more + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

static void sb_printf(sb_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sb_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = true;
        return;
    }
    if (!sb_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* A label value, escaped as the format says: backslash, double quote and line feed. */
static void sb_label_value(sb_t *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\')
            sb_printf(b, "\\\\");
        else if (*v == '"')
            sb_printf(b, "\\\"");
        else if (*v == '\n')
            sb_printf(b, "\\n");
        else
            sb_printf(b, "%c", *v);
    }
}

/* A float sample value or `le` bound: the shortest of %.15g / %.16g / %.17g that reads back
 * exactly; NaN and the infinities as the format spells them. */
static void fmt_double(char *out, size_t cap, double v)
{
    if (isnan(v)) {
        snprintf(out, cap, "NaN");
    } else if (isinf(v)) {
        snprintf(out, cap, v > 0 ? "+Inf" : "-Inf");
    } else {
        snprintf(out, cap, "%.15g", v);
        if (strtod(out, NULL) != v)
            snprintf(out, cap, "%.16g", v);
        if (strtod(out, NULL) != v)
            snprintf(out, cap, "%.17g", v);
    }
}

/* ---- families ---- */

static void family(sb_t *b, const char *name, const char *type, const char *help)
{
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample_u64(sb_t *b, const char *name, uint64_t v)
{
    sb_printf(b, "%s %" PRIu64 "\n", name, v);
}

static void counter(sb_t *b, const char *name, const char *help, uint64_t v)
{
    family(b, name, "counter", help);
    sample_u64(b, name, v);
}

static void gauge(sb_t *b, const char *name, const char *help, uint64_t v)
{
    family(b, name, "gauge", help);
    sample_u64(b, name, v);
}

/* One histogram: cumulative buckets over tdm_router_hist_bounds, then +Inf, _sum, _count. */
static void histogram(sb_t *b, const char *name, const char *help, const tdm_router_hist_t *h)
{
    family(b, name, "histogram", help);
    const double *bounds = tdm_router_hist_bounds();
    uint64_t cum = 0;
    char num[40];
    for (size_t i = 0; i < TDM_ROUTER_HIST_BUCKETS - 1; i++) {
        cum += h->buckets[i];
        fmt_double(num, sizeof num, bounds[i]);
        sb_printf(b, "%s_bucket{le=\"%s\"} %" PRIu64 "\n", name, num, cum);
    }
    sb_printf(b, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, h->count);
    fmt_double(num, sizeof num, h->sum);
    sb_printf(b, "%s_sum %s\n%s_count %" PRIu64 "\n", name, num, name, h->count);
}

/* `{node="ID",role="ROLE"}` for n. */
static void node_labels(sb_t *b, const rt_node_t *n)
{
    sb_printf(b, "{node=\"");
    sb_label_value(b, n->cfg->id);
    sb_printf(b, "\",role=\"%s\"}", tdm_config_node_role_name(n->cfg->role));
}

typedef enum node_set {
    NODES_ALL,        /* every configured node */
    NODES_REGISTERED, /* nodes that registered at least once (their counters exist) */
    NODES_UP,         /* nodes up now (their load figures are current) */
} node_set_t;

typedef double (*node_value_fn)(const rt_node_t *n);

/* One per-node family: a sample for each node of the set. */
static void node_family(sb_t *b, const tdm_router_t *r, const char *name, const char *type,
                        const char *help, node_set_t set, node_value_fn value)
{
    family(b, name, type, help);
    char num[40];
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *n = &r->nodes[i];
        if ((set == NODES_REGISTERED && !n->registered) || (set == NODES_UP && !n->up))
            continue;
        sb_printf(b, "%s", name);
        node_labels(b, n);
        fmt_double(num, sizeof num, value(n));
        sb_printf(b, " %s\n", num);
    }
}

/* Node figures (all fit a double exactly: block counts are 32-bit, token and block counters
 * stay far below 2^53). */
static double nv_up(const rt_node_t *n)
{
    return n->up ? 1 : 0;
}
static double nv_failures(const rt_node_t *n)
{
    return (double)n->failures;
}
static double nv_prefix_queries(const rt_node_t *n)
{
    return (double)n->prefix_queries;
}
static double nv_prefix_hits(const rt_node_t *n)
{
    return (double)n->prefix_hits;
}
static double nv_running(const rt_node_t *n)
{
    return n->running;
}
static double nv_waiting(const rt_node_t *n)
{
    return n->waiting;
}
static double nv_kv_used(const rt_node_t *n)
{
    return n->kv_used;
}
static double nv_kv_capacity(const rt_node_t *n)
{
    return n->kv_blocks_total;
}
static double nv_kv_cached(const rt_node_t *n)
{
    return n->kv_cached;
}
static double nv_kv_reserved(const rt_node_t *n)
{
    return (double)n->reserved_pending + n->reserved_acked;
}
static double nv_batch(const rt_node_t *n)
{
    return n->batch_size;
}
static double nv_queued_prefill(const rt_node_t *n)
{
    return (double)n->queued_prefill_tokens;
}
static double nv_step(const rt_node_t *n)
{
    return n->step_time_s;
}

static void render_requests(sb_t *b, const tdm_router_t *r)
{
    const tdm_router_metrics_t *m = &r->metrics;
    counter(b, "tandem_requests_received_total",
            "Generate requests received by the router, valid or not.", m->requests_total);
    family(b, "tandem_requests_total", "counter",
           "Generate requests that ended, by final gRPC status and finish reason (none: refused "
           "before it started).");
    for (size_t s = 0; s < 17; s++)
        for (size_t f = 0; f < 5; f++) {
            uint64_t v = m->requests_by_status_finish[s][f];
            /* the successful series always exist, so rate() sees their first increase */
            bool always = s == 0 && (f == 1 || f == 2);
            if (v == 0 && !always)
                continue;
            sb_printf(b, "tandem_requests_total{status=\"%s\",finish_reason=\"%s\"} %" PRIu64 "\n",
                      tdm_status_name(-(int)s), tdm_proto_finish_name((int)f), v);
        }
    counter(b, "tandem_requests_redispatched_total",
            "Requests dispatched again after a retryable node failure or the loss of their "
            "prefill node.",
            m->redispatches);
    counter(b, "tandem_requests_queue_full_total",
            "Requests refused with RESOURCE_EXHAUSTED because the router's queue was full.",
            m->queue_full);
    counter(b, "tandem_decode_reserve_rejections_total",
            "KV reservations a decode node refused for lack of blocks (the router then tries "
            "another node or queues the request).",
            m->reserve_rejects);
    counter(b, "tandem_duplicate_token_events_total",
            "Token events dropped because their index had already been delivered.",
            m->duplicate_events);
    counter(b, "tandem_prompt_tokens_total", "Prompt tokens of the requests the router accepted.",
            m->prompt_tokens);
    counter(b, "tandem_prompt_tokens_cached_total",
            "Prompt tokens the prefill nodes found in their prefix caches.",
            m->cached_prompt_tokens);
    counter(b, "tandem_generation_tokens_total", "Output tokens delivered to clients.",
            m->generation_tokens);
    counter(b, "tandem_kv_transfer_bytes_total",
            "KV cache bytes the decode nodes received from prefill nodes for requests that "
            "finished.",
            m->kv_transfer_bytes);
    counter(b, "tandem_kv_transfer_failures_total",
            "KV transfers that failed: retryable failures a prefill node reported after its first "
            "token, or a decode node before the KV arrived.",
            m->kv_transfer_failures);
    counter(b, "tandem_stale_attempt_messages_total",
            "Node messages dropped because they belong to a dispatch attempt that is not the "
            "request's current one (a reused request id, a superseded dispatch).",
            m->stale_attempt_messages);
    counter(b, "tandem_stale_instance_messages_total",
            "Node messages dropped because they came from a connection or instance that is not "
            "the registered instance of that node.",
            m->stale_instance_messages);
    counter(b, "tandem_node_registrations_refused_total",
            "Node registrations the router refused (unknown id, a second instance of a live "
            "node, another node's key, a configuration mismatch).",
            m->registrations_refused);
    gauge(b, "tandem_requests_running",
          "Requests dispatched to nodes (reserving KV blocks or running).",
          (uint64_t)(r->n_reqs - r->n_queued));
    gauge(b, "tandem_requests_queued", "Requests waiting in the router's queue for a decode node.",
          (uint64_t)r->n_queued);
}

static void render_histograms(sb_t *b, const tdm_router_t *r)
{
    const tdm_router_metrics_t *m = &r->metrics;
    histogram(b, "tandem_time_to_first_token_seconds",
              "From the request's arrival to its first token leaving the router.", &m->ttft);
    histogram(b, "tandem_inter_token_latency_seconds",
              "Between consecutive tokens of a request as the router forwards them.", &m->itl);
    histogram(b, "tandem_time_per_output_token_seconds",
              "Per completed request with 2 or more tokens: first to last token divided by the "
              "tokens after the first.",
              &m->tpot);
    histogram(b, "tandem_e2e_request_latency_seconds",
              "From the request's arrival to its final message (completed or failed).", &m->e2e);
    histogram(b, "tandem_request_queue_time_seconds",
              "From the request's arrival until a decode node acknowledged its reservation and "
              "the prefill task was sent.",
              &m->queue);
    histogram(b, "tandem_request_prefill_time_seconds",
              "Prefill compute time of a request, measured by its prefill node.", &m->prefill);
    histogram(b, "tandem_kv_transfer_time_seconds",
              "KV transfer time of a completed request, measured by its decode node.",
              &m->kv_transfer);
}

static void render_nodes(sb_t *b, const tdm_router_t *r)
{
    node_family(b, r, "tandem_node_up", "gauge",
                "1 when the configured node is registered and heartbeating, else 0.", NODES_ALL,
                nv_up);
    node_family(b, r, "tandem_node_failures_total", "counter",
                "Times the router marked the node down (heartbeat timeout or restart).", NODES_ALL,
                nv_failures);
    node_family(b, r, "tandem_prefix_cache_queries_total", "counter",
                "KV blocks the node looked up in its prefix cache (cumulative per node process, "
                "from its heartbeats).",
                NODES_REGISTERED, nv_prefix_queries);
    node_family(b, r, "tandem_prefix_cache_hits_total", "counter",
                "KV blocks the node found in its prefix cache (cumulative per node process, from "
                "its heartbeats).",
                NODES_REGISTERED, nv_prefix_hits);
    node_family(b, r, "tandem_node_running", "gauge",
                "Sequences the node is running (last heartbeat).", NODES_UP, nv_running);
    node_family(b, r, "tandem_node_waiting", "gauge",
                "Sequences waiting on the node for room (last heartbeat).", NODES_UP, nv_waiting);
    node_family(b, r, "tandem_node_kv_blocks_used", "gauge",
                "KV blocks in use by sequences on the node (last heartbeat).", NODES_UP,
                nv_kv_used);
    node_family(b, r, "tandem_node_kv_blocks_capacity", "gauge",
                "KV blocks in the node's pool (from its registration).", NODES_UP, nv_kv_capacity);
    node_family(b, r, "tandem_node_kv_blocks_cached", "gauge",
                "KV blocks held only by the node's prefix cache, free to evict (last heartbeat).",
                NODES_UP, nv_kv_cached);
    node_family(b, r, "tandem_node_kv_blocks_reserved", "gauge",
                "Decode KV blocks the router reserved on the node that its last heartbeat does "
                "not show yet.",
                NODES_UP, nv_kv_reserved);
    node_family(b, r, "tandem_node_batch_size", "gauge",
                "Sequences in the node's last forward pass (last heartbeat).", NODES_UP, nv_batch);
    node_family(b, r, "tandem_node_queued_prefill_tokens", "gauge",
                "Prompt tokens queued for prefill on the node (last heartbeat).", NODES_UP,
                nv_queued_prefill);
    node_family(b, r, "tandem_node_step_time_seconds", "gauge",
                "Mean duration of the node's recent forward passes (last heartbeat).", NODES_UP,
                nv_step);
}

int tdm_router_metrics_text(const tdm_router_t *r, char **text, size_t *len)
{
    *text = NULL;
    if (len)
        *len = 0;
    sb_t b = {0};
    if (!sb_reserve(&b, 16384))
        return TDM_ERESOURCE;
    render_requests(&b, r);
    render_histograms(&b, r);
    render_nodes(&b, r);
    family(&b, "tandem_build_info", "gauge",
           "Always 1; the labels carry the router's version and the served model.");
    sb_printf(&b, "tandem_build_info{version=\"");
    sb_label_value(&b, TANDEM_VERSION);
    sb_printf(&b, "\",model=\"");
    sb_label_value(&b, r->cfg->model.name ? r->cfg->model.name : "");
    sb_printf(&b, "\"} 1\n");
    if (b.oom) {
        free(b.p);
        return TDM_ERESOURCE;
    }
    *text = b.p;
    if (len)
        *len = b.len;
    return TDM_OK;
}

void rt_client_metrics(tdm_router_t *r, const tdm_frame_t *f)
{
    char *text = NULL;
    if (tdm_router_metrics_text(r, &text, NULL) != TDM_OK) {
        tdm_sock_reply_error(r->client, f, TDM_ERESOURCE, "router out of memory");
        return;
    }
    Tandem__V1__MetricsResponse resp = TANDEM__V1__METRICS_RESPONSE__INIT;
    resp.text = text;
    tdm_sock_reply(r->client, f, &resp.base);
    free(text);
}
