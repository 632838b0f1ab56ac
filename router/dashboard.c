/* dashboard.c - the data behind the router's dashboard page: a sampler thread that asks the
 * router for its ClusterStatus and metrics every second through the HTTP gateway's link (never
 * touching the router's state), the last TDM_DASH_HISTORY seconds of figures, and the capacity
 * calculator ("VRAM sandbox") served as JSON.
 *
 * Where the figures come from: the request rate, requests running/queued and KV use are the
 * router's (requests_total deltas and node heartbeats, so every client counts, native ones
 * included). TTFT and TPOT (the window's mean, and p50 / p99 where the window holds enough
 * observations: DASH_MIN_P50, DASH_MIN_P99), output and prompt tokens/s, the error rate and
 * the cancellation rate (client cancels and disconnects are not errors) come from the
 * router's METRICS message, read as data, never as text: the deltas over the last
 * DASH_RATE_WINDOW samples of the tandem_time_to_first_token_seconds and
 * tandem_time_per_output_token_seconds histograms (sum, count and buckets; percentiles
 * interpolated inside a bucket as Prometheus' histogram_quantile does), of
 * tandem_generation_tokens_total and tandem_prompt_tokens_total, and of tandem_requests_total
 * (every status, the CANCELLED ones, and the others not OK; with the gateway's own refusals,
 * as GET /metrics has them); summed over the models' series when the router serves several
 * (one per model_name), so the charts are the cluster's. When the router serves no
 * such metrics, the means, output tokens and error rate come from the requests this gateway
 * proxied as the router measured them (the Timings of each final GenerateChunk), and there
 * are no percentiles or prompt tokens/s.
 * Each node's live pool (its kv_blocks_total, from registration and heartbeats) is shown as
 * the capacity plan of the served model sees it, beside the what-if calculator.
 * Capacity is tdm_kv_plan (tandem/kv.h), the same function as `tandem kvcalc`, built on the
 * nodes' own sizing functions, so it agrees with kvcalc and with the pools the nodes build, to
 * the byte (engine scratch memory aside).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "http_gateway.h"
#include "http_json.h"
#include "dashboard.h"
#include "http_metrics.h"
#include "tandem/config.h"
#include "tandem/kv.h"

#define DASH_PERIOD_S 1.0
#define DASH_STATUS_TIMEOUT_S 2.0
#define DASH_MAX_DIM 65536u
#define DASH_MAX_CONTEXT 16777216u
#define DASH_MAX_USERS 1048576u

#define DASH_RATE_WINDOW 5 /* samples the request rate and tokens/s are averaged over */
/* Latency percentiles are drawn only from a window that holds this many observations: a p50
 * of fewer than 10 requests, or a p99 of fewer than 100, is one or two requests interpolated
 * inside a bucket (one 14.5 s TTFT would read p50 20 s, p99 29.8 s in the 10-30 s bucket). */
#define DASH_MIN_P50 10
#define DASH_MIN_P99 100

#define DASH_MAX_BUCKETS 64 /* histogram buckets the percentiles read; more: no percentiles */

typedef struct dash_sample {
    double t;                /* unix seconds */
    double total;            /* the router's requests_total then; NAN when unknown */
    double tokens;           /* output tokens so far (router metrics or this gateway's) */
    double prompt_tokens;    /* prompt tokens so far (router metrics); NAN when unknown */
    double ended, failed;    /* requests ended so far, and those failed (not OK, not
                                cancelled); NAN when unknown */
    double cancelled;        /* requests ended CANCELLED so far (client cancel or gone) */
    double rate;             /* requests/s over the last DASH_RATE_WINDOW s; NAN when unknown */
    double running, queued;  /* NAN when the status call failed */
    double kv_used_pct;      /* decode nodes: used / total blocks, percent; NAN when none */
    double ttft_ms, tpot_ms; /* means over the observations of the window; NAN */
    double ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms; /* the window's; NAN when it
                                                                  holds too few (DASH_MIN_*) */
    double ttft_n, tpot_n;      /* observations in the window (the percentiles' sample size) */
    double tokens_per_s;        /* output tokens/s over the last DASH_RATE_WINDOW s */
    double prompt_tokens_per_s; /* prompt tokens/s over the same window; NAN when unknown */
    double error_pct;           /* failed / ended over the window, percent; NAN when none ended */
    double cancel_pct;          /* cancelled / ended over the window, percent; NAN likewise */
} dash_sample_t;

/* A histogram of the router's metrics as the sampler last saw it (cumulative figures). */
typedef struct dash_hist {
    double sum, count;
    size_t n_bounds;                 /* 0: no per-bucket counts (too many buckets) */
    double bounds[DASH_MAX_BUCKETS]; /* upper bounds, seconds, ascending */
    double counts[DASH_MAX_BUCKETS]; /* observations in each finite bucket (not cumulative) */
} dash_hist_t;

/* The figures of the router's METRICS message the charts use; NAN where it has none. */
typedef struct dash_met {
    dash_hist_t ttft, tpot;
    double gen_tokens, prompt_tokens;
    double ended, failed; /* tandem_requests_total: every status, and the failed ones (not OK
                             and not CANCELLED) */
    double cancelled;     /* its CANCELLED series (client cancel or disconnect) */
} dash_met_t;

struct dash {
    gw_t *gw;
    http_counters_t *counters; /* the gateway's: its refusals count in the error rate */
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu: */
    bool stop;
    dash_sample_t ring[TDM_DASH_HISTORY];
    size_t n, next;             /* samples held, slot of the next one */
    json_t *status;             /* the last ClusterStatus as JSON (nodes, requests, ...), or NULL */
    char error[TDM_ERRMSG_MAX]; /* why the last status call failed, "" when it worked */
    uint64_t http_total, http_ok, http_failed, http_cancelled;
    int streams;
    /* the last METRICS figures, oldest first, for the window's latency figures (sampler
     * thread only); n_prev 0 after a failed call: the window starts afresh */
    dash_met_t prev[DASH_RATE_WINDOW];
    size_t n_prev;
};

