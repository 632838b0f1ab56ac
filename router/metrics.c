/* metrics.c - the router's figures as a MetricsResponse (families of labelled samples), the
 * answer to METHOD_METRICS; the text exposition format is tdm_proto_metrics_text's job.
 *
 * Assumptions: it runs on the router's thread (the state is read without locks) and is not on
 * a hot path (a scrape every few seconds), so the message is built from many small mallocs.
 * Names follow Prometheus's conventions (base units, _total for counters; `promtool check
 * metrics` has nothing to say about the output, tests/unit/test_router.c checks it). Families
 * are always announced with HELP and TYPE, even when they have no sample yet (node gauges
 * while no node is up).
 */
#include <inttypes.h>
#include <stddef.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embed.h"
#include "metrics.h"
#include "router_internal.h"
#include "tandem/process.h"

#define METRIC_COUNTER TANDEM__V1__METRIC_TYPE__METRIC_TYPE_COUNTER
#define METRIC_GAUGE TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE

/* The uint64_t counter at offset off of a tdm_router_metrics_t. */
#define METRIC_U64(m, off) (*(const uint64_t *)(const void *)((const char *)(m) + (off)))
/* The tdm_router_hist_t at offset off of a tdm_router_metrics_t. */
#define METRIC_HIST(m, off) ((const tdm_router_hist_t *)(const void *)((const char *)(m) + (off)))
#define MOFF(field) offsetof(tdm_router_metrics_t, field)

/* ---- building the message ----
 * Everything is malloc'd, so protobuf_c_message_free_unpacked(&m->base, NULL) frees it. An
 * allocation that fails sets oom and later additions are skipped. */

typedef struct mb {
    Tandem__V1__MetricsResponse *m;
    bool oom;
} mb_t;

/* Grows the repeated field *arr of *n entries by one slot; NULL on out of memory. */
static void *grow(mb_t *b, void *arr_p, size_t *n, size_t size)
{
    void **arr = arr_p;
    if (b->oom)
        return NULL;
    void *p = realloc(*arr, (*n + 1) * size);
    if (!p) {
        b->oom = true;
        return NULL;
    }
    *arr = p;
    return (char *)p + (*n)++ * size;
}

static char *mb_strdup(mb_t *b, const char *s)
{
    char *d = b->oom ? NULL : tdm_strdup(s);
    if (!d)
        b->oom = true;
    return d;
}

/* Appends a family with no samples; NULL on out of memory. */
static Tandem__V1__MetricFamily *family(mb_t *b, const char *name, Tandem__V1__MetricType type,
                                        const char *help)
{
    Tandem__V1__MetricFamily *f = b->oom ? NULL : malloc(sizeof *f);
    Tandem__V1__MetricFamily **slot =
        f ? grow(b, &b->m->families, &b->m->n_families, sizeof *slot) : NULL;
    if (!slot) {
        free(f);
        b->oom = true;
        return NULL;
    }
    tandem__v1__metric_family__init(f);
    *slot = f;
    f->type = type;
    f->name = mb_strdup(b, name);
    f->help = mb_strdup(b, help);
    return f;
}

/* Appends an unlabelled sample to f; NULL on out of memory (or f NULL). */
static Tandem__V1__MetricSample *sample(mb_t *b, Tandem__V1__MetricFamily *f)
{
    Tandem__V1__MetricSample *s = f && !b->oom ? malloc(sizeof *s) : NULL;
    Tandem__V1__MetricSample **slot = s ? grow(b, &f->samples, &f->n_samples, sizeof *slot) : NULL;
    if (!slot) {
        free(s);
        b->oom = true;
        return NULL;
    }
    tandem__v1__metric_sample__init(s);
    *slot = s;
    return s;
}

static void label(mb_t *b, Tandem__V1__MetricSample *s, const char *name, const char *value)
{
    Tandem__V1__MetricLabel *l = s && !b->oom ? malloc(sizeof *l) : NULL;
    Tandem__V1__MetricLabel **slot = l ? grow(b, &s->labels, &s->n_labels, sizeof *slot) : NULL;
    if (!slot) {
        free(l);
        b->oom = true;
        return;
    }
    tandem__v1__metric_label__init(l);
    *slot = l;
    l->name = mb_strdup(b, name);
    l->value = mb_strdup(b, value);
}

static void set_int(Tandem__V1__MetricSample *s, uint64_t v)
{
    if (!s)
        return;
    s->value_case = TANDEM__V1__METRIC_SAMPLE__VALUE_INT_VALUE;
    s->int_value = v;
}

static void set_float(Tandem__V1__MetricSample *s, double v)
{
    if (!s)
        return;
    s->value_case = TANDEM__V1__METRIC_SAMPLE__VALUE_FLOAT_VALUE;
    s->float_value = v;
}

/* ---- families ---- */

static void counter(mb_t *b, const char *name, const char *help, uint64_t v)
{
    set_int(sample(b, family(b, name, TANDEM__V1__METRIC_TYPE__METRIC_TYPE_COUNTER, help)), v);
}

static void gauge(mb_t *b, const char *name, const char *help, uint64_t v)
{
    set_int(sample(b, family(b, name, TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE, help)), v);
}

/* One histogram over n_bounds ascending bounds: count_of[0..n_bounds) per bucket, not
 * cumulative (the +Inf bucket is the rest of count); NULL on out of memory. */
static Tandem__V1__MetricFamily *histogram_counts(mb_t *b, const char *name, const char *help,
                                                  const double *bound, size_t n_bounds,
                                                  const uint64_t *count_of, uint64_t count,
                                                  double sum)
{
    Tandem__V1__MetricFamily *f =
        family(b, name, TANDEM__V1__METRIC_TYPE__METRIC_TYPE_HISTOGRAM, help);
    Tandem__V1__MetricHistogram *mh = f ? malloc(sizeof *mh) : NULL;
    double *bounds = mh ? malloc(n_bounds * sizeof *bounds) : NULL;
    uint64_t *counts = bounds ? malloc(n_bounds * sizeof *counts) : NULL;
    if (!counts) {
        free(mh);
        free(bounds);
        b->oom = true;
        return NULL;
    }
    tandem__v1__metric_histogram__init(mh);
    memcpy(bounds, bound, n_bounds * sizeof *bounds);
    memcpy(counts, count_of, n_bounds * sizeof *counts);
    mh->n_bounds = mh->n_counts = n_bounds;
    mh->bounds = bounds;
    mh->counts = counts;
    mh->sum = sum;
    mh->count = count;
    f->histogram = mh;
    return f;
}

/* One histogram over bounds (TDM_ROUTER_HIST_BUCKETS - 1 of them; the last bucket, +Inf, is
 * count's); NULL on out of memory. */
