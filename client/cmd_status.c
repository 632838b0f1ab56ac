/* cmd_status.c - `tandem status`: the cluster as the router sees it, as a table or JSON. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/client.h"

#define CMD "tandem status"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem status [--json] [--router ENDPOINT] [--api-key KEY] [--timeout S]\n"
            "\n"
            "Prints the router's view of the cluster: per node its role, whether it is up (or\n"
            "suspect: silent for the heartbeat timeout, given no new work), KV\n"
            "blocks used/total, cached blocks, running and waiting sequences, queued prefill\n"
            "tokens, mean step time and the age of its last heartbeat; then the KV transport\n"
            "(tcp, nccl, cuda_ipc) the router chooses for each pair of prefill and decode nodes\n"
            "that are up.\n"
            "\n"
            "      --json                print JSON instead of a table\n"
            "      --router ENDPOINT     router client endpoint (default $TANDEM_ROUTER or\n"
            "                            " TDM_CLIENT_DEFAULT_ENDPOINT ")\n"
            "      --api-key KEY         API key (default $TANDEM_API_KEY)\n"
            "      --timeout SECONDS     how long to wait for the answer (default 10)\n"
            "  -h, --help                this help\n");
}

static double pct(uint64_t part, uint64_t whole)
{
    return whole ? 100.0 * (double)part / (double)whole : 0.0;
}

/* The KV transport of each (prefill, decode) pair, with each GPU node's GPU. */
static void print_kv_routes(const tdm_client_cluster_status_t *s)
{
    if (s->n_kv_routes > 0)
        printf("\n%-16s %-16s %-9s\n", "KV FROM", "TO", "TRANSPORT");
    for (size_t i = 0; i < s->n_kv_routes; i++)
        printf("%-16s %-16s %-9s\n", s->kv_routes[i].prefill_node_id,
               s->kv_routes[i].decode_node_id, s->kv_routes[i].transport);
    bool any = false;
    for (size_t i = 0; i < s->n_nodes; i++)
        any = any || s->nodes[i].gpu_uuid[0];
    if (any)
        printf("\n%-16s %-41s %s\n", "NODE", "GPU", "HOST");
    for (size_t i = 0; i < s->n_nodes; i++)
        if (s->nodes[i].gpu_uuid[0])
            printf("%-16s %-41s %s\n", s->nodes[i].node_id, s->nodes[i].gpu_uuid,
                   s->nodes[i].host_id[0] ? s->nodes[i].host_id : "?");
}

/* With several models, a line per model: its state, nodes up and requests (MODELS). */
static void print_models(const tdm_client_models_t *m)
{
    if (m->n_models < 2)
        return;
    printf("%-16s %-12s %10s %10s %8s %8s %8s\n", "MODEL", "STATE", "PREFILL UP", "DECODE UP",
           "CONTEXT", "RUNNING", "QUEUED");
    for (size_t i = 0; i < m->n_models; i++) {
        const tdm_client_model_t *x = &m->models[i];
        printf("%-16s %-12s %10" PRIu32 " %10" PRIu32 " %8" PRIu32 " %8" PRIu32 " %8" PRIu32 "\n",
               x->name, x->state[0] ? x->state : "?", x->prefill_nodes_up, x->decode_nodes_up,
               x->n_ctx, x->requests_running, x->requests_queued);
    }
    putchar('\n');
}