/* A histogram's sum, count and buckets into *h, summed over every family of that name (a
 * router serving several models has one per model_name, over the same bounds); false when m
 * has no such histogram. Buckets that do not line up leave h without buckets (n_bounds 0). */
static bool histogram_of(const Tandem__V1__MetricsResponse *m, const char *name, dash_hist_t *h)
{
    bool found = false;
    for (size_t k = 0; k < m->n_families; k++) {
        const Tandem__V1__MetricFamily *f = m->families[k];
        if (strcmp(f->name, name) != 0 || !f->histogram)
            continue;
        const Tandem__V1__MetricHistogram *hg = f->histogram;
        bool fits = hg->n_bounds == hg->n_counts && hg->n_bounds <= DASH_MAX_BUCKETS;
        if (!found) {
            h->sum = 0;
            h->count = 0;
            h->n_bounds = fits ? hg->n_bounds : 0;
            for (size_t i = 0; i < h->n_bounds; i++) {
                h->bounds[i] = hg->bounds[i];
                h->counts[i] = 0;
            }
            found = true;
        }
        h->sum += hg->sum;
        h->count += (double)hg->count;
        if (!fits || hg->n_bounds != h->n_bounds)
            h->n_bounds = 0;
        for (size_t i = 0; i < h->n_bounds; i++) {
            if (hg->bounds[i] != h->bounds[i]) {
                h->n_bounds = 0;
                break;
            }
            h->counts[i] += (double)hg->counts[i];
        }
    }
    return found;
}

static double sample_value(const Tandem__V1__MetricSample *s)
{
    return s->value_case == TANDEM__V1__METRIC_SAMPLE__VALUE_FLOAT_VALUE ? s->float_value
                                                                         : (double)s->int_value;
}

/* A counter family summed over its series (one, or one per model_name when the router serves
 * several models); NAN when absent or without samples. */
static double counter_of(const Tandem__V1__MetricsResponse *m, const char *name)
{
    const Tandem__V1__MetricFamily *f = tdm_proto_metrics_find(m, name);
    if (!f || f->n_samples == 0)
        return NAN;
    double v = 0;
    for (size_t i = 0; i < f->n_samples; i++)
        v += sample_value(f->samples[i]);
    return v;
}

/* tandem_requests_total summed over its series into v->ended, over those whose status is
 * CANCELLED (a client that cancelled or went away: not the cluster's failure) into
 * v->cancelled, and over the other not-OK ones into v->failed; NAN when m has no such family. */
static void requests_of(const Tandem__V1__MetricsResponse *m, dash_met_t *v)
{
    const Tandem__V1__MetricFamily *f = tdm_proto_metrics_find(m, "tandem_requests_total");
    v->ended = v->failed = v->cancelled = f ? 0 : NAN;
    for (size_t i = 0; f && i < f->n_samples; i++) {
        const Tandem__V1__MetricSample *s = f->samples[i];
        double x = sample_value(s);
        v->ended += x;
        for (size_t k = 0; k < s->n_labels; k++) {
            if (strcmp(s->labels[k]->name, "status") != 0)
                continue;
            if (strcmp(s->labels[k]->value, tdm_status_name(TDM_ECANCELLED)) == 0)
                v->cancelled += x;
            else if (strcmp(s->labels[k]->value, tdm_status_name(TDM_OK)) != 0)
                v->failed += x;
        }
    }
}

/* Fetches the router's metrics into *v; false when the call fails (or the answer lacks the
 * latency histograms and the output token counter the charts read: the router always serves
 * them). */
static bool fetch_metrics(dash_t *d, dash_met_t *v)
{
    Tandem__V1__MetricsRequest req = TANDEM__V1__METRICS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    int rc =
        gw_unary(d->gw, TANDEM__V1__METHOD__METHOD_METRICS, &req.base,
                 &tandem__v1__metrics_response__descriptor, DASH_STATUS_TIMEOUT_S, &resp, NULL);
    if (rc != TDM_OK)
        return false;
    Tandem__V1__MetricsResponse *m = (Tandem__V1__MetricsResponse *)resp;
    http_counters_merge_refusals(d->counters, m); /* the error rate counts the gateway's refusals */
    v->gen_tokens = counter_of(m, "tandem_generation_tokens_total");
    v->prompt_tokens = counter_of(m, "tandem_prompt_tokens_total");
    requests_of(m, v);
    bool ok = histogram_of(m, "tandem_time_to_first_token_seconds", &v->ttft) &&
              histogram_of(m, "tandem_time_per_output_token_seconds", &v->tpot) &&
              isfinite(v->gen_tokens);
    protobuf_c_message_free_unpacked(resp, NULL);
    return ok;
}

