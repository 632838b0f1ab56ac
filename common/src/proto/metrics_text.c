/* metrics_text.c - a MetricsResponse (proto/tandem.proto) as Prometheus text exposition format
 * 0.0.4: the one renderer, used by the router's GET /metrics and by any native client that
 * shows the text.
 *
 * The output is what the router served as text before METRICS carried data, to the byte:
 * "# HELP" and "# TYPE" per family (also when it has no sample), one sample per line,
 * integer values in decimal, float values and `le` bounds as the shortest of %.15g / %.16g /
 * %.17g that reads back exactly, label values escaped, '\n' line ends.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/proto.h"

/* A label value, escaped as the format says: backslash, double quote and line feed. */
static void label_value(tdm_buf_t *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\')
            tdm_buf_puts(b, "\\\\");
        else if (*v == '"')
            tdm_buf_puts(b, "\\\"");
        else if (*v == '\n')
            tdm_buf_puts(b, "\\n");
        else
            tdm_buf_append(b, v, 1);
    }
}

/* A float value: the shortest exact decimal; NaN and the infinities as the format spells them. */
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

static const char *type_name(Tandem__V1__MetricType t)
{
    switch (t) {
    case TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE: return "gauge";
    case TANDEM__V1__METRIC_TYPE__METRIC_TYPE_HISTOGRAM: return "histogram";
    default: return "counter";
    }
}

/* `name{a="x",b="y"} value` */
static void sample(tdm_buf_t *b, const char *name, const Tandem__V1__MetricSample *s)
{
    tdm_buf_puts(b, name);
    for (size_t i = 0; i < s->n_labels; i++) {
        tdm_buf_printf(b, "%s%s=\"", i ? "," : "{", s->labels[i]->name);
        label_value(b, s->labels[i]->value);
        tdm_buf_puts(b, i + 1 == s->n_labels ? "\"}" : "\"");
    }
    char num[40];
    if (s->value_case == TANDEM__V1__METRIC_SAMPLE__VALUE_FLOAT_VALUE)
        fmt_double(num, sizeof num, s->float_value);
    else
        snprintf(num, sizeof num, "%" PRIu64, s->int_value);
    tdm_buf_printf(b, " %s\n", num);
}

/* `name_suffix{a="x",b="y"` (the brace left open when there are labels) or `name_suffix`. */
static void hist_head(tdm_buf_t *b, const char *name, const char *suffix,
                      const Tandem__V1__MetricFamily *f)
{
    tdm_buf_printf(b, "%s%s", name, suffix);
    for (size_t i = 0; i < f->n_histogram_labels; i++) {
        tdm_buf_printf(b, "%s%s=\"", i ? "," : "{", f->histogram_labels[i]->name);
        label_value(b, f->histogram_labels[i]->value);
        tdm_buf_puts(b, "\"");
    }
}

/* `_bucket{labels,le="bound"} count` */
static void hist_bucket(tdm_buf_t *b, const Tandem__V1__MetricFamily *f, const char *le, uint64_t n)
{
    hist_head(b, f->name, "_bucket", f);
    tdm_buf_printf(b, "%sle=\"%s\"} %" PRIu64 "\n", f->n_histogram_labels ? "," : "{", le, n);
}

/* Cumulative buckets over the bounds, then +Inf, _sum and _count, each with f's histogram
 * labels. */
static void histogram(tdm_buf_t *b, const Tandem__V1__MetricFamily *f)
{
    const Tandem__V1__MetricHistogram *h = f->histogram;
    uint64_t cum = 0;
    char num[40];
    for (size_t i = 0; i < h->n_bounds; i++) {
        cum += i < h->n_counts ? h->counts[i] : 0;
        fmt_double(num, sizeof num, h->bounds[i]);
        hist_bucket(b, f, num, cum);
    }
    hist_bucket(b, f, "+Inf", h->count);
    const char *close = f->n_histogram_labels ? "}" : "";
    fmt_double(num, sizeof num, h->sum);
    hist_head(b, f->name, "_sum", f);
    tdm_buf_printf(b, "%s %s\n", close, num);
    hist_head(b, f->name, "_count", f);
    tdm_buf_printf(b, "%s %" PRIu64 "\n", close, h->count);
}

int tdm_proto_metrics_text(const Tandem__V1__MetricsResponse *m, tdm_buf_t *out)
{
    for (size_t i = 0; i < m->n_families; i++) {
        const Tandem__V1__MetricFamily *f = m->families[i];
        const char *type = type_name(f->type);
        /* a histogram with several label sets (one per model) comes as consecutive families of
         * one name: one HELP and TYPE for them all */
        if (i == 0 || strcmp(m->families[i - 1]->name, f->name) != 0)
            tdm_buf_printf(out, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help, f->name, type);
        if (f->type == TANDEM__V1__METRIC_TYPE__METRIC_TYPE_HISTOGRAM) {
            if (f->histogram)
                histogram(out, f);
            continue;
        }
        for (size_t j = 0; j < f->n_samples; j++)
            sample(out, f->name, f->samples[j]);
    }
    return out->oom ? TDM_ERESOURCE : TDM_OK;
}

const Tandem__V1__MetricFamily *tdm_proto_metrics_find(const Tandem__V1__MetricsResponse *m,
                                                       const char *name)
{
    for (size_t i = 0; i < m->n_families; i++)
        if (strcmp(m->families[i]->name, name) == 0)
            return m->families[i];
    return NULL;
}