static void print_table(const char *endpoint, const tdm_client_cluster_status_t *s,
                        const tdm_client_models_t *m)
{
    if (m->n_models > 1)
        printf("router %s, version %s, %zu models (default %s)\n", endpoint,
               s->version[0] ? s->version : "?", m->n_models, s->model[0] ? s->model : "?");
    else if (m->n_models == 1)
        printf("router %s, version %s, model %s, context %" PRIu32 " tokens\n", endpoint,
               s->version[0] ? s->version : "?", s->model[0] ? s->model : "?", m->models[0].n_ctx);
    else
        printf("router %s, version %s, model %s\n", endpoint, s->version[0] ? s->version : "?",
               s->model[0] ? s->model : "?");
    printf("requests: %" PRIu32 " running, %" PRIu32 " queued, %" PRIu64 " total\n\n",
           s->requests_running, s->requests_queued, s->requests_total);
    print_models(m);
    printf("%-16s %-8s %-7s %-8s %-22s %8s %8s %8s %15s %9s %10s\n", "NODE", "ROLE", "UP", "DEVICE",
           "KV USED/TOTAL", "CACHED", "RUNNING", "WAITING", "QUEUED PREFILL", "STEP ms",
           "HEARTBEAT");
    for (size_t i = 0; i < s->n_nodes; i++) {
        const tdm_client_node_status_t *n = &s->nodes[i];
        char kv[48];
        snprintf(kv, sizeof kv, "%" PRIu32 "/%" PRIu32 " (%.1f%%)", n->kv_blocks_used,
                 n->kv_blocks_total, pct(n->kv_blocks_used, n->kv_blocks_total));
        char hb[24] = "never"; /* the router reports a negative age for no heartbeat yet */
        if (n->last_heartbeat_age_s >= 0)
            snprintf(hb, sizeof hb, "%.1f s", n->last_heartbeat_age_s);
        printf("%-16s %-8s %-7s %-8s %-22s %8" PRIu32 " %8" PRIu32 " %8" PRIu32 " %15" PRIu64
               " %9.1f %10s\n",
               n->node_id, n->role,
               n->suspect ? "suspect"
               : n->up    ? "yes"
                          : "no",
               n->device[0] ? n->device : "-", kv, n->kv_blocks_cached, n->running, n->waiting,
               n->queued_prefill_tokens, n->step_time_s * 1e3, hb);
    }
    if (s->n_nodes == 0)
        printf("(no nodes registered)\n");
    bool several = false;
    for (size_t i = 1; i < s->n_nodes; i++)
        several = several || strcmp(s->nodes[i].model, s->nodes[0].model) != 0;
    if (several) {
        printf("\n%-16s %s\n", "NODE", "MODEL");
        for (size_t i = 0; i < s->n_nodes; i++)
            printf("%-16s %s\n", s->nodes[i].node_id, s->nodes[i].model);
    }
    bool any = s->n_refused > 0;
    for (size_t i = 0; i < s->n_nodes; i++)
        any = any || s->nodes[i].refused_reason[0];
    if (any)
        printf("\nrefused registrations:\n");
    for (size_t i = 0; i < s->n_nodes; i++)
        if (s->nodes[i].refused_reason[0])
            printf("  %-16s %.0f s ago: %s\n", s->nodes[i].node_id, s->nodes[i].refused_age_s,
                   s->nodes[i].refused_reason);
    for (size_t i = 0; i < s->n_refused; i++)
        printf("  %-16s %.0f s ago (%" PRIu64 " time%s): %s\n", s->refused[i].node_id,
               s->refused[i].age_s, s->refused[i].count, s->refused[i].count == 1 ? "" : "s",
               s->refused[i].reason);
    print_kv_routes(s);
}

/* The refused registrations as a JSON array; NULL on out of memory. */
static json_t *refused_json(const tdm_client_cluster_status_t *s)
{
    json_t *refused = json_array();
    for (size_t i = 0; refused && i < s->n_refused; i++) {
        json_t *o = json_pack("{s:s, s:s, s:f, s:I}", "node_id", s->refused[i].node_id, "reason",
                              s->refused[i].reason, "age_s", s->refused[i].age_s, "count",
                              (json_int_t)s->refused[i].count);
        if (!o || json_array_append_new(refused, o) != 0) {
            json_decref(refused);
            refused = NULL;
        }
    }
    return refused;
}

/* The KV transport of each (prefill, decode) pair as a JSON array; NULL on out of memory. */
static json_t *routes_json(const tdm_client_cluster_status_t *s)
{
    json_t *routes = json_array();
    for (size_t i = 0; routes && i < s->n_kv_routes; i++) {
        json_t *o = json_pack("{s:s, s:s, s:s}", "prefill_node_id", s->kv_routes[i].prefill_node_id,
                              "decode_node_id", s->kv_routes[i].decode_node_id, "transport",
                              s->kv_routes[i].transport);
        if (!o || json_array_append_new(routes, o) != 0) {
            json_decref(routes);
            routes = NULL;
        }
    }
    return routes;
}

/* Builds the JSON document; NULL on out of memory. */
/* The served models as a JSON array (MODELS; empty when that call failed); NULL on out of
 * memory. */
