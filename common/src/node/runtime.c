/* runtime.c - a node's model, tokenizer, KV pool (sized from its memory budget), engine and
 * worker, opened together and closed together. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "tandem/node_runtime.h"
#include "tandem/serve.h"

int tdm_node_measure_engine(const tdm_model_t *model, const tdm_kv_layout_t *layout,
                            const tdm_engine_params_t *ep, bool on_device, uint64_t *weight_bytes,
                            uint64_t *scratch_bytes, tdm_error_t *err)
{
    tdm_kv_pool_t *probe_pool = tdm_kv_pool_new(layout, 1, err);
    if (!probe_pool)
        return err ? err->code : TDM_ERESOURCE;
    tdm_engine_t *probe = tdm_engine_new(model, probe_pool, ep, err);
    if (!probe) {
        tdm_kv_pool_destroy(&probe_pool);
        return err ? err->code : TDM_EINVALID;
    }
    if (on_device) {
        tdm_engine_device_bytes(probe, weight_bytes, scratch_bytes);
    } else {
        uint64_t w = tdm_model_weight_bytes(model);
        uint64_t released = tdm_engine_released_weight_bytes(probe);
        *weight_bytes = w - (released < w ? released : w);
        /* the worker's prompt-logprobs reserve is host memory the node holds besides its
         * KV: in the budget of a CPU node (a device node's budget is device memory) */
        *scratch_bytes = tdm_engine_scratch_bytes(probe) + tdm_worker_plp_reserve(ep->n_ctx);
    }
    tdm_engine_destroy(&probe);
    tdm_kv_pool_destroy(&probe_pool);
    return TDM_OK;
}

/* The engine's weights and scratch in the budget's memory for ep, measured with a one-block
 * pool, so that the KV pool gets exactly what the budget leaves (tdm_node_measure_engine). */
static int measure_engine(tdm_node_runtime_t *rt, const tdm_engine_params_t *ep, tdm_error_t *err)
{
    return tdm_node_measure_engine(rt->model, &rt->layout, ep, rt->on_device, &rt->weight_bytes,
                                   &rt->scratch_bytes, err);
}

/* The UUIDs of the GPUs this process sees (for the router's transport choice). */
static int list_gpus(tdm_node_runtime_t *rt, tdm_error_t *err)
{
    int n = 0;
    int rc = tdm_device_cuda_count(&n, err);
    for (int i = 0; rc == TDM_OK && i < n && rt->n_gpu_uuids < TDM_NODE_MAX_GPUS; i++)
        rc = tdm_device_cuda_uuid(i, rt->gpu_uuids[rt->n_gpu_uuids++], err);
    return rc;
}

/* device: cuda:N: the device's memory now and its UUID, and the engine's backend on it.
 * Nothing to do on the CPU. TDM_EPRECONDITION in a build without CUDA. */
static int open_device(tdm_node_runtime_t *rt, const tdm_node_config_t *node,
                       tdm_engine_params_t *ep, tdm_error_t *err)
{
    if (node->device.kind == TDM_NODE_DEVICE_CPU)
        return TDM_OK;
    int index = node->device.index;
    if (!tdm_device_cuda_built())
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "node '%s': device cuda:%d: this build has no CUDA backend "
                             "(configure with -DTANDEM_CUDA=ON); use device: cpu",
                             node->id, index);
    rt->on_device = true;
    rt->device_index = index;
    int rc = tdm_device_cuda_memory(index, &rt->device_total_bytes, &rt->device_free_bytes, err);
    if (rc == TDM_OK)
        rc = tdm_device_cuda_uuid(index, rt->gpu_uuid, err);
    if (rc == TDM_OK)
        rc = list_gpus(rt, err);
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc, "node '%s': device cuda:%d: ", node->id, index);
    ep->backend = "cuda";
    ep->device = index;
    return TDM_OK;
}