static Tandem__V1__MetricFamily *histogram_over(mb_t *b, const char *name, const char *help,
                                                const tdm_router_hist_t *h, const double *bound)
{
    return histogram_counts(b, name, help, bound, TDM_ROUTER_HIST_BUCKETS - 1, h->buckets, h->count,
                            h->sum);
}

/* The tokens-per-forward-pass histogram of m (its iteration_* figures); NULL on out of
 * memory. */
static Tandem__V1__MetricFamily *histogram_iterations(mb_t *b, const char *name, const char *help,
                                                      const tdm_router_metrics_t *m)
{
    uint64_t count = 0;
    for (size_t i = 0; i < TDM_WORKER_ITERATION_BUCKETS; i++)
        count += m->iteration_counts[i];
    return histogram_counts(b, name, help, tdm_worker_iteration_bounds(),
                            TDM_WORKER_ITERATION_BOUNDS, m->iteration_counts, count,
                            (double)m->iteration_tokens);
}

/* c's counters at least those of l (a counter only grows: an older beat lowers nothing). */
static void counters_max(rt_node_counters_t *c, const tdm_node_load_t *l)
{
#define COUNTER_MAX(f)                                                                             \
    do {                                                                                           \
        if (l->f > c->f)                                                                           \
            c->f = l->f;                                                                           \
    } while (0)
    COUNTER_MAX(prefix_queries);
    COUNTER_MAX(prefix_hits);
    COUNTER_MAX(spec_drafts);
    COUNTER_MAX(spec_draft_tokens);
    COUNTER_MAX(spec_accepted_tokens);
    COUNTER_MAX(stale_router_frames);
    COUNTER_MAX(process_cpu_seconds);
#undef COUNTER_MAX
}

/* A node process ended: what it counted joins the sums of the earlier ones. */
static void counters_retire(rt_node_t *n)
{
    rt_node_counters_t *d = &n->counters_done, *c = &n->counters_now;
    d->prefix_queries += c->prefix_queries;
    d->prefix_hits += c->prefix_hits;
    d->spec_drafts += c->spec_drafts;
    d->spec_draft_tokens += c->spec_draft_tokens;
    d->spec_accepted_tokens += c->spec_accepted_tokens;
    d->stale_router_frames += c->stale_router_frames;
    d->process_cpu_seconds += c->process_cpu_seconds;
    memset(c, 0, sizeof *c);
}

void rt_metrics_iterations(tdm_router_t *r, rt_node_t *n, uint64_t instance_id)
{
    if (n->iter_instance != instance_id) { /* a new process: it counts from 0 */
        n->iter_instance = instance_id;
        memset(n->iter_counts, 0, sizeof n->iter_counts);
        n->iter_tokens = 0;
        counters_retire(n);
    }
    counters_max(&n->counters_now, &n->load);
    tdm_router_metrics_t *m = &r->metrics, *mm = &n->model->metrics;
    for (size_t i = 0; i < TDM_WORKER_ITERATION_BUCKETS; i++) {
        uint64_t now = n->load.iteration_counts[i];
        if (now > n->iter_counts[i]) { /* a counter only grows: an older beat adds nothing */
            m->iteration_counts[i] += now - n->iter_counts[i];
            mm->iteration_counts[i] += now - n->iter_counts[i];
            n->iter_counts[i] = now;
        }
    }
    if (n->load.iteration_tokens > n->iter_tokens) {
        m->iteration_tokens += n->load.iteration_tokens - n->iter_tokens;
        mm->iteration_tokens += n->load.iteration_tokens - n->iter_tokens;
        n->iter_tokens = n->load.iteration_tokens;
    }
}

/* One histogram over the first n of bound (at most TDM_ROUTER_HIST_BUCKETS - 1; what lies
 * above bound[n - 1] falls in +Inf); NULL on out of memory. */
static Tandem__V1__MetricFamily *histogram_over_n(mb_t *b, const char *name, const char *help,
                                                  const tdm_router_hist_t *h, const double *bound,
                                                  size_t n)
{
    return histogram_counts(b, name, help, bound, n, h->buckets, h->count, h->sum);
}

/* One histogram in seconds over tdm_router_hist_bounds. */
static void histogram(mb_t *b, const char *name, const char *help, const tdm_router_hist_t *h)
{
    histogram_over(b, name, help, h, tdm_router_hist_bounds());
}

static void hlabel(mb_t *b, Tandem__V1__MetricFamily *f, const char *name, const char *value);

/* ---- the tandem_ request families per model ----
 * A cluster of one model keeps the series it always had (no model_name label: the figures are
 * the cluster's). With several models the request, token and latency families have one series
 * per model labelled model_name (the request's model; each model's figures are written with
 * the cluster's, so the model series sum to the cluster's), as vLLM's do; a node family gets
 * the node's model. Families counted before a request's model is known (received, refused at
 * intake) stay cluster-wide. */

/* The requests of each model (by rt_model_t.index) now: queued ones wait, the others run
 * (reserving or running). */
#define HELP_RUNNING                                                                               \
    "Requests dispatched to nodes (reserving KV blocks or running; embedding requests with an "    \
    "input on a node)."
#define HELP_QUEUED                                                                                \
    "Requests waiting in the router's queue for a node (embedding requests none of whose inputs "  \
    "is on a node yet)."

static void count_model_requests(const tdm_router_t *r, size_t *running, size_t *waiting)
{
    for (tdm_list_t *e = tdm_list_first(&r->requests); e; e = tdm_list_next(&r->requests, e)) {
        const rt_req_t *q = TDM_LIST_ENTRY(e, rt_req_t, all_link);
        if (q->state == RT_QUEUED && tdm_list_is_linked(&q->queue_link))
            waiting[q->model->index]++;
        else
            running[q->model->index]++;
    }
    for (size_t i = 0; i < r->n_models; i++) { /* EMBED calls count as requests too */
        size_t er, eq;
        rt_embed_count(r, &r->models[i], &er, &eq);
        running[i] += er;
        waiting[i] += eq;
    }
}

/* Whether the tandem_ families carry model_name. */
static bool per_model(const tdm_router_t *r)
{
    return r->n_models > 1;
}

/* A counter family at offset off of the metrics: one sample, or one per model. */
static void mcounter(mb_t *b, const tdm_router_t *r, const char *name, const char *help, size_t off)
{
    if (!per_model(r)) {
        counter(b, name, help, METRIC_U64(&r->metrics, off));
        return;
    }
    Tandem__V1__MetricFamily *f = family(b, name, METRIC_COUNTER, help);
    for (size_t i = 0; i < r->n_models; i++) {
        Tandem__V1__MetricSample *s = sample(b, f);
        label(b, s, "model_name", r->models[i].cfg->name);
        set_int(s, METRIC_U64(&r->models[i].metrics, off));
    }
}