static json_t *models_json(const tdm_client_models_t *m)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < m->n_models; i++) {
        const tdm_client_model_t *x = &m->models[i];
        json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:I, s:I, s:I}", "name", x->name, "state",
                              x->state, "max_model_len", (json_int_t)x->n_ctx, "prefill_nodes_up",
                              (json_int_t)x->prefill_nodes_up, "decode_nodes_up",
                              (json_int_t)x->decode_nodes_up, "requests_running",
                              (json_int_t)x->requests_running, "requests_queued",
                              (json_int_t)x->requests_queued);
        if (!o || json_array_append_new(a, o) != 0) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static json_t *status_json(const char *endpoint, const tdm_client_cluster_status_t *s,
                           const tdm_client_models_t *m)
{
    json_t *nodes = json_array();
    if (!nodes)
        return NULL;
    for (size_t i = 0; i < s->n_nodes; i++) {
        const tdm_client_node_status_t *n = &s->nodes[i];
        json_t *o = json_pack(
            "{s:s, s:s, s:s, s:b, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, "
            "s:f}",
            "node_id", n->node_id, "role", n->role, "device", n->device, "up", n->up,
            "kv_blocks_used", (json_int_t)n->kv_blocks_used, "kv_blocks_total",
            (json_int_t)n->kv_blocks_total, "kv_used_pct",
            pct(n->kv_blocks_used, n->kv_blocks_total), "kv_blocks_cached",
            (json_int_t)n->kv_blocks_cached, "reserved_blocks", (json_int_t)n->reserved_blocks,
            "running", (json_int_t)n->running, "waiting", (json_int_t)n->waiting, "batch_size",
            (json_int_t)n->batch_size, "queued_prefill_tokens",
            (json_int_t)n->queued_prefill_tokens, "prefix_queries", (json_int_t)n->prefix_queries,
            "prefix_hits", (json_int_t)n->prefix_hits, "step_time_ms", n->step_time_s * 1e3,
            "last_heartbeat_age_s", n->last_heartbeat_age_s);
        char inst[17];
        snprintf(inst, sizeof inst, "%016" PRIx64, n->instance_id);
        if (o && (json_object_set_new(o, "instance_id", json_string(n->instance_id ? inst : "")) ||
                  json_object_set_new(o, "suspect", json_boolean(n->suspect)) ||
                  json_object_set_new(o, "kv_layer_groups",
                                      json_integer((json_int_t)n->kv_layer_groups)) ||
                  json_object_set_new(o, "refused_reason", json_string(n->refused_reason)) ||
                  json_object_set_new(o, "refused_age_s", json_real(n->refused_age_s)) ||
                  json_object_set_new(o, "host_id", json_string(n->host_id)) ||
                  json_object_set_new(o, "gpu_uuid", json_string(n->gpu_uuid)) ||
                  json_object_set_new(o, "model", json_string(n->model)))) {
            json_decref(o);
            o = NULL;
        }
        if (!o || json_array_append_new(nodes, o) != 0) {
            json_decref(nodes);
            return NULL;
        }
    }
    json_t *refused = refused_json(s), *routes = routes_json(s), *models = models_json(m);
    if (!refused || !routes || !models) {
        json_decref(nodes);
        json_decref(refused);
        json_decref(routes);
        json_decref(models);
        return NULL;
    }
    return json_pack("{s:s, s:s, s:s, s:o, s:I, s:I, s:I, s:o, s:o, s:o}", "router", endpoint,
                     "version", s->version, "model", s->model, "models", models, "requests_running",
                     (json_int_t)s->requests_running, "requests_queued",
                     (json_int_t)s->requests_queued, "requests_total",
                     (json_int_t)s->requests_total, "nodes", nodes, "refused", refused, "kv_routes",
                     routes);
}

/* Prints s as JSON (--json) or as the table. Returns 0, or 1 when writing the JSON failed. */
static int print_status(const char *endpoint, const tdm_client_cluster_status_t *s,
                        const tdm_client_models_t *m, bool json)
{
    if (!json) {
        print_table(endpoint, s, m);
        return 0;
    }
    int status = 0;
    json_t *doc = status_json(endpoint, s, m);
    if (!doc || json_dumpf(doc, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0) {
        fprintf(stderr, CMD ": writing JSON failed\n");
        status = 1;
    } else {
        putchar('\n');
    }
    json_decref(doc);
    return status;
}

int tdm_cmd_status(int argc, char **argv)
{
    bool json = false, done;
    const char *router = NULL, *api_key = NULL;
    double timeout_s = 10;
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_TRUE("json", 0, &json),
        TDM_CLI_ROUTER_OPTS(&router, &api_key, &timeout_s),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {CMD, usage, NULL, opts};
    int status = tdm_cli_parse(&spec, argc, argv, &done);
    if (done)
        return status;
    if (optind != argc) {
        fprintf(stderr, CMD ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    tdm_cli_catch_interrupt(false);
    const char *endpoint = tdm_cli_router_endpoint(router);
    tdm_client_t *client =
        tdm_cli_connect(CMD, endpoint, tdm_cli_api_key(api_key), timeout_s, &status);
    if (!client)
        return status;
    tdm_client_cluster_status_t s;
    int rc = tdm_client_status(client, timeout_s, &s);
    if (rc != TDM_OK) {
        fprintf(stderr, CMD ": %s (%s)\n", tdm_client_errmsg(client), tdm_status_name(rc));
        tdm_client_destroy(&client);
        return tdm_cli_exit_status(rc);
    }
    /* the models and their state: a router that cannot answer (out of memory) leaves the
     * list empty, the rest of the status still printed */
    tdm_client_models_t models;
    if (tdm_client_models(client, timeout_s, &models) != TDM_OK)
        memset(&models, 0, sizeof models);
    status = print_status(endpoint, &s, &models, json);
    tdm_client_models_clear(&models);
    tdm_client_cluster_status_clear(&s);
    tdm_client_destroy(&client);
    return status;
}