static double unix_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static json_t *num_or_null(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static double pct(uint64_t part, uint64_t whole)
{
    return whole ? 100.0 * (double)part / (double)whole : 0.0;
}

/* The nodes of a ClusterStatus as JSON, and the decode nodes' KV use: used over total bytes
 * (each node's blocks weighed by its kv_block_bytes, so that a node allocating per layer group,
 * whose blocks hold one group's layers, or one of a model of another shape counts for what its
 * memory holds; a block counts 1 from an older router that sends no block bytes). "up" is a
 * node that takes new work; a suspect one (silent past the heartbeat timeout) is "suspect"
 * instead. */
static json_t *status_json(const Tandem__V1__ClusterStatus *cs, double *kv_pct)
{
    json_t *nodes = json_array();
    double used = 0, total = 0;
    for (size_t i = 0; nodes && i < cs->n_nodes; i++) {
        static const Tandem__V1__NodeLoad no_load = TANDEM__V1__NODE_LOAD__INIT;
        const Tandem__V1__NodeStatus *n = cs->nodes[i];
        const Tandem__V1__NodeLoad *ld = n->load ? n->load : &no_load;
        json_t *o = json_pack(
            "{s:o, s:o, s:o, s:b, s:b, s:I, s:I, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:f, "
            "s:f}",
            "node_id", http_json_str(n->node_id), "role", http_json_str(n->role), "device",
            http_json_str(n->device), "up", n->up && !n->suspect, "suspect", n->up && n->suspect,
            "kv_blocks_total", (json_int_t)n->kv_blocks_total, "kv_blocks_used",
            (json_int_t)ld->kv_blocks_used, "kv_blocks_cached", (json_int_t)ld->kv_blocks_cached,
            "reserved_blocks", (json_int_t)n->reserved_blocks, "kv_used_pct",
            pct(ld->kv_blocks_used, n->kv_blocks_total), "running", (json_int_t)ld->running,
            "waiting", (json_int_t)ld->waiting, "batch_size", (json_int_t)ld->batch_size,
            "queued_prefill_tokens", (json_int_t)ld->queued_prefill_tokens, "prefix_queries",
            (json_int_t)ld->prefix_queries, "prefix_hits", (json_int_t)ld->prefix_hits,
            "step_time_ms", ld->step_s * 1e3, "last_heartbeat_age_s", n->last_heartbeat_age_s);
        if (o) {
            json_object_set_new(o, "model", http_json_str(n->model)); /* the model it serves */
            json_object_set_new(o, "kv_layer_groups", json_integer((json_int_t)n->kv_layer_groups));
            json_object_set_new(o, "kv_block_bytes", json_integer((json_int_t)n->kv_block_bytes));
            json_array_append_new(nodes, o);
        }
        if (n->up && strcmp(n->role, "decode") == 0) {
            double w = n->kv_block_bytes ? (double)n->kv_block_bytes : 1.0;
            used += w * (double)ld->kv_blocks_used;
            total += w * (double)n->kv_blocks_total;
        }
    }
    *kv_pct = total > 0 ? 100.0 * used / total : NAN;
    /* the strings come from the nodes and the router: valid UTF-8 or replaced (http_json_text) */
    return json_pack("{s:o, s:o, s:{s:i, s:i, s:I}, s:o}", "version", http_json_str(cs->version),
                     "model", http_json_str(cs->model), "requests", "running",
                     (int)cs->requests_running, "queued", (int)cs->requests_queued, "total",
                     (json_int_t)cs->requests_total, "nodes", nodes ? nodes : json_array());
}

/* The q-quantile (0..1) of the observations between prev and cur, in seconds, interpolated
 * linearly inside the bucket it falls in (Prometheus' histogram_quantile); the highest finite
 * bound when it falls in the +Inf bucket. NAN when nothing was observed or the buckets are
 * not known. */
static double hist_quantile(const dash_hist_t *cur, const dash_hist_t *prev, double q)
{
    size_t n = cur->n_bounds;
    double total = cur->count - prev->count;
    if (n == 0 || n != prev->n_bounds || !(total > 0))
        return NAN;
    double rank = q * total, below = 0;
    for (size_t i = 0; i < n; i++) {
        double c = cur->counts[i] - prev->counts[i];
        if (c > 0 && below + c >= rank) {
            double lo = i ? cur->bounds[i - 1] : 0;
            return lo + (cur->bounds[i] - lo) * (rank - below) / c;
        }
        below += c;
    }
    return cur->bounds[n - 1];
}

/* The window's observation count *n, mean, p50 and p99 of a latency histogram (cur against
 * the oldest sample of the window, prev) into *mean, *p50, *p99 (ms). The mean is exact
 * (sum / count); each percentile is left as it is (NAN) below its DASH_MIN_* count; all are
 * when nothing was observed. */
static void hist_figures(const dash_hist_t *cur, const dash_hist_t *prev, double *n, double *mean,
                         double *p50, double *p99)
{
    *n = cur->count - prev->count;
    if (!(*n > 0))
        return;
    *mean = (cur->sum - prev->sum) / *n * 1e3;
    if (*n >= DASH_MIN_P50)
        *p50 = hist_quantile(cur, prev, 0.50) * 1e3;
    if (*n >= DASH_MIN_P99)
        *p99 = hist_quantile(cur, prev, 0.99) * 1e3;
}

/* The window's TTFT and TPOT (the router's latency histograms now against the oldest METRICS
 * answer held, at most DASH_RATE_WINDOW samples back) and the cumulative token and request
 * counts into *s (d->mu held). A METRICS call that failed (met NULL) leaves them unknown
 * (NAN) and empties the window: it then starts afresh. */
static void latency_figures(dash_t *d, dash_sample_t *s, const dash_met_t *met)
{
    if (!met) {
        d->n_prev = 0;
        return;
    }
    if (d->n_prev > 0) {
        const dash_met_t *old = &d->prev[0];
        hist_figures(&met->ttft, &old->ttft, &s->ttft_n, &s->ttft_ms, &s->ttft_p50_ms,
                     &s->ttft_p99_ms);
        hist_figures(&met->tpot, &old->tpot, &s->tpot_n, &s->tpot_ms, &s->tpot_p50_ms,
                     &s->tpot_p99_ms);
    }
    s->tokens = met->gen_tokens;
    s->prompt_tokens = met->prompt_tokens;
    s->ended = met->ended;
    s->failed = met->failed;
    s->cancelled = met->cancelled;
    if (d->n_prev == DASH_RATE_WINDOW) {
        memmove(&d->prev[0], &d->prev[1], (DASH_RATE_WINDOW - 1) * sizeof d->prev[0]);
        d->n_prev--;
    }
    d->prev[d->n_prev++] = *met;
}

/* Appends s to the ring (d->mu held), with the rates over the last DASH_RATE_WINDOW samples:
 * one-second counts are too jumpy. */
static void ring_push(dash_t *d, dash_sample_t *s)
{
    size_t back = d->n < DASH_RATE_WINDOW ? d->n : DASH_RATE_WINDOW;
    if (back > 0) {
        const dash_sample_t *o = &d->ring[(d->next + TDM_DASH_HISTORY - back) % TDM_DASH_HISTORY];
        double dt = s->t - o->t, ended = s->ended - o->ended;
        if (dt > 0 && s->total >= o->total)
            s->rate = (s->total - o->total) / dt;
        if (dt > 0 && s->tokens >= o->tokens)
            s->tokens_per_s = (s->tokens - o->tokens) / dt;
        if (dt > 0 && s->prompt_tokens >= o->prompt_tokens)
            s->prompt_tokens_per_s = (s->prompt_tokens - o->prompt_tokens) / dt;
        if (ended > 0 && s->failed >= o->failed)
            s->error_pct = 100.0 * (s->failed - o->failed) / ended;
        if (ended > 0 && s->cancelled >= o->cancelled)
            s->cancel_pct = 100.0 * (s->cancelled - o->cancelled) / ended;
    }
    d->ring[d->next] = *s;
    d->next = (d->next + 1) % TDM_DASH_HISTORY;
    if (d->n < TDM_DASH_HISTORY)
        d->n++;
}

/* A sample at t with every figure unknown (NAN). */
static dash_sample_t dash_sample_empty(double t)
{
    dash_sample_t s;
    s.t = t;
    s.total = s.tokens = s.prompt_tokens = s.ended = s.failed = s.cancelled = s.rate = NAN;
    s.running = s.queued = s.kv_used_pct = NAN;
    s.ttft_ms = s.tpot_ms = s.ttft_p50_ms = s.ttft_p99_ms = s.tpot_p50_ms = s.tpot_p99_ms = NAN;
    s.ttft_n = s.tpot_n = NAN;
    s.tokens_per_s = 0; /* the first sample has no window: 0, as before */
    s.prompt_tokens_per_s = s.error_pct = s.cancel_pct = NAN;
    return s;
}

/* One sample: a STATUS and a METRICS call, then the interval's figures into the ring. */
static void sample(dash_t *d)
{
    Tandem__V1__StatusRequest req = TANDEM__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(d->gw, TANDEM__V1__METHOD__METHOD_STATUS, &req.base,
                      &tandem__v1__cluster_status__descriptor, DASH_STATUS_TIMEOUT_S, &resp, &err);
    dash_sample_t s = dash_sample_empty(unix_now());
    json_t *st = NULL;
    if (rc == TDM_OK) {
        const Tandem__V1__ClusterStatus *cs = (const Tandem__V1__ClusterStatus *)resp;
        st = status_json(cs, &s.kv_used_pct);
        s.running = cs->requests_running;
        s.queued = cs->requests_queued;
        s.total = (double)cs->requests_total;
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    dash_met_t met;
    bool have_met = fetch_metrics(d, &met);
    pthread_mutex_lock(&d->mu);
    latency_figures(d, &s, have_met ? &met : NULL);
    ring_push(d, &s);
    if (st || rc != TDM_OK) {
        json_decref(d->status);
        d->status = st;
    }
    snprintf(d->error, sizeof d->error, "%s", rc == TDM_OK ? "" : err.msg);
    pthread_mutex_unlock(&d->mu);
}

static void *dash_main(void *arg)
{
    dash_t *d = arg;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (;;) {
        pthread_mutex_lock(&d->mu);
        bool stop = d->stop;
        pthread_mutex_unlock(&d->mu);
        if (stop)
            break;
        sample(d);
        next.tv_sec += (time_t)DASH_PERIOD_S;
        pthread_mutex_lock(&d->mu);
        while (!d->stop) {
            int rc = pthread_cond_timedwait(&d->cv, &d->mu, &next);
            if (rc == ETIMEDOUT)
                break;
        }
        pthread_mutex_unlock(&d->mu);
        /* after a long stall, do not try to catch up */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > next.tv_sec + 2)
            next = now;
    }
    return NULL;
}

dash_t *dash_new(gw_t *gw, http_counters_t *counters, tdm_error_t *err)
{
    dash_t *d = calloc(1, sizeof *d);
    if (!d) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    d->gw = gw;
    d->counters = counters;
    pthread_mutex_init(&d->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&d->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&d->thread, NULL, dash_main, d);
    if (rc != 0) {
        tdm_error_set(err, TDM_ERESOURCE, "dashboard: cannot start a thread: %s", strerror(rc));
        dash_destroy(&d);
        return NULL;
    }
    d->started = true;
    return d;
}

void dash_destroy(dash_t **d_p)
{
    if (!d_p || !*d_p)
        return;
    dash_t *d = *d_p;
    if (d->started) {
        pthread_mutex_lock(&d->mu);
        d->stop = true;
        pthread_cond_signal(&d->cv);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->thread, NULL);
    }
    json_decref(d->status);
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->mu);
    free(d);
    *d_p = NULL;
}