/* A histogram at offset off over the first n of bound: one, or one per model (each its own
 * MetricFamily of the same name, one after the other; the text format joins them). */
static void mhist_n(mb_t *b, const tdm_router_t *r, const char *name, const char *help, size_t off,
                    const double *bound, size_t n)
{
    if (!per_model(r)) {
        histogram_over_n(b, name, help, METRIC_HIST(&r->metrics, off), bound, n);
        return;
    }
    for (size_t i = 0; i < r->n_models; i++)
        hlabel(b,
               histogram_over_n(b, name, help, METRIC_HIST(&r->models[i].metrics, off), bound, n),
               "model_name", r->models[i].cfg->name);
}

static void mhist(mb_t *b, const tdm_router_t *r, const char *name, const char *help, size_t off)
{
    mhist_n(b, r, name, help, off, tdm_router_hist_bounds(), TDM_ROUTER_HIST_BUCKETS - 1);
}

static void mhist_tokens(mb_t *b, const tdm_router_t *r, const char *name, const char *help,
                         size_t off)
{
    mhist_n(b, r, name, help, off, tdm_router_token_bounds(), TDM_ROUTER_HIST_BUCKETS - 1);
}

typedef enum node_set {
    NODES_ALL,               /* every configured node */
    NODES_REGISTERED,        /* nodes that registered at least once (their counters exist) */
    NODES_UP,                /* nodes up now (their load figures are current) */
    NODES_DECODE_REGISTERED, /* decode nodes that registered (the figures only they have) */
} node_set_t;

/* Whether n is in set. */
static bool node_in(const rt_node_t *n, node_set_t set)
{
    switch (set) {
    case NODES_ALL: return true;
    case NODES_REGISTERED: return n->registered;
    case NODES_UP: return n->up;
    case NODES_DECODE_REGISTERED: return n->registered && n->cfg->role == TDM_NODE_ROLE_DECODE;
    }
    return false;
}

typedef double (*node_value_fn)(const rt_node_t *n);

/* One per-node family: a sample labelled {node, role} (and model_name, the node's model, when
 * the cluster serves several) for each node of the set. */
static void node_family(mb_t *b, const tdm_router_t *r, const char *name,
                        Tandem__V1__MetricType type, const char *help, node_set_t set,
                        node_value_fn value)
{
    Tandem__V1__MetricFamily *f = family(b, name, type, help);
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (!node_in(n, set))
            continue;
        Tandem__V1__MetricSample *s = sample(b, f);
        label(b, s, "node", n->cfg->id);
        label(b, s, "role", tdm_config_node_role_name(n->cfg->role));
        if (per_model(r))
            label(b, s, "model_name", n->model->cfg->name);
        set_float(s, value(n));
    }
}

/* Node figures (all fit a double exactly: block counts are 32-bit, token and block counters
 * stay far below 2^53). */
static double nv_up(const rt_node_t *n)
{
    return n->up ? 1 : 0;
}
static double nv_suspect(const rt_node_t *n)
{
    return n->up && n->suspect ? 1 : 0;
}
static double nv_suspicions(const rt_node_t *n)
{
    return (double)n->suspicions;
}
static double nv_state(const rt_node_t *n)
{
    return !n->up ? 0 : n->suspect ? 1 : 2;
}
static double nv_failures(const rt_node_t *n)
{
    return (double)n->failures;
}
static double nv_prefix_queries(const rt_node_t *n)
{
    return (double)(n->counters_done.prefix_queries + n->counters_now.prefix_queries);
}
static double nv_prefix_hits(const rt_node_t *n)
{
    return (double)(n->counters_done.prefix_hits + n->counters_now.prefix_hits);
}
static double nv_stale_router_frames(const rt_node_t *n)
{
    return (double)(n->counters_done.stale_router_frames + n->counters_now.stale_router_frames);
}
static double nv_running(const rt_node_t *n)
{
    return n->load.running;
}
static double nv_waiting(const rt_node_t *n)
{
    return n->load.waiting;
}
static double nv_kv_used(const rt_node_t *n)
{
    return n->load.kv_blocks_used;
}
static double nv_kv_capacity(const rt_node_t *n)
{
    return n->kv_blocks_total;
}
static double nv_kv_cached(const rt_node_t *n)
{
    return n->load.kv_blocks_cached;
}
static double nv_kv_reserved(const rt_node_t *n)
{
    return (double)n->reserved_pending + n->reserved_acked;
}
static double nv_batch(const rt_node_t *n)
{
    return n->load.batch_size;
}
static double nv_queued_prefill(const rt_node_t *n)
{
    return (double)n->load.queued_prefill_tokens;
}
static double nv_step(const rt_node_t *n)
{
    return n->load.step_s;
}
static double nv_proc_rss(const rt_node_t *n)
{
    return (double)n->load.process_resident_bytes;
}
static double nv_proc_cpu(const rt_node_t *n)
{
    return n->counters_done.process_cpu_seconds + n->counters_now.process_cpu_seconds;
}
static double nv_proc_fds(const rt_node_t *n)
{
    return n->load.process_open_fds;
}
static double nv_kv_usage(const rt_node_t *n)
{
    return n->kv_blocks_total ? (double)n->load.kv_blocks_used / n->kv_blocks_total : 0;
}

/* The tandem_requests_total samples of m (model: its model_name label, NULL none). */
static void requests_by_status(mb_t *b, Tandem__V1__MetricFamily *f, const tdm_router_metrics_t *m,
                               const char *model, bool always_ok)
{
    for (size_t s = 0; s < 17; s++)
        for (size_t fr = 0; fr < 5; fr++) {
            uint64_t v = m->requests_by_status_finish[s][fr];
            /* the successful series always exist, so rate() sees their first increase */
            bool always = always_ok && s == 0 && (fr == 1 || fr == 2);
            if (v == 0 && !always)
                continue;
            Tandem__V1__MetricSample *smp = sample(b, f);
            if (model)
                label(b, smp, "model_name", model);
            label(b, smp, "status", tdm_status_name(-(int)s));
            label(b, smp, "finish_reason", tdm_proto_finish_name((int)fr));
            set_int(smp, v);
        }
}

/* tandem_requests_total by status and finish reason; with several models per model_name,
 * and the requests that ended before their model was known (an unknown model, a malformed
 * request) in series without model_name: the cluster's count less the models'. */