/* The pool's blocks for the measured engine (tdm_node_size_pool). */
static int size_pool(tdm_node_runtime_t *rt, const tdm_node_config_t *node, uint32_t *n_blocks,
                     tdm_error_t *err)
{
    tdm_node_sizing_t in = {node->id,
                            rt->layout,
                            rt->n_ctx,
                            rt->weight_bytes,
                            rt->scratch_bytes,
                            node->memory_budget,
                            rt->on_device,
                            rt->device_index,
                            node->gpu_memory_utilization,
                            rt->device_total_bytes,
                            rt->device_free_bytes,
                            rt->on_device ? 0 : tdm_node_host_memory(),
                            rt->kv_grouped ? &rt->groups : NULL};
    tdm_node_pool_size_t ps;
    int rc = tdm_node_size_pool(&in, &ps, err);
    if (rc != TDM_OK)
        return rc;
    *n_blocks = ps.n_blocks;
    rt->budget_bytes = ps.budget_bytes;
    rt->kv_bytes = (uint64_t)ps.n_blocks * ps.block_bytes;
    return TDM_OK;
}

/* Structured output: the vocabulary the token masks are computed over (once, from the
 * tokenizer) and the cache of compiled grammars. */
static int open_grammars(tdm_node_runtime_t *rt, const tdm_node_config_t *node, tdm_error_t *err)
{
    rt->grammar_vocab = tdm_grammar_vocab_new(rt->tok, err);
    if (!rt->grammar_vocab)
        return err ? err->code : TDM_ERESOURCE;
    rt->grammars = tdm_grammar_cache_new((size_t)node->grammar_cache_bytes, err);
    return rt->grammars ? TDM_OK : TDM_ERESOURCE;
}

/* The pool, the engine over it and the worker, once the pool is sized. */
static int open_engine(tdm_node_runtime_t *rt, const tdm_config_t *cfg,
                       const tdm_node_config_t *node, const tdm_engine_params_t *ep,
                       tdm_worker_mode_t mode, uint32_t n_blocks, tdm_error_t *err)
{
    rt->pool = rt->kv_grouped ? tdm_kv_pool_new_grouped(&rt->layout, &rt->groups, n_blocks, err)
                              : tdm_kv_pool_new(&rt->layout, n_blocks, err);
    if (!rt->pool)
        return err ? err->code : TDM_ERESOURCE;
    rt->engine = tdm_engine_new(rt->model, rt->pool, ep, err);
    if (!rt->engine)
        return err ? err->code : TDM_EINVALID;
    tdm_worker_opts_t wo = {
        .mode = mode,
        .max_batch_tokens = (uint32_t)node->max_batch_tokens,
        .max_running = (uint32_t)node->max_running,
        .max_waiting = TDM_NODE_MAX_WAITING,
        .n_ctx = rt->n_ctx,
        .prefix_caching = cfg->kv.prefix_caching,
        /* a decode node prefilling locally (no prefill node up, or recompute after
         * preemption) takes small chunks, so its running sequences keep getting tokens */
        .max_prefill_chunk = mode == TDM_WORKER_MODE_DECODE ? 256u : 0u,
        .grammar_vocab = rt->grammar_vocab,
        .max_draft = (uint32_t)node->spec_max_draft, /* off in PREFILL mode and for q8 KV */
        .spec_row_cost = node->spec_row_cost,
    };
    rt->worker = tdm_worker_new(rt->engine, rt->pool, rt->tok, rt->n_vocab, &wo, err);
    if (!rt->worker)
        return err ? err->code : TDM_ERESOURCE;
    return TDM_OK;
}

/* The node's model, measured engine and sized pool (*n_blocks) into rt (device opened, ep
 * set up by the caller); what is opened stays in rt for tdm_node_runtime_close. */