void dash_record(dash_t *d, int status)
{
    pthread_mutex_lock(&d->mu);
    d->http_total++;
    if (status == TDM_OK)
        d->http_ok++;
    else if (status == TDM_ECANCELLED)
        d->http_cancelled++;
    else
        d->http_failed++;
    pthread_mutex_unlock(&d->mu);
}

void dash_streams(dash_t *d, int delta)
{
    pthread_mutex_lock(&d->mu);
    d->streams += delta;
    pthread_mutex_unlock(&d->mu);
}

static json_t *model_json(const http_model_t *m)
{
    if (!m)
        return json_null();
    char fp[24];
    snprintf(fp, sizeof fp, "%016" PRIx64, m->fingerprint);
    return json_pack(
        "{s:o, s:o, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:I, s:i, s:s}", "name",
        http_json_str(m->name), "chat_template", http_json_str(m->chat_template), "fingerprint", fp,
        "n_ctx", (int)m->n_ctx, "n_vocab", (int)m->n_vocab, "n_layers", (int)m->n_layers,
        "n_kv_heads", (int)m->n_kv_heads, "head_dim", (int)m->head_dim, "n_heads", (int)m->n_heads,
        "n_embd", (int)m->n_embd, "weight_bytes", (json_int_t)m->weight_bytes, "kv_block_size",
        (int)m->kv_block_size, "kv_dtype", tdm_kv_dtype_name((tdm_kv_dtype_t)m->kv_dtype));
}