static void render_requests_by_status(mb_t *b, const tdm_router_t *r)
{
    Tandem__V1__MetricFamily *f =
        family(b, "tandem_requests_total", TANDEM__V1__METRIC_TYPE__METRIC_TYPE_COUNTER,
               "Generate requests that ended, by final gRPC status and finish reason (none: "
               "refused before it started).");
    if (!per_model(r)) {
        requests_by_status(b, f, &r->metrics, NULL, true);
        return;
    }
    for (size_t i = 0; i < r->n_models; i++)
        requests_by_status(b, f, &r->models[i].metrics, r->models[i].cfg->name, true);
    tdm_router_metrics_t rest; /* only requests_by_status_finish is read */
    memset(&rest, 0, sizeof rest);
    for (size_t s = 0; s < 17; s++)
        for (size_t fr = 0; fr < 5; fr++) {
            uint64_t v = r->metrics.requests_by_status_finish[s][fr];
            for (size_t i = 0; i < r->n_models; i++)
                v -= r->models[i].metrics.requests_by_status_finish[s][fr];
            rest.requests_by_status_finish[s][fr] = v;
        }
    requests_by_status(b, f, &rest, NULL, false);
}

/* The token, KV transfer and dropped-message counters. */
static void render_traffic(mb_t *b, const tdm_router_t *r)
{
    const tdm_router_metrics_t *m = &r->metrics;
    mcounter(b, r, "tandem_prompt_tokens_total",
             "Prompt tokens of the requests the router accepted.", MOFF(prompt_tokens));
    mcounter(b, r, "tandem_prompt_tokens_cached_total",
             "Prompt tokens the prefill nodes found in their prefix caches.",
             MOFF(cached_prompt_tokens));
    mcounter(b, r, "tandem_generation_tokens_total", "Output tokens delivered to clients.",
             MOFF(generation_tokens));
    counter(b, "tandem_kv_transfer_bytes_total",
            "KV cache bytes the decode nodes received from prefill nodes for requests that "
            "finished.",
            m->kv_transfer_bytes);
    counter(b, "tandem_kv_transfer_failures_total",
            "KV transfers that failed: retryable failures a prefill node reported after its first "
            "token, or a decode node before the KV arrived.",
            m->kv_transfer_failures);
    Tandem__V1__MetricFamily *ef =
        family(b, "tandem_embedding_requests_total", TANDEM__V1__METRIC_TYPE__METRIC_TYPE_COUNTER,
               "Embedding requests (/v1/embeddings, EMBED) that ended, by final gRPC status.");
    for (size_t s = 0; s < 17; s++)
        if (m->embed_requests_by_status[s] || s == 0) {
            Tandem__V1__MetricSample *smp = sample(b, ef);
            label(b, smp, "status", tdm_status_name(-(int)s));
            set_int(smp, m->embed_requests_by_status[s]);
        }
    counter(
        b, "tandem_embedding_prompt_tokens_total",
        "Prompt tokens of the embedding requests answered (also in tandem_prompt_tokens_total).",
        m->embed_prompt_tokens);
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
}

static void render_requests(mb_t *b, const tdm_router_t *r)
{
    const tdm_router_metrics_t *m = &r->metrics;
    counter(b, "tandem_requests_received_total",
            "Generate requests received by the router, valid or not.", m->requests_total);
    render_requests_by_status(b, r);
    counter(b, "tandem_requests_redispatched_total",
            "Requests dispatched again after a retryable node failure or the loss of their "
            "prefill node.",
            m->redispatches);
    counter(b, "tandem_requests_migrated_total",
            "Re-dispatches that resumed a request after the output tokens already delivered "
            "(its decode node was lost mid-stream): the new attempt prefills prompt + delivered "
            "output and continues at the next token index.",
            m->migrations);
    mcounter(b, r, "tandem_requests_queue_full_total",
             "Requests refused with RESOURCE_EXHAUSTED because the router's queue was full.",
             MOFF(queue_full));
    mcounter(b, r, "tandem_requests_shed_total",
             "Requests refused with RESOURCE_EXHAUSTED before dispatch because no decode node up "
             "could finish them before their deadline (admission control).",
             MOFF(shed));
    counter(b, "tandem_decode_reserve_rejections_total",
            "KV reservations a decode node refused for lack of blocks (the router then tries "
            "another node or queues the request).",
            m->reserve_rejects);
    counter(b, "tandem_duplicate_token_events_total",
            "Token events dropped because their index had already been delivered.",
            m->duplicate_events);
    render_traffic(b, r);
    size_t er, eq;
    rt_embed_count(r, NULL, &er, &eq);
    if (!per_model(r)) {
        gauge(b, "tandem_requests_running", HELP_RUNNING, (uint64_t)(r->n_reqs - r->n_queued + er));
        gauge(b, "tandem_requests_queued", HELP_QUEUED, (uint64_t)(r->n_queued + eq));
        return;
    }
    size_t running[TDM_CONFIG_MAX_MODELS] = {0}, waiting[TDM_CONFIG_MAX_MODELS] = {0};
    count_model_requests(r, running, waiting);
    Tandem__V1__MetricFamily *fr = family(b, "tandem_requests_running", METRIC_GAUGE, HELP_RUNNING);
    Tandem__V1__MetricFamily *fq = family(b, "tandem_requests_queued", METRIC_GAUGE, HELP_QUEUED);
    for (size_t i = 0; i < r->n_models; i++) {
        Tandem__V1__MetricSample *s = sample(b, fr);
        label(b, s, "model_name", r->models[i].cfg->name);
        set_int(s, running[i]);
        s = sample(b, fq);
        label(b, s, "model_name", r->models[i].cfg->name);
        set_int(s, waiting[i]);
    }
}

#define ITERATION_HELP                                                                             \
    "Tokens (rows) per forward pass over every node, prompt chunks and decode steps alike (from "  \
    "the nodes' heartbeats)."

static void render_histograms(mb_t *b, const tdm_router_t *r)
{
    mhist(b, r, "tandem_time_to_first_token_seconds",
          "From the request's arrival to its first token leaving the router.", MOFF(ttft));
    mhist(b, r, "tandem_inter_token_latency_seconds",
          "Between consecutive tokens of a request as the router forwards them.", MOFF(itl));
    mhist(b, r, "tandem_time_per_output_token_seconds",
          "Per completed request with 2 or more tokens: first to last token divided by the "
          "tokens after the first.",
          MOFF(tpot));
    mhist(b, r, "tandem_e2e_request_latency_seconds",
          "From the request's arrival to its final message (completed or failed).", MOFF(e2e));
    mhist(b, r, "tandem_request_queue_time_seconds",
          "From the request's arrival until a decode node acknowledged its reservation (the "
          "prefill task went with it).",
          MOFF(queue));
    mhist(b, r, "tandem_request_prefill_time_seconds",
          "Prefill compute time of a request, measured by its prefill node.", MOFF(prefill));
    mhist(b, r, "tandem_kv_transfer_time_seconds",
          "KV transfer time of a completed request: the prefill node's send until the decode "
          "node acknowledged (the decode node's estimate when that did not arrive).",
          MOFF(kv_transfer));
    histogram(b, "tandem_decode_reserve_seconds",
              "From a DecodeReserve sent until its answer (acknowledged or refused) reached the "
              "router; the prefill runs meanwhile.",
              &r->metrics.reserve);
    mhist(b, r, "tandem_request_decode_time_seconds",
          "Per completed request: its first to its last token leaving the router.", MOFF(decode));
    mhist(b, r, "tandem_request_inference_time_seconds",
          "Per completed request: from its reservation's acknowledgement to its final "
          "message.",
          MOFF(inference));
}

