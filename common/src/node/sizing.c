/* sizing.c - how many KV blocks a node's pool gets: its budget (memory_budget, or
 * gpu_memory_utilization x the device's total memory, checked against its free memory) minus
 * the weights and engine scratch, through tdm_kv_plan. A pure function of the figures, so
 * that the arithmetic is tested without a GPU. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tandem/gguf.h"
#include "tandem/node_runtime.h"

static double mib(uint64_t b)
{
    return (double)b / (1024.0 * 1024.0);
}

/* The budget in bytes: memory_budget when set, else gpu_memory_utilization x total (device
 * nodes). A device node's budget must be free now. TDM_EINVALID / TDM_ERESOURCE with the
 * numbers otherwise. */
static int sizing_budget(const tdm_node_sizing_t *in, uint64_t *budget, tdm_error_t *err)
{
    if (!in->on_device) {
        *budget = in->memory_budget;
        if (in->host_memory_bytes && *budget > in->host_memory_bytes)
            return tdm_error_set_field(
                err, TDM_ERESOURCE, "memory_budget",
                "memory_budget %" PRIu64 " bytes (%.1f MiB) of node '%s' is more than this "
                "host's memory, %" PRIu64 " bytes (%.1f MiB; the cgroup limit where lower): "
                "lower memory_budget",
                *budget, mib(*budget), in->node_id, in->host_memory_bytes,
                mib(in->host_memory_bytes));
        return TDM_OK;
    }
    if (in->memory_budget)
        *budget = in->memory_budget;
    else if (in->gpu_memory_utilization > 0 && in->gpu_memory_utilization <= 1)
        *budget = (uint64_t)floor(in->gpu_memory_utilization * (double)in->device_total_bytes);
    else
        return tdm_error_set(err, TDM_EINVALID,
                             "node '%s': gpu_memory_utilization %g is not in (0, 1]", in->node_id,
                             in->gpu_memory_utilization);
    if (*budget > in->device_free_bytes)
        return tdm_error_set(
            err, TDM_ERESOURCE,
            "node '%s': cuda:%d: budget %" PRIu64 " bytes (%.1f MiB; gpu_memory_utilization %.3f "
            "of %" PRIu64 " bytes total) is more than the %" PRIu64 " bytes (%.1f MiB) free on "
            "the device now: another process holds the rest; lower gpu_memory_utilization to at "
            "most %.3f",
            in->node_id, in->device_index, *budget, mib(*budget),
            in->memory_budget ? (double)in->memory_budget / (double)in->device_total_bytes
                              : in->gpu_memory_utilization,
            in->device_total_bytes, in->device_free_bytes, mib(in->device_free_bytes),
            floor(1000.0 * (double)in->device_free_bytes / (double)in->device_total_bytes) /
                1000.0);
    return TDM_OK;
}

/* The refusal when the pool holds less than one full-context sequence. */
static int sizing_refuse(const tdm_node_sizing_t *in, uint64_t budget, const tdm_kv_plan_t *plan,
                         tdm_error_t *err)
{
    uint64_t seq = plan->blocks_per_seq * plan->block_bytes;
    uint64_t need = in->weight_bytes + in->scratch_bytes + seq;
    if (in->on_device)
        return tdm_error_set(
            err, TDM_ERESOURCE,
            "node '%s': cuda:%d: budget %" PRIu64 " bytes (total %" PRIu64 ", free %" PRIu64
            "), less the weights (%" PRIu64 " bytes on the device) and engine scratch (%" PRIu64
            " bytes), leaves %" PRIu64 " KV blocks of %" PRIu64 " bytes; one sequence of the "
            "full context (%u tokens) needs %" PRIu64 " blocks (%" PRIu64 " bytes): the budget "
            "must be at least %" PRIu64 " bytes (%.1f MiB)",
            in->node_id, in->device_index, budget, in->device_total_bytes, in->device_free_bytes,
            in->weight_bytes, in->scratch_bytes, plan->pool_blocks, plan->block_bytes, in->n_ctx,
            plan->blocks_per_seq, seq, need, mib(need) + 0.1);
    return tdm_error_set(
        err, TDM_ERESOURCE,
        "node '%s': memory_budget %.1f MiB, less the weights (%.1f MiB) and engine scratch "
        "(%.1f MiB), leaves %" PRIu64 " KV blocks of %" PRIu64 " bytes; one sequence of the "
        "full context (%u tokens, the model's max_context) needs %" PRIu64 " blocks (%.1f "
        "MiB): raise memory_budget to at least %.1f MiB, or lower max_context",
        in->node_id, mib(budget), mib(in->weight_bytes), mib(in->scratch_bytes), plan->pool_blocks,
        plan->block_bytes, in->n_ctx, plan->blocks_per_seq, mib(seq), mib(need) + 0.1);
}

int tdm_node_size_pool(const tdm_node_sizing_t *in, tdm_node_pool_size_t *out, tdm_error_t *err)
{
    memset(out, 0, sizeof *out);
    uint64_t budget = 0;
    int rc = sizing_budget(in, &budget, err);
    if (rc != TDM_OK)
        return rc;
    tdm_kv_plan_in_t pin = {.layout = in->layout,
                            .n_ctx = in->n_ctx,
                            .n_users = 1,
                            .weight_bytes = in->weight_bytes,
                            .scratch_bytes = in->scratch_bytes,
                            .have_memory = true,
                            .memory_bytes = budget,
                            .groups = in->groups};
    tdm_kv_plan_t plan;
    if ((rc = tdm_kv_plan(&pin, &plan, err)) != TDM_OK)
        return rc;
    if (plan.pool_blocks < plan.blocks_per_seq)
        return sizing_refuse(in, budget, &plan, err);
    out->budget_bytes = budget;
    out->block_bytes = plan.block_bytes;
    /* a pool addresses at most 2^32 - 2 blocks (TDM_KV_NO_BLOCK is "none") */
    out->n_blocks = plan.pool_blocks > UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)plan.pool_blocks;
    return TDM_OK;
}

bool tdm_model_kv_groups(const tdm_llama_hparams_t *hp, tdm_kv_groups_t *groups)
{
    if (hp->n_layers == 0 || hp->n_layers > TDM_KV_MAX_LAYERS)
        return false;
    uint32_t windows[TDM_KV_MAX_LAYERS];
    bool any = false;
    for (uint32_t l = 0; l < hp->n_layers; l++)
        any |= (windows[l] = tdm_llama_layer_window(hp, l)) != 0;
    return any && tdm_kv_groups_init(groups, hp->n_layers, windows, NULL) == TDM_OK;
}

bool tdm_node_kv_groups(const tdm_config_t *cfg, const tdm_node_config_t *node,
                        const tdm_llama_hparams_t *hp, tdm_kv_groups_t *groups)
{
    if (node->device.kind != TDM_NODE_DEVICE_CPU)
        return false;
    /* KV travels between any prefill and decode node of one model (transfer, migration) only
     * between pools that allocate alike: a CUDA node of the model allocates every layer, so
     * all its nodes do; other models' nodes never exchange KV with it */
    size_t model = tdm_config_node_model_index(cfg, node);
    for (size_t i = 0; i < cfg->n_nodes; i++)
        if (cfg->nodes[i].device.kind != TDM_NODE_DEVICE_CPU &&
            tdm_config_node_model_index(cfg, &cfg->nodes[i]) == model)
            return false;
    return tdm_model_kv_groups(hp, groups);
}