/* The history's series: name in the JSON and the sample's field. */
typedef struct dash_series {
    const char *name;
    size_t offset; /* of a double in dash_sample_t */
} dash_series_t;

#define DASH_SERIES(name, field)                                                                   \
    {                                                                                              \
        name, offsetof(dash_sample_t, field)                                                       \
    }
static const dash_series_t dash_series[] = {
    DASH_SERIES("t", t),
    DASH_SERIES("request_rate", rate),
    DASH_SERIES("error_pct", error_pct),
    DASH_SERIES("cancel_pct", cancel_pct),
    DASH_SERIES("ttft_ms", ttft_ms),
    DASH_SERIES("ttft_p50_ms", ttft_p50_ms),
    DASH_SERIES("ttft_p99_ms", ttft_p99_ms),
    DASH_SERIES("ttft_n", ttft_n),
    DASH_SERIES("tpot_ms", tpot_ms),
    DASH_SERIES("tpot_p50_ms", tpot_p50_ms),
    DASH_SERIES("tpot_p99_ms", tpot_p99_ms),
    DASH_SERIES("tpot_n", tpot_n),
    DASH_SERIES("tokens_per_s", tokens_per_s),
    DASH_SERIES("prompt_tokens_per_s", prompt_tokens_per_s),
    DASH_SERIES("running", running),
    DASH_SERIES("queued", queued),
    DASH_SERIES("kv_used_pct", kv_used_pct),
};
#define DASH_N_SERIES (sizeof dash_series / sizeof dash_series[0])

/* The history object (d->mu held): interval_s, one array per series (null where unknown),
 * and where each figure comes from. NULL on out of memory. */
static json_t *history_json(const dash_t *d)
{
    json_t *h = json_pack(
        "{s:f, s:i, s:i, s:i, s:{s:s, s:s, s:s, s:s, s:s, s:s}}", "interval_s", DASH_PERIOD_S,
        "window_samples", DASH_RATE_WINDOW, "min_p50_samples", DASH_MIN_P50, "min_p99_samples",
        DASH_MIN_P99, "sources", "request_rate", "router requests_total, every client",
        "ttft_ms tpot_ms tokens_per_s",
        "router /metrics histograms and tandem_generation_tokens_total, every client; latency "
        "figures over the window, percentiles only from enough observations (ttft_n, tpot_n)",
        "prompt_tokens_per_s", "router tandem_prompt_tokens_total, every client", "error_pct",
        "router tandem_requests_total: ended with a status other than OK and CANCELLED",
        "cancel_pct",
        "router tandem_requests_total: ended CANCELLED (the client cancelled or went away)",
        "running queued kv_used_pct", "router ClusterStatus (node heartbeats; KV: decode nodes)");
    size_t first = (d->next + TDM_DASH_HISTORY - d->n) % TDM_DASH_HISTORY;
    for (size_t k = 0; h && k < DASH_N_SERIES; k++) {
        json_t *a = json_array();
        for (size_t i = 0; a && i < d->n; i++) {
            const dash_sample_t *s = &d->ring[(first + i) % TDM_DASH_HISTORY];
            double v;
            memcpy(&v, (const char *)s + dash_series[k].offset, sizeof v);
            json_array_append_new(a, k == 0 ? json_real(floor(v * 1e3) / 1e3) : num_or_null(v));
        }
        if (!a || json_object_set_new(h, dash_series[k].name, a) != 0) {
            json_decref(h);
            return NULL;
        }
    }
    return h;
}

/* The node's live pool as the capacity plan of the served model sees it, set on node as
 * "pool": kv_blocks_total blocks (the router's figure, from registration and heartbeats),
 * their bytes, and how many sequences of the model's full context they hold at once
 * (tdm_kv_plan, the same arithmetic as /api/capacity?node=ID and `tandem kvcalc`). null
 * when the model's shape is not known. */
/* The layer groups node (its status entry) allocates per: the model's when its
 * kv_layer_groups says it allocates per group, else NULL (every block holds every layer). */
static const tdm_kv_groups_t *node_groups(const json_t *node, const http_model_t *m)
{
    json_int_t g = json_integer_value(json_object_get(node, "kv_layer_groups"));
    return m && m->have_groups && g > 1 && (uint32_t)g == m->groups.n_groups ? &m->groups : NULL;
}