/* The histograms of token counts per request and call. */
static void render_token_histograms(mb_t *b, const tdm_router_t *r)
{
    mhist_tokens(b, r, "tandem_request_prompt_tokens", "Prompt tokens of each completed request.",
                 MOFF(prompt_len));
    mhist_tokens(b, r, "tandem_request_generation_tokens",
                 "Output tokens of each completed request.", MOFF(generation_len));
    mhist_tokens(b, r, "tandem_request_max_generation_tokens",
                 "The most output tokens of any choice of each completed call (n > 1: the "
                 "longest choice).",
                 MOFF(max_generation_len));
    mhist_tokens(b, r, "tandem_request_preemptions",
                 "Times each completed request was preempted on its decode node.",
                 MOFF(preemptions_per_request));
    if (!per_model(r))
        histogram_iterations(b, "tandem_iteration_tokens", ITERATION_HELP, &r->metrics);
    for (size_t i = 0; per_model(r) && i < r->n_models; i++)
        hlabel(b,
               histogram_iterations(b, "tandem_iteration_tokens", ITERATION_HELP,
                                    &r->models[i].metrics),
               "model_name", r->models[i].cfg->name);
    mhist_n(b, r, "tandem_request_params_n",
            "Choices (n) of each accepted GENERATE call; each choice is a request.", MOFF(params_n),
            tdm_router_token_bounds(), 5);
    mhist_tokens(b, r, "tandem_request_params_max_tokens",
                 "max_tokens of each accepted GENERATE call, as the router resolved it.",
                 MOFF(params_max_tokens));
    mcounter(b, r, "tandem_preemptions_total",
             "Preemptions of completed requests on their decode nodes (a sequence set aside for "
             "lack of KV blocks and resumed later).",
             MOFF(preemptions));
}

/* The node processes' own figures, from their heartbeats (protocol 1.6). */
static void render_node_processes(mb_t *b, const tdm_router_t *r)
{
    node_family(b, r, "tandem_node_process_resident_memory_bytes", METRIC_GAUGE,
                "Resident memory of the node process in bytes (last heartbeat).", NODES_UP,
                nv_proc_rss);
    node_family(b, r, "tandem_node_process_cpu_seconds_total", METRIC_COUNTER,
                "User and system CPU time of the node process in seconds (last heartbeat).",
                NODES_UP, nv_proc_cpu);
    node_family(b, r, "tandem_node_process_open_fds", METRIC_GAUGE,
                "Open file descriptors of the node process (last heartbeat).", NODES_UP,
                nv_proc_fds);
}

static void render_nodes(mb_t *b, const tdm_router_t *r)
{
    node_family(b, r, "tandem_node_up", METRIC_GAUGE,
                "1 when the configured node is registered and heartbeating, else 0.", NODES_ALL,
                nv_up);
    node_family(b, r, "tandem_node_suspect", METRIC_GAUGE,
                "1 when the node is up but silent for the heartbeat timeout (no new work goes to "
                "it; down after twice the timeout), else 0.",
                NODES_ALL, nv_suspect);
    node_family(b, r, "tandem_node_state", METRIC_GAUGE,
                "The router's view of the node: 0 down (or never registered), 1 suspect, 2 up.",
                NODES_ALL, nv_state);
    node_family(b, r, "tandem_node_suspicions_total", METRIC_COUNTER,
                "Times the router marked the node suspect (silent for the heartbeat timeout).",
                NODES_ALL, nv_suspicions);
    node_family(b, r, "tandem_node_failures_total", METRIC_COUNTER,
                "Times the router marked the node down (heartbeat timeout or restart).", NODES_ALL,
                nv_failures);
    node_family(b, r, "tandem_prefix_cache_queries_total", METRIC_COUNTER,
                "KV blocks the node looked up in its prefix cache (cumulative per node process, "
                "from its heartbeats).",
                NODES_REGISTERED, nv_prefix_queries);
    node_family(b, r, "tandem_prefix_cache_hits_total", METRIC_COUNTER,
                "KV blocks the node found in its prefix cache (cumulative per node process, from "
                "its heartbeats).",
                NODES_REGISTERED, nv_prefix_hits);
    node_family(b, r, "tandem_node_stale_router_frames_total", METRIC_COUNTER,
                "Frames from a router instance other than the one the node registered with (a "
                "restarted router's, a stray peer's) that the node dropped (cumulative per node "
                "process, from its heartbeats).",
                NODES_REGISTERED, nv_stale_router_frames);
    node_family(b, r, "tandem_node_running", METRIC_GAUGE,
                "Sequences the node is running (last heartbeat).", NODES_UP, nv_running);
    node_family(b, r, "tandem_node_waiting", METRIC_GAUGE,
                "Sequences waiting on the node for room (last heartbeat).", NODES_UP, nv_waiting);
    node_family(b, r, "tandem_node_kv_blocks_used", METRIC_GAUGE,
                "KV blocks in use by sequences on the node (last heartbeat).", NODES_UP,
                nv_kv_used);
    node_family(b, r, "tandem_node_kv_blocks_capacity", METRIC_GAUGE,
                "KV blocks in the node's pool (from its registration).", NODES_UP, nv_kv_capacity);
    node_family(b, r, "tandem_node_kv_blocks_cached", METRIC_GAUGE,
                "KV blocks held only by the node's prefix cache, free to evict (last heartbeat).",
                NODES_UP, nv_kv_cached);
    node_family(b, r, "tandem_node_kv_blocks_reserved", METRIC_GAUGE,
                "Decode KV blocks the router reserved on the node that its last heartbeat does "
                "not show yet.",
                NODES_UP, nv_kv_reserved);
    node_family(b, r, "tandem_node_batch_size", METRIC_GAUGE,
                "Sequences in the node's last forward pass (last heartbeat).", NODES_UP, nv_batch);
    node_family(b, r, "tandem_node_queued_prefill_tokens", METRIC_GAUGE,
                "Prompt tokens queued for prefill on the node (last heartbeat).", NODES_UP,
                nv_queued_prefill);
    node_family(b, r, "tandem_node_kv_cache_usage_ratio", METRIC_GAUGE,
                "KV blocks in use by sequences over the node's pool, 0..1 (last heartbeat).",
                NODES_UP, nv_kv_usage);
    node_family(b, r, "tandem_node_step_time_seconds", METRIC_GAUGE,
                "Mean duration of the node's recent forward passes (last heartbeat).", NODES_UP,
                nv_step);
}