static int open_sized(tdm_node_runtime_t *rt, const tdm_config_t *cfg,
                      const tdm_node_config_t *node, tdm_worker_mode_t mode,
                      tdm_engine_params_t *ep, uint32_t *n_blocks, tdm_error_t *err)
{
    /* the same loader as the router's: context, vocabulary, fingerprint and layout agree */
    tdm_served_model_t sm;
    int rc = tdm_served_model_open_at(&sm, cfg, tdm_config_node_model_index(cfg, node), err);
    if (rc != TDM_OK)
        return rc;
    rt->model = sm.model; /* the runtime owns them from here (tdm_node_runtime_close) */
    rt->tok = sm.tok;
    rt->n_vocab = sm.n_vocab;
    rt->n_ctx = sm.n_ctx;
    rt->fingerprint = sm.fingerprint;
    rt->layout = sm.layout;
    rt->weight_bytes = tdm_model_weight_bytes(rt->model);
    /* a colocated decode node on the CPU keeps only the windows of sliding-window layers */
    rt->kv_grouped = tdm_node_kv_groups(cfg, node, tdm_model_hparams(rt->model), &rt->groups);

    ep->n_threads = node->threads;
    ep->n_ctx = rt->n_ctx;
    ep->max_batch_tokens = (uint32_t)node->max_batch_tokens;
    /* the decode row of each running sequence and the draft rows of speculative decoding */
    tdm_worker_opts_t rows = {.mode = mode,
                              .max_running = (uint32_t)node->max_running,
                              .max_draft = (uint32_t)node->spec_max_draft};
    ep->max_logits = tdm_worker_logit_rows(&rows);
    if ((rc = measure_engine(rt, ep, err)) != TDM_OK)
        return rc;
    return size_pool(rt, node, n_blocks, err);
}

int tdm_node_runtime_check(const tdm_config_t *cfg, const tdm_node_config_t *node,
                           tdm_worker_mode_t mode, uint64_t *kv_bytes, tdm_error_t *err)
{
    *kv_bytes = 0;
    if (node->device.kind != TDM_NODE_DEVICE_CPU)
        return TDM_EPRECONDITION;
    tdm_node_runtime_t rt;
    memset(&rt, 0, sizeof rt);
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    uint32_t n_blocks = 0;
    int rc = open_sized(&rt, cfg, node, mode, &ep, &n_blocks, err);
    if (rc == TDM_OK)
        *kv_bytes = rt.kv_bytes;
    tdm_node_runtime_close(&rt);
    return rc;
}

int tdm_node_runtime_open(tdm_node_runtime_t *rt, const tdm_config_t *cfg,
                          const tdm_node_config_t *node, tdm_worker_mode_t mode, tdm_error_t *err)
{
    memset(rt, 0, sizeof *rt);
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    int rc = open_device(rt, node, &ep, err);
    if (rc != TDM_OK) {
        memset(rt, 0, sizeof *rt);
        return rc;
    }
    if ((rc = tdm_node_keys_open(&rt->keys, cfg, node, err)) != TDM_OK)
        return rc;
    uint32_t n_blocks = 0;
    if ((rc = open_sized(rt, cfg, node, mode, &ep, &n_blocks, err)) != TDM_OK)
        goto out_close;
    if ((rc = open_grammars(rt, node, err)) != TDM_OK ||
        (rc = open_engine(rt, cfg, node, &ep, mode, n_blocks, err)) != TDM_OK)
        goto out_close;
    /* a cuda engine keeps KV in its device copy: the transport reads and writes there */
    rt->kv_device_base = tdm_engine_kv_device_base(rt->engine);
    return 0;
out_close:
    tdm_node_runtime_close(rt);
    return rc;
}

void tdm_node_runtime_close(tdm_node_runtime_t *rt)
{
    if (!rt)
        return;
    tdm_worker_destroy(&rt->worker);
    tdm_grammar_cache_destroy(&rt->grammars); /* after the worker and every request */
    tdm_grammar_vocab_destroy(&rt->grammar_vocab);
    tdm_engine_destroy(&rt->engine);
    tdm_kv_pool_destroy(&rt->pool);
    tdm_tokenizer_destroy(&rt->tok);
    tdm_model_destroy(&rt->model);
    tdm_node_keys_close(&rt->keys);
    memset(rt, 0, sizeof *rt);
}