static void node_pool_json(json_t *node, const http_model_t *m)
{
    json_t *pool = NULL;
    uint64_t blocks = (uint64_t)json_integer_value(json_object_get(node, "kv_blocks_total"));
    tdm_kv_plan_in_t in = {.layout = {0, 0, 0, 16, TDM_KV_F16}, .n_users = 1};
    tdm_kv_plan_t p;
    if (m && m->n_layers) {
        in.layout = (tdm_kv_layout_t){m->n_layers, m->n_kv_heads, m->head_dim,
                                      m->kv_block_size ? m->kv_block_size : 16,
                                      (tdm_kv_dtype_t)m->kv_dtype};
        in.n_heads = m->n_heads;
        in.n_ctx = m->n_ctx ? m->n_ctx : 4096;
        in.weight_bytes = m->weight_bytes;
        in.have_memory = true;
        in.groups = node_groups(node, m);
        tdm_kv_layout_t bl = in.groups ? tdm_kv_group_layout(&in.layout, in.groups) : in.layout;
        if (tdm_kv_plan_budget(&bl, blocks, m->weight_bytes, &in.memory_bytes, NULL) == TDM_OK &&
            tdm_kv_plan(&in, &p, NULL) == TDM_OK)
            pool = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "kv_blocks", (json_int_t)blocks,
                             "block_bytes", (json_int_t)p.block_bytes, "kv_bytes",
                             (json_int_t)(blocks * p.block_bytes), "context", (json_int_t)in.n_ctx,
                             "blocks_per_sequence", (json_int_t)p.blocks_per_seq, "max_sequences",
                             (json_int_t)p.max_seqs, "layer_groups",
                             (json_int_t)(in.groups ? in.groups->n_groups : 1));
    }
    json_object_set_new(node, "pool", pool ? pool : json_null());
}

json_t *dash_status_json(dash_t *d, const http_model_t *models, size_t n_models)
{
    const http_model_t *m = n_models ? &models[0] : NULL;
    pthread_mutex_lock(&d->mu);
    json_t *hist = history_json(d);
    json_t *st = d->status ? json_deep_copy(d->status) : NULL;
    json_t *r =
        json_pack("{s:f, s:b, s:s?, s:{s:I, s:I, s:I, s:I, s:i}}", "time", unix_now(), "ok",
                  d->error[0] == '\0' && st != NULL, "error", d->error[0] ? d->error : NULL, "http",
                  "requests_total", (json_int_t)d->http_total, "requests_ok",
                  (json_int_t)d->http_ok, "requests_failed", (json_int_t)d->http_failed,
                  "requests_cancelled", (json_int_t)d->http_cancelled, "streams", d->streams);
    pthread_mutex_unlock(&d->mu);
    if (!r || !hist) {
        json_decref(r);
        json_decref(hist);
        json_decref(st);
        return NULL;
    }
    if (st) {
        json_object_update(r, st);
        json_decref(st);
    } else {
        json_object_set_new(r, "nodes", json_array());
    }
    size_t i;
    json_t *n;
    json_array_foreach(json_object_get(r, "nodes"), i, n)
    {
        /* each node's pool as the model it serves sees it */
        const char *name = json_string_value(json_object_get(n, "model"));
        const http_model_t *own = m;
        for (size_t k = 0; name && name[0] && k < n_models; k++)
            if (strcmp(models[k].name, name) == 0)
                own = &models[k];
        node_pool_json(n, own);
    }
    json_object_set_new(r, "model_info", model_json(m));
    json_t *all = json_array();
    for (size_t k = 0; all && k < n_models; k++)
        json_array_append_new(all, model_json(&models[k]));
    json_object_set_new(r, "models", all ? all : json_array());
    json_object_set_new(r, "history", hist);
    return r;
}

/* ---- capacity ---- */

typedef struct cap_args {
    const char *(*get)(void *ctx, const char *name);
    void *ctx;
    const char *bad; /* the parameter at fault */
    char msg[TDM_ERRMSG_MAX + 64];
} cap_args_t;

/* Parameter name as an unsigned integer in [lo, hi]; absent: *out unchanged, true. */
static bool cap_uint(cap_args_t *a, const char *name, uint64_t lo, uint64_t hi, uint64_t *out,
                     bool *given)
{
    const char *t = a->get(a->ctx, name);
    if (given)
        *given = t && *t;
    if (!t || !*t)
        return true;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(t, &end, 10);
    if (*t < '0' || *t > '9' || errno || *end || v < lo || v > hi) {
        a->bad = name;
        snprintf(a->msg, sizeof a->msg,
                 "%s must be an integer in %" PRIu64 "..%" PRIu64 ", got '%s'", name, lo, hi, t);
        return false;
    }
    *out = v;
    return true;
}

static bool cap_bytes(cap_args_t *a, const char *name, uint64_t *out, bool *given)
{
    const char *t = a->get(a->ctx, name);
    *given = t && *t;
    if (!*given)
        return true;
    if (tdm_config_parse_bytes(t, out) != TDM_OK) {
        a->bad = name;
        snprintf(a->msg, sizeof a->msg,
                 "%s must be a byte size such as 80GiB, 512MiB, 1.5GB or 4096, got '%s'", name, t);
        return false;
    }
    return true;
}

static json_t *cap_error(cap_args_t *a, unsigned *http_status)
{
    *http_status = 400;
    return http_error_json(TDM_EINVALID, NULL, a->bad, a->msg);
}

/* The KV shape, n_heads, weights and context into in: the served model's (m), or the explicit
 * layers/kv_heads/head_dim/heads of the query. The cluster's block size and dtype are the
 * defaults whatever the shape. false with a->bad and a->msg set. */