/* The router loop's own figures: iteration times and the stalls not charged to the nodes. */
static void render_loop(mb_t *b, const tdm_router_t *r)
{
    const tdm_router_metrics_t *m = &r->metrics;
    histogram(b, "tandem_router_loop_seconds",
              "Duration of each router loop iteration: handling what one poll returned, then the "
              "timers (not the wait).",
              &m->loop);
    Tandem__V1__MetricFamily *f =
        family(b, "tandem_router_loop_max_seconds", METRIC_GAUGE,
               "The longest router loop iteration since the router started.");
    set_float(sample(b, f), m->loop_max_s);
    counter(b, "tandem_router_loop_stalls_total",
            "Liveness checks that came more than a heartbeat interval (at least 100 ms) after the "
            "previous one: the router loop was stalled, and the excess was not counted against "
            "the nodes' heartbeat silence.",
            m->loop_stalls);
    f = family(b, "tandem_router_loop_stall_seconds_total", METRIC_COUNTER,
               "The time of those stalls that was not counted against the nodes.");
    set_float(sample(b, f), m->loop_stall_s);
}

/* tandem_build_info{version, model} 1, a sample per served model. */
static void render_build_info(mb_t *b, const tdm_router_t *r)
{
    Tandem__V1__MetricFamily *f =
        family(b, "tandem_build_info", TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE,
               "Always 1; the labels carry the router's version and a served model (one sample "
               "per model).");
    for (size_t i = 0; i < r->n_models; i++) {
        Tandem__V1__MetricSample *s = sample(b, f);
        label(b, s, "version", TANDEM_VERSION);
        label(b, s, "model", r->models[i].cfg->name);
        set_int(s, 1);
    }
}

/* ---- process metrics (the router's own process, from /proc/self) ---- */

static void float_family(mb_t *b, const char *name, Tandem__V1__MetricType type, const char *help,
                         double v)
{
    set_float(sample(b, family(b, name, type, help)), v);
}

static void render_process(mb_t *b)
{
    tdm_process_stats_t ps;
    if (!tdm_process_stats(&ps))
        return;
    float_family(b, "process_resident_memory_bytes", METRIC_GAUGE,
                 "Resident memory size of the router process in bytes.", (double)ps.resident_bytes);
    float_family(b, "process_cpu_seconds_total", METRIC_COUNTER,
                 "User and system CPU time of the router process in seconds.", ps.cpu_seconds);
    float_family(b, "process_open_fds", METRIC_GAUGE,
                 "Open file descriptors of the router process.", ps.open_fds);
    float_family(b, "process_max_fds", METRIC_GAUGE,
                 "The router process's limit of open file descriptors.", (double)ps.max_fds);
    float_family(b, "process_start_time_seconds", METRIC_GAUGE,
                 "Start time of the router process since the Unix epoch in seconds.",
                 ps.start_time_s);
}

/* ---- vLLM-compatible series (router.metrics_compat: vllm) ----
 * vLLM 0.33.0's names, types and labels (vllm/v1/metrics/loggers.py; the list and what has no
 * meaning here: tests/vllm_metrics.tsv). Labels: model_name (the served model) and engine:
 * "0" for the router's figures (the whole cluster), the node id for a node's own. */

typedef struct vctx {
    mb_t *b;
    const char *model; /* the model_name label of the samples made now */
} vctx_t;

/* A sample of f labelled {model_name, engine}. */
static Tandem__V1__MetricSample *vsample(vctx_t *v, Tandem__V1__MetricFamily *f, const char *engine)
{
    Tandem__V1__MetricSample *s = sample(v->b, f);
    label(v->b, s, "model_name", v->model);
    label(v->b, s, "engine", engine);
    return s;
}

/* One counter family, a sample per model (its figure at offset off of the model's metrics). */
static void vcounter(vctx_t *v, const tdm_router_t *r, const char *name, const char *help,
                     size_t off)
{
    Tandem__V1__MetricFamily *f = family(v->b, name, METRIC_COUNTER, help);
    for (size_t i = 0; i < r->n_models; i++) {
        v->model = r->models[i].cfg->name;
        set_int(vsample(v, f, "0"), METRIC_U64(&r->models[i].metrics, off));
    }
}

static void hlabel(mb_t *b, Tandem__V1__MetricFamily *f, const char *name, const char *value)
{
    Tandem__V1__MetricLabel *l = f && !b->oom ? malloc(sizeof *l) : NULL;
    Tandem__V1__MetricLabel **slot =
        l ? grow(b, &f->histogram_labels, &f->n_histogram_labels, sizeof *slot) : NULL;
    if (!slot) {
        free(l);
        b->oom = true;
        return;
    }
    tandem__v1__metric_label__init(l);
    *slot = l;
    l->name = mb_strdup(b, name);
    l->value = mb_strdup(b, value);
}

/* One histogram per model over the first n of bounds, each its own MetricFamily of the same
 * name one after the other (tdm_proto_metrics_text writes them as one family). */
static void vhist_n(vctx_t *v, const tdm_router_t *r, const char *name, const char *help,
                    size_t off, const double *bounds, size_t n)
{
    for (size_t i = 0; i < r->n_models; i++) {
        Tandem__V1__MetricFamily *f =
            histogram_over_n(v->b, name, help, METRIC_HIST(&r->models[i].metrics, off), bounds, n);
        hlabel(v->b, f, "model_name", r->models[i].cfg->name);
        hlabel(v->b, f, "engine", "0");
    }
}

static void vhist(vctx_t *v, const tdm_router_t *r, const char *name, const char *help, size_t off,
                  const double *bounds)
{
    vhist_n(v, r, name, help, off, bounds, TDM_ROUTER_HIST_BUCKETS - 1);
}

/* A per-node family labelled {model_name: the node's model, engine: node id, role} over the
 * nodes of set. */
static void vnode_family(vctx_t *v, const tdm_router_t *r, const char *name,
                         Tandem__V1__MetricType type, const char *help, node_set_t set,
                         node_value_fn value)
{
    Tandem__V1__MetricFamily *f = family(v->b, name, type, help);
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (!node_in(n, set))
            continue;
        /* the role too, so that a prefill node's figures are not averaged into the decode
         * pool's (vllm:kv_cache_usage_perc) */
        v->model = n->model->cfg->name;
        Tandem__V1__MetricSample *s = vsample(v, f, n->cfg->id);
        label(v->b, s, "role", tdm_config_node_role_name(n->cfg->role));
        set_float(s, value(n));
    }
}

