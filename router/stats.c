/* stats.c - the router's latency histograms and end-of-request counters (stats.h). */
#include <stddef.h>

#include "router_internal.h"
#include "stats.h"

static const double hist_bounds[TDM_ROUTER_HIST_BUCKETS - 1] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
};

static const double token_bounds[TDM_ROUTER_HIST_BUCKETS - 1] = {
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
};

const double *tdm_router_hist_bounds(void)
{
    return hist_bounds;
}

const double *tdm_router_token_bounds(void)
{
    return token_bounds;
}

static void observe(tdm_router_hist_t *h, const double *bounds, double v)
{
    if (!(v >= 0))
        v = 0;
    size_t i = 0;
    while (i < TDM_ROUTER_HIST_BUCKETS - 1 && v > bounds[i])
        i++;
    h->buckets[i]++;
    h->count++;
    h->sum += v;
}

void rt_hist_observe(tdm_router_hist_t *h, double seconds)
{
    observe(h, hist_bounds, seconds);
}

void rt_hist_observe_count(tdm_router_hist_t *h, double n)
{
    observe(h, token_bounds, n);
}

/* The end counters of m. */
static void count_end(tdm_router_metrics_t *m, int status, int finish)
{
    int code = -status;
    bool known = finish >= 0 && finish < 5;
    if (code >= 0 && code < 17) {
        m->requests_by_status[code]++;
        m->requests_by_status_finish[code][known ? finish : 0]++;
    }
    if (known)
        m->requests_by_finish[finish]++;
}

void rt_count_end(tdm_router_t *r, rt_model_t *model, int status, int finish)
{
    count_end(&r->metrics, status, finish);
    if (model)
        count_end(&model->metrics, status, finish);
}