static bool cap_shape(cap_args_t *a, const http_model_t *m, bool explicit_shape,
                      tdm_kv_plan_in_t *in)
{
    tdm_kv_layout_t *l = &in->layout;
    if (m && m->n_layers) {
        l->block_size = m->kv_block_size ? m->kv_block_size : 16;
        l->dtype = (tdm_kv_dtype_t)m->kv_dtype;
    }
    if (!explicit_shape) {
        if (!m || !m->n_layers) {
            a->bad = "layers";
            snprintf(a->msg, sizeof a->msg,
                     "the served model's shape is not known (the router did not report it); "
                     "give layers, kv_heads and head_dim");
            return false;
        }
        l->n_layers = m->n_layers;
        l->n_kv_heads = m->n_kv_heads;
        l->head_dim = m->head_dim;
        in->n_heads = m->n_heads ? m->n_heads : m->n_kv_heads;
        in->weight_bytes = m->weight_bytes;
        in->n_ctx = m->n_ctx ? m->n_ctx : 4096;
        return true;
    }
    uint64_t layers = 0, kv = 0, hd = 0, heads;
    if (!cap_uint(a, "layers", 1, DASH_MAX_DIM, &layers, NULL) ||
        !cap_uint(a, "kv_heads", 1, DASH_MAX_DIM, &kv, NULL) ||
        !cap_uint(a, "head_dim", 4, DASH_MAX_DIM, &hd, NULL))
        return false;
    if (!layers || !kv || !hd) {
        a->bad = !layers ? "layers" : !kv ? "kv_heads" : "head_dim";
        snprintf(a->msg, sizeof a->msg, "give all of layers, kv_heads and head_dim");
        return false;
    }
    if (hd % 4) {
        a->bad = "head_dim";
        snprintf(a->msg, sizeof a->msg, "head_dim must be a multiple of 4, got %" PRIu64, hd);
        return false;
    }
    l->n_layers = (uint32_t)layers;
    l->n_kv_heads = (uint32_t)kv;
    l->head_dim = (uint32_t)hd;
    heads = kv;
    if (!cap_uint(a, "heads", 1, DASH_MAX_DIM, &heads, NULL))
        return false;
    if (heads % kv) {
        a->bad = "heads";
        snprintf(a->msg, sizeof a->msg, "heads must be a multiple of kv_heads");
        return false;
    }
    in->n_heads = (uint32_t)heads;
    return true;
}

/* dtype, block_size, context, users, weights and memory from the query into in (absent ones
 * keep in's defaults). false with a->bad and a->msg set. */
static bool cap_options(cap_args_t *a, tdm_kv_plan_in_t *in)
{
    bool given;
    const char *dt = a->get(a->ctx, "dtype");
    if (dt && *dt && tdm_kv_dtype_parse(dt, &in->layout.dtype, NULL) != TDM_OK) {
        a->bad = "dtype";
        snprintf(a->msg, sizeof a->msg, "dtype must be f32, f16 or q8, got '%s'", dt);
        return false;
    }
    uint64_t v = in->layout.block_size;
    if (!cap_uint(a, "block_size", 1, 256, &v, NULL))
        return false;
    if (v & (v - 1)) {
        a->bad = "block_size";
        snprintf(a->msg, sizeof a->msg, "block_size must be a power of two in 1..256");
        return false;
    }
    in->layout.block_size = (uint32_t)v;
    return cap_uint(a, "context", 1, DASH_MAX_CONTEXT, &in->n_ctx, NULL) &&
           cap_uint(a, "users", 1, DASH_MAX_USERS, &in->n_users, NULL) &&
           cap_bytes(a, "weights", &in->weight_bytes, &given) &&
           cap_bytes(a, "memory", &in->memory_bytes, &in->have_memory);
}

/* all_layers: 1 / true plans every layer in every block, 0 / false (or absent) per layer group
 * where the model has windows. false with a->bad and a->msg set for another value. */
static bool cap_all_layers(cap_args_t *a, bool *out)
{
    const char *t = a->get(a->ctx, "all_layers");
    *out = false;
    if (!t || !*t || strcmp(t, "0") == 0 || strcmp(t, "false") == 0)
        return true;
    if (strcmp(t, "1") == 0 || strcmp(t, "true") == 0) {
        *out = true;
        return true;
    }
    a->bad = "all_layers";
    snprintf(a->msg, sizeof a->msg, "all_layers must be 1, true, 0 or false, got '%s'", t);
    return false;
}

/* node=ID without memory: the node's real pool (kv_blocks_total blocks of the cluster's
 * layout) plus the weights is the memory (tdm_kv_plan_budget). Returns a copy of the node's
 * entry in the last status (caller decrefs), or NULL with a->bad and a->msg set. */