/* vllm:request_success_total{finished_reason}: stop and length (completed), abort
 * (cancelled), error (failed); vLLM's "repetition" has no counterpart. Per model. */
static void vllm_success(vctx_t *v, const tdm_router_t *r)
{
    static const struct {
        const char *name;
        int status, finish;
    } reasons[] = {
        {"stop", 0, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP},
        {"length", 0, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH},
        {"abort", -1, TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED},
        {"error", -1, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR},
    };
    Tandem__V1__MetricFamily *f = family(v->b, "vllm:request_success_total", METRIC_COUNTER,
                                         "Count of finished requests by finished_reason.");
    for (size_t k = 0; k < r->n_models; k++) {
        const tdm_router_metrics_t *m = &r->models[k].metrics;
        v->model = r->models[k].cfg->name;
        for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++) {
            uint64_t n = 0;
            for (int s = 0; s < 17; s++)
                if (reasons[i].status == -1 || s == reasons[i].status)
                    n += m->requests_by_status_finish[s][reasons[i].finish];
            Tandem__V1__MetricSample *smp = vsample(v, f, "0");
            label(v->b, smp, "finished_reason", reasons[i].name);
            set_int(smp, n);
        }
    }
}

/* The counters by source and the refusals by reason, per model. */
static void vllm_labelled_counters(vctx_t *v, const tdm_router_t *r)
{
    Tandem__V1__MetricFamily *f =
        family(v->b, "vllm:prompt_tokens_by_source_total", METRIC_COUNTER,
               "Number of prompt tokens by source (local_compute: prefilled, local_cache_hit: "
               "found in a prefill node's prefix cache).");
    for (size_t k = 0; k < r->n_models; k++) {
        const tdm_router_metrics_t *m = &r->models[k].metrics;
        v->model = r->models[k].cfg->name;
        Tandem__V1__MetricSample *s = vsample(v, f, "0");
        label(v->b, s, "source", "local_compute");
        /* counted when the first token arrives, as the cache hits are: prompt_tokens (counted
         * at acceptance) minus the hits would go back whenever hits arrive between two
         * scrapes */
        set_int(s, m->computed_prompt_tokens);
        s = vsample(v, f, "0");
        label(v->b, s, "source", "local_cache_hit");
        set_int(s, m->cached_prompt_tokens);
    }
    f = family(v->b, "vllm:admission_rejections_total", METRIC_COUNTER,
               "Requests refused before they ran, by reason (queue_full: the router's queue, "
               "deadline: admission control).");
    for (size_t k = 0; k < r->n_models; k++) {
        const tdm_router_metrics_t *m = &r->models[k].metrics;
        Tandem__V1__MetricSample *s = sample(v->b, f);
        label(v->b, s, "model_name", r->models[k].cfg->name);
        label(v->b, s, "reason", "queue_full");
        set_int(s, m->queue_full);
        s = sample(v->b, f);
        label(v->b, s, "model_name", r->models[k].cfg->name);
        label(v->b, s, "reason", "deadline");
        set_int(s, m->shed);
    }
}

static void vllm_counters(vctx_t *v, const tdm_router_t *r)
{
    vcounter(v, r, "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
             offsetof(tdm_router_metrics_t, preemptions));
    vcounter(v, r, "vllm:prompt_tokens_total", "Number of prefill tokens processed.",
             offsetof(tdm_router_metrics_t, prompt_tokens));
    vcounter(v, r, "vllm:prompt_tokens_cached_total",
             "Number of cached prompt tokens (local prefix cache).",
             offsetof(tdm_router_metrics_t, cached_prompt_tokens));
    vcounter(v, r, "vllm:generation_tokens_total", "Number of generation tokens processed.",
             offsetof(tdm_router_metrics_t, generation_tokens));
    vllm_success(v, r);
    vllm_labelled_counters(v, r);
    vnode_family(v, r, "vllm:prefix_cache_queries_total", METRIC_COUNTER,
                 "Prefix cache queries, in KV blocks (vLLM counts tokens), per node.",
                 NODES_REGISTERED, nv_prefix_queries);
    vnode_family(v, r, "vllm:prefix_cache_hits_total", METRIC_COUNTER,
                 "Prefix cache hits, in KV blocks (vLLM counts tokens), per node.",
                 NODES_REGISTERED, nv_prefix_hits);
}

static void vllm_gauges(vctx_t *v, const tdm_router_t *r)
{
    size_t running[TDM_CONFIG_MAX_MODELS] = {0}, waiting[TDM_CONFIG_MAX_MODELS] = {0};
    count_model_requests(r, running, waiting);
    Tandem__V1__MetricFamily *fr = family(v->b, "vllm:num_requests_running", METRIC_GAUGE,
                                          "Number of requests in model execution batches.");
    for (size_t i = 0; i < r->n_models; i++) {
        v->model = r->models[i].cfg->name;
        set_float(vsample(v, fr, "0"), (double)running[i]);
    }
    Tandem__V1__MetricFamily *fw = family(v->b, "vllm:num_requests_waiting", METRIC_GAUGE,
                                          "Number of requests waiting to be processed.");
    for (size_t i = 0; i < r->n_models; i++) {
        v->model = r->models[i].cfg->name;
        set_float(vsample(v, fw, "0"), (double)waiting[i]);
    }
    vnode_family(v, r, "vllm:kv_cache_usage_perc", METRIC_GAUGE,
                 "KV-cache usage. 1 means 100 percent usage (per node up, last heartbeat; the "
                 "role label tells the decode pool from the prefill nodes' caches).",
                 NODES_UP, nv_kv_usage);
    const tdm_kv_config_t *kv = &r->cfg->kv;
    Tandem__V1__MetricFamily *f = family(v->b, "vllm:cache_config_info", METRIC_GAUGE,
                                         "Information of the LLMEngine CacheConfig");
    Tandem__V1__MetricSample *s = sample(v->b, f);
    char bs[16];
    snprintf(bs, sizeof bs, "%d", kv->block_size);
    label(v->b, s, "block_size", bs);
    label(v->b, s, "cache_dtype", tdm_kv_dtype_name(kv->dtype));
    label(v->b, s, "enable_prefix_caching", kv->prefix_caching ? "True" : "False");
    label(v->b, s, "engine", "0");
    set_int(s, 1);
}

#define HIST(field) offsetof(tdm_router_metrics_t, field)

