/* http_metrics.c - the HTTP gateway's counters (http_metrics.h).
 *
 * The counters live on the gateway object (no globals, so several gateways may run in one
 * process). Status codes index an array of atomics; refusal reasons fill a small table of slots
 * whose names are claimed once with a compare-and-swap (a name never changes after that), so
 * counting takes no lock and the scrape reads a consistent-enough snapshot. Refusals are
 * also counted by their status, which the scrape adds to the router's tandem_requests_total.
 */
#include "http_metrics.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/base.h"

#define REASON_MAX 48
#define STATUS_CODES 17 /* tdm status codes 0..-16, gRPC's */

typedef struct reason_slot {
    _Atomic int state; /* 0 free, 1 being named, 2 named */
    char name[REASON_MAX];
    atomic_uint_fast64_t n;
} reason_slot_t;

struct http_counters {
    atomic_uint_fast64_t by_code[600];
    reason_slot_t reasons[TDM_HTTP_REFUSAL_REASONS + 1];  /* the last: "other" */
    atomic_uint_fast64_t refused_by_status[STATUS_CODES]; /* [-status] */
};

http_counters_t *http_counters_new(void)
{
    return calloc(1, sizeof(http_counters_t)); /* zero: every count 0, every slot free */
}

void http_counters_destroy(http_counters_t **c_p)
{
    if (!c_p)
        return;
    free(*c_p);
    *c_p = NULL;
}

void http_counters_response(http_counters_t *c, unsigned status)
{
    atomic_fetch_add(&c->by_code[status >= 100 && status < 600 ? status : 0], 1);
}

/* The slot named reason, claiming a free one when none is; the "other" slot when full. */
static reason_slot_t *reason_slot(http_counters_t *c, const char *reason)
{
    for (size_t i = 0; i < TDM_HTTP_REFUSAL_REASONS; i++) {
        reason_slot_t *s = &c->reasons[i];
        int st = atomic_load(&s->state);
        if (st == 0) {
            int want = 0;
            if (atomic_compare_exchange_strong(&s->state, &want, 1)) {
                snprintf(s->name, sizeof s->name, "%s", reason);
                atomic_store(&s->state, 2);
                return s;
            }
            st = want;
        }
        while (st == 1) /* another thread is writing the name: a few instructions */
            st = atomic_load(&s->state);
        if (strncmp(s->name, reason, sizeof s->name - 1) == 0)
            return s;
    }
    return &c->reasons[TDM_HTTP_REFUSAL_REASONS];
}

void http_counters_refusal(http_counters_t *c, const char *reason, int status)
{
    /* The field without its index or key (messages[2] and logit_bias["7"] count as messages
     * and logit_bias): a client must not mint label values. */
    char top[REASON_MAX];
    snprintf(top, sizeof top, "%.*s", reason ? (int)strcspn(reason, "[") : 0, reason ? reason : "");
    atomic_fetch_add(&reason_slot(c, top[0] ? top : "request")->n, 1);
    int s = status < 0 && status > -STATUS_CODES ? -status : 2; /* else gRPC's UNKNOWN */
    atomic_fetch_add(&c->refused_by_status[s], 1);
}

/* Appends a family with n_samples slots (zeroed); NULL on out of memory. */
static Tandem__V1__MetricFamily *add_family(Tandem__V1__MetricsResponse *m, const char *name,
                                            const char *help)
{
    Tandem__V1__MetricFamily **fs = realloc(m->families, (m->n_families + 1) * sizeof *m->families);
    if (!fs)
        return NULL;
    m->families = fs;
    Tandem__V1__MetricFamily *f = malloc(sizeof *f);
    if (!f)
        return NULL;
    tandem__v1__metric_family__init(f);
    f->name = tdm_strdup(name);
    f->help = tdm_strdup(help);
    f->type = TANDEM__V1__METRIC_TYPE__METRIC_TYPE_COUNTER;
    fs[m->n_families++] = f;
    return f->name && f->help ? f : NULL;
}

/* Appends the sample {label=value} n to f, or {label=value, label2=value2} when label2 is not
 * NULL; false on out of memory. */