static json_t *cap_node(cap_args_t *a, dash_t *d, const http_model_t *m, const char *node_id,
                        tdm_kv_plan_in_t *in)
{
    json_t *node_info = NULL;
    pthread_mutex_lock(&d->mu);
    json_t *nodes = d->status ? json_object_get(d->status, "nodes") : NULL;
    size_t i;
    json_t *n;
    json_array_foreach(nodes, i, n)
    {
        const char *id = json_string_value(json_object_get(n, "node_id"));
        if (id && strcmp(id, node_id) == 0) {
            json_decref(node_info);
            node_info = json_deep_copy(n);
        }
    }
    pthread_mutex_unlock(&d->mu);
    a->bad = "node";
    if (!node_info || !m || !m->n_layers) {
        json_decref(node_info);
        snprintf(a->msg, sizeof a->msg, "node '%s' is not in the router's last status", node_id);
        return NULL;
    }
    tdm_kv_layout_t cl = {m->n_layers, m->n_kv_heads, m->head_dim,
                          m->kv_block_size ? m->kv_block_size : 16, (tdm_kv_dtype_t)m->kv_dtype};
    uint64_t blocks = (uint64_t)json_integer_value(json_object_get(node_info, "kv_blocks_total"));
    /* a node that allocates per layer group: its blocks hold one group's layers */
    in->groups = in->layout.n_layers == m->n_layers && in->layout.block_size == cl.block_size &&
                         in->layout.dtype == cl.dtype
                     ? node_groups(node_info, m)
                     : NULL;
    if (in->groups)
        cl = tdm_kv_group_layout(&cl, in->groups);
    if (tdm_kv_plan_budget(&cl, blocks, m->weight_bytes, &in->memory_bytes, NULL) != TDM_OK) {
        json_decref(node_info);
        snprintf(a->msg, sizeof a->msg, "node '%s' reports an impossible pool", node_id);
        return NULL;
    }
    a->bad = NULL;
    in->have_memory = true;
    return node_info;
}

/* The /api/capacity body of a plan; takes ownership of node_info. NULL on out of memory. */
static json_t *cap_result(const char *source, const char *model, const tdm_kv_plan_in_t *in,
                          const tdm_kv_plan_t *p, json_t *node_info)
{
    const tdm_kv_layout_t *l = &in->layout;
    json_t *r = json_pack(
        "{s:s, s:o?, s:i, s:i, s:i, s:i, s:s, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, "
        "s:I, s:I, s:f}",
        "source", source, "model", model ? http_json_str(model) : NULL, "n_layers",
        (int)l->n_layers, "n_kv_heads", (int)l->n_kv_heads, "n_heads", (int)in->n_heads, "head_dim",
        (int)l->head_dim, "dtype", tdm_kv_dtype_name(l->dtype), "block_size", (int)l->block_size,
        "context", (json_int_t)in->n_ctx, "users", (json_int_t)in->n_users, "weights_bytes",
        (json_int_t)in->weight_bytes, "kv_bytes_per_token", (json_int_t)p->bytes_per_token,
        "block_bytes", (json_int_t)p->block_bytes, "blocks_per_sequence",
        (json_int_t)p->blocks_per_seq, "kv_bytes_per_sequence", (json_int_t)p->bytes_per_seq,
        "kv_blocks_total", (json_int_t)p->blocks_total, "kv_bytes_total",
        (json_int_t)p->bytes_total, "weights_plus_kv_bytes", (json_int_t)p->need_bytes,
        "mha_kv_bytes_per_token", (json_int_t)p->mha_bytes_per_token, "gqa_factor", p->gqa_factor);
    if (!r) {
        json_decref(node_info);
        return NULL;
    }
    json_object_set_new(r, "node", node_info ? node_info : json_null());
    json_object_set_new(r, "layer_groups",
                        json_integer((json_int_t)(in->groups ? in->groups->n_groups : 1)));
    bool h = in->have_memory;
    json_object_set_new(r, "memory_bytes",
                        h ? json_integer((json_int_t)in->memory_bytes) : json_null());
    json_object_set_new(r, "pool_blocks",
                        h ? json_integer((json_int_t)p->pool_blocks) : json_null());
    json_object_set_new(r, "fits", h ? json_boolean(p->fits) : json_null());
    json_object_set_new(r, "max_sequences",
                        h ? json_integer((json_int_t)p->max_seqs) : json_null());
    return r;
}

json_t *dash_capacity_json(dash_t *d, const http_model_t *m,
                           const char *(*get)(void *ctx, const char *name), void *ctx,
                           unsigned *http_status)
{
    cap_args_t a = {get, ctx, NULL, ""};
    *http_status = 200;
    tdm_kv_plan_in_t in = {.layout = {0, 0, 0, 16, TDM_KV_F16}, .n_ctx = 4096, .n_users = 1};
    const char *node_id = get(ctx, "node");
    bool explicit_shape = get(ctx, "layers") || get(ctx, "kv_heads") || get(ctx, "head_dim");
    const char *source = explicit_shape ? "shape" : node_id ? "node" : "model";
    bool all_layers = false;
    if (!cap_shape(&a, m, explicit_shape, &in) || !cap_options(&a, &in) ||
        !cap_all_layers(&a, &all_layers))
        return cap_error(&a, http_status);
    /* the served model with windows: per layer group, as its CPU nodes allocate and as
     * `tandem kvcalc -m` plans (tdm_node_kv_groups; all_layers for a model with a GPU node) */
    if (!explicit_shape && !node_id && m && m->have_groups && !all_layers)
        in.groups = &m->groups;
    tdm_error_t err = {0};
    if (tdm_kv_layout_check(&in.layout, &err) != TDM_OK) {
        a.bad = NULL;
        snprintf(a.msg, sizeof a.msg, "%s", err.msg);
        return cap_error(&a, http_status);
    }
    json_t *node_info = NULL;
    if (node_id && !in.have_memory && !(node_info = cap_node(&a, d, m, node_id, &in)))
        return cap_error(&a, http_status);
    tdm_kv_plan_t plan;
    int rc = tdm_kv_plan(&in, &plan, &err);
    if (rc != TDM_OK) {
        json_decref(node_info);
        a.bad = rc == TDM_ERESOURCE ? "users" : NULL;
        snprintf(a.msg, sizeof a.msg, "%s",
                 rc == TDM_ERESOURCE ? "users x context needs more than 2^64 bytes" : err.msg);
        return cap_error(&a, http_status);
    }
    return cap_result(source, m && !explicit_shape ? m->name : NULL, &in, &plan, node_info);
}