static void vllm_histograms(vctx_t *v, const tdm_router_t *r)
{
    const double *sec = tdm_router_hist_bounds(), *tok = tdm_router_token_bounds();
    vhist(v, r, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
          HIST(ttft), sec);
    vhist(v, r, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
          HIST(itl), sec);
    vhist(v, r, "vllm:request_time_per_output_token_seconds",
          "Histogram of time_per_output_token_seconds per request.", HIST(tpot), sec);
    vhist(v, r, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
          HIST(e2e), sec);
    vhist(v, r, "vllm:request_queue_time_seconds",
          "Histogram of time spent in WAITING phase for request.", HIST(queue), sec);
    vhist(v, r, "vllm:request_inference_time_seconds",
          "Histogram of time spent in RUNNING phase for request.", HIST(inference), sec);
    vhist(v, r, "vllm:request_prefill_time_seconds",
          "Histogram of time spent in PREFILL phase for request.", HIST(prefill), sec);
    vhist(v, r, "vllm:request_decode_time_seconds",
          "Histogram of time spent in DECODE phase for request.", HIST(decode), sec);
    vhist(v, r, "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
          HIST(prompt_len), tok);
    vhist(v, r, "vllm:request_generation_tokens", "Number of generation tokens processed.",
          HIST(generation_len), tok);
    vhist(v, r, "vllm:request_max_num_generation_tokens",
          "Histogram of maximum number of requested generation tokens.", HIST(max_generation_len),
          tok);
    vhist(v, r, "vllm:request_num_preemptions",
          "Histogram of the number of times a request was preempted.",
          HIST(preemptions_per_request), tok);
    for (size_t i = 0; i < r->n_models; i++) {
        Tandem__V1__MetricFamily *f = histogram_iterations(
            v->b, "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            &r->models[i].metrics);
        hlabel(v->b, f, "model_name", r->models[i].cfg->name);
        hlabel(v->b, f, "engine", "0");
    }
    /* vLLM's REQUEST_PARAMS_N_BUCKETS (1, 2, 5, 10, 20) are the first five token bounds */
    vhist_n(v, r, "vllm:request_params_n", "Histogram of the n request parameter.", HIST(params_n),
            tok, 5);
    vhist(v, r, "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
          HIST(params_max_tokens), tok);
}

#undef HIST

/* ---- speculative decoding (the decode nodes' worker counters, from heartbeats) ---- */

static double nv_spec_drafts(const rt_node_t *n)
{
    return (double)(n->counters_done.spec_drafts + n->counters_now.spec_drafts);
}
static double nv_spec_draft_tokens(const rt_node_t *n)
{
    return (double)(n->counters_done.spec_draft_tokens + n->counters_now.spec_draft_tokens);
}
static double nv_spec_accepted_tokens(const rt_node_t *n)
{
    return (double)(n->counters_done.spec_accepted_tokens + n->counters_now.spec_accepted_tokens);
}

/* tandem_spec_decode_*: drafts verified, draft tokens proposed and accepted, per decode node
 * (a prefill node never drafts: no series that would always read 0). */
static void render_spec(mb_t *b, const tdm_router_t *r)
{
    node_family(b, r, "tandem_spec_decode_drafts_total", METRIC_COUNTER,
                "Verification passes of a sequence that carried prompt-lookup drafts "
                "(cumulative per node process, from its heartbeats).",
                NODES_DECODE_REGISTERED, nv_spec_drafts);
    node_family(b, r, "tandem_spec_decode_draft_tokens_total", METRIC_COUNTER,
                "Draft tokens proposed and verified (cumulative per node process).",
                NODES_DECODE_REGISTERED, nv_spec_draft_tokens);
    node_family(b, r, "tandem_spec_decode_accepted_tokens_total", METRIC_COUNTER,
                "Draft tokens equal to the token drawn at their index, so accepted (cumulative "
                "per node process); acceptance rate = accepted / draft tokens.",
                NODES_DECODE_REGISTERED, nv_spec_accepted_tokens);
}

/* vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), per decode node. */
static void vllm_spec(vctx_t *v, const tdm_router_t *r)
{
    vnode_family(v, r, "vllm:spec_decode_num_drafts_total", METRIC_COUNTER,
                 "Number of spec decoding drafts.", NODES_DECODE_REGISTERED, nv_spec_drafts);
    vnode_family(v, r, "vllm:spec_decode_num_draft_tokens_total", METRIC_COUNTER,
                 "Number of draft tokens.", NODES_DECODE_REGISTERED, nv_spec_draft_tokens);
    vnode_family(v, r, "vllm:spec_decode_num_accepted_tokens_total", METRIC_COUNTER,
                 "Number of accepted tokens.", NODES_DECODE_REGISTERED, nv_spec_accepted_tokens);
}

static void render_vllm(mb_t *b, const tdm_router_t *r)
{
    vctx_t v = {b, ""};
    vllm_gauges(&v, r);
    vllm_counters(&v, r);
    vllm_spec(&v, r);
    vllm_histograms(&v, r);
}

int tdm_router_metrics_snapshot(const tdm_router_t *r, Tandem__V1__MetricsResponse **out)
{
    *out = NULL;
    mb_t b = {malloc(sizeof *b.m), false};
    if (!b.m)
        return TDM_ERESOURCE;
    tandem__v1__metrics_response__init(b.m);
    render_requests(&b, r);
    render_histograms(&b, r);
    render_token_histograms(&b, r);
    render_nodes(&b, r);
    render_spec(&b, r);
    render_node_processes(&b, r);
    render_loop(&b, r);
    render_build_info(&b, r);
    render_process(&b);
    if (r->cfg->router.metrics_compat_vllm)
        render_vllm(&b, r);
    if (b.oom) {
        protobuf_c_message_free_unpacked(&b.m->base, NULL);
        return TDM_ERESOURCE;
    }
    *out = b.m;
    return TDM_OK;
}

int tdm_router_metrics_text(const tdm_router_t *r, char **text, size_t *len)
{
    *text = NULL;
    if (len)
        *len = 0;
    Tandem__V1__MetricsResponse *m;
    if (tdm_router_metrics_snapshot(r, &m) != TDM_OK)
        return TDM_ERESOURCE;
    tdm_buf_t b = TDM_BUF_INIT;
    int rc = tdm_proto_metrics_text(m, &b);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    size_t n = b.len;
    *text = rc == TDM_OK ? tdm_buf_take(&b) : NULL;
    tdm_buf_free(&b);
    if (!*text)
        return TDM_ERESOURCE;
    if (len)
        *len = n;
    return TDM_OK;
}

void rt_client_metrics(tdm_router_t *r, const tdm_frame_t *f)
{
    Tandem__V1__MetricsResponse *m;
    if (tdm_router_metrics_snapshot(r, &m) != TDM_OK) {
        tdm_sock_reply_error(r->client, f, TDM_ERESOURCE, "router out of memory");
        return;
    }
    tdm_sock_reply(r->client, f, &m->base);
    protobuf_c_message_free_unpacked(&m->base, NULL);
}