static bool add_sample(Tandem__V1__MetricFamily *f, const char *label, const char *value,
                       const char *label2, const char *value2, uint64_t n)
{
    Tandem__V1__MetricSample **ss = realloc(f->samples, (f->n_samples + 1) * sizeof *ss);
    if (!ss)
        return false;
    f->samples = ss;
    Tandem__V1__MetricSample *s = malloc(sizeof *s);
    Tandem__V1__MetricLabel **ls = s ? calloc(2, sizeof *ls) : NULL;
    if (!ls) {
        free(s);
        return false;
    }
    tandem__v1__metric_sample__init(s);
    s->labels = ls;
    s->value_case = TANDEM__V1__METRIC_SAMPLE__VALUE_INT_VALUE;
    s->int_value = n;
    ss[f->n_samples++] = s;
    const char *names[2] = {label, label2}, *values[2] = {value, value2};
    for (size_t i = 0; i < 2 && names[i]; i++) {
        Tandem__V1__MetricLabel *l = malloc(sizeof *l);
        if (!l)
            return false;
        tandem__v1__metric_label__init(l);
        ls[s->n_labels++] = l;
        l->name = tdm_strdup(names[i]);
        l->value = tdm_strdup(values[i]);
        if (!l->name || !l->value)
            return false;
    }
    return true;
}

static bool append_codes(http_counters_t *hc, Tandem__V1__MetricsResponse *m)
{
    Tandem__V1__MetricFamily *f =
        add_family(m, "tandem_http_requests_total",
                   "HTTP responses of the gateway by status code (every path; a stream counts "
                   "once, with the 200 that starts it).");
    bool ok = f != NULL;
    for (unsigned c = 0; ok && c < 600; c++) {
        uint64_t n = atomic_load(&hc->by_code[c]);
        char code[8];
        snprintf(code, sizeof code, "%u", c);
        if (n || c == 200) /* 200 always exists, so rate() sees its first increase */
            ok = add_sample(f, "code", code, NULL, NULL, n);
    }
    return ok;
}

static bool append_refusals(http_counters_t *c, Tandem__V1__MetricsResponse *m)
{
    Tandem__V1__MetricFamily *f =
        add_family(m, "tandem_http_requests_refused_total",
                   "OpenAI requests the gateway refused before they reached the router, by the "
                   "field at fault (reason \"request\": the body as a whole; \"other\": past the "
                   "first 64 distinct fields).");
    bool ok = f != NULL;
    for (size_t i = 0; ok && i < TDM_HTTP_REFUSAL_REASONS; i++)
        if (atomic_load(&c->reasons[i].state) == 2)
            ok = add_sample(f, "reason", c->reasons[i].name, NULL, NULL,
                            atomic_load(&c->reasons[i].n));
    uint64_t other = atomic_load(&c->reasons[TDM_HTTP_REFUSAL_REASONS].n);
    if (ok && other)
        ok = add_sample(f, "reason", "other", NULL, NULL, other);
    return ok;
}

/* Whether sample s has the label name="value". */
static bool has_label(const Tandem__V1__MetricSample *s, const char *name, const char *value)
{
    for (size_t i = 0; i < s->n_labels; i++)
        if (strcmp(s->labels[i]->name, name) == 0)
            return strcmp(s->labels[i]->value, value) == 0;
    return false;
}

/* Whether sample s has a label called name. */
static bool has_label_named(const Tandem__V1__MetricSample *s, const char *name)
{
    for (size_t i = 0; i < s->n_labels; i++)
        if (strcmp(s->labels[i]->name, name) == 0)
            return true;
    return false;
}

int http_counters_merge_refusals(http_counters_t *c, Tandem__V1__MetricsResponse *m)
{
    Tandem__V1__MetricFamily *f = NULL;
    for (size_t i = 0; i < m->n_families && !f; i++)
        if (strcmp(m->families[i]->name, "tandem_requests_total") == 0)
            f = m->families[i];
    const char *none = tdm_proto_finish_name(TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED);
    bool ok = true;
    for (int st = 0; f && ok && st < STATUS_CODES; st++) {
        uint64_t n = atomic_load(&c->refused_by_status[st]);
        const char *name = tdm_status_name(-st);
        Tandem__V1__MetricSample *s = NULL;
        for (size_t i = 0; n && i < f->n_samples && !s; i++)
            /* not a model's series: the gateway refused these before any model was chosen */
            if (has_label(f->samples[i], "status", name) &&
                has_label(f->samples[i], "finish_reason", none) &&
                !has_label_named(f->samples[i], "model_name"))
                s = f->samples[i];
        if (s)
            s->int_value += n;
        else if (n)
            ok = add_sample(f, "status", name, "finish_reason", none, n);
    }
    return ok ? TDM_OK : TDM_ERESOURCE;
}

int http_counters_append(http_counters_t *c, Tandem__V1__MetricsResponse *m)
{
    return http_counters_merge_refusals(c, m) == TDM_OK && append_codes(c, m) &&
                   append_refusals(c, m)
               ? TDM_OK
               : TDM_ERESOURCE;
}
