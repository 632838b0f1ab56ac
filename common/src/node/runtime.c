/* runtime.c - a node's model, tokenizer, KV pool (sized from its memory budget), engine and
 * worker, opened together and closed together. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "tandem/node.h"

static double mib(uint64_t b)
{
    return (double)b / (1024.0 * 1024.0);
}

/* The engine's scratch size for ep, measured with a one-block pool, so that the KV pool gets
 * exactly what the budget leaves. */
static int measure_scratch(tdm_node_runtime_t *rt, const tdm_engine_params_t *ep, tdm_error_t *err)
{
    tdm_kv_pool_t *probe_pool = tdm_kv_pool_new(&rt->layout, 1, err);
    if (!probe_pool)
        return err ? err->code : TDM_ERESOURCE;
    tdm_engine_t *probe = tdm_engine_new(rt->model, probe_pool, ep, err);
    if (!probe) {
        tdm_kv_pool_destroy(&probe_pool);
        return err ? err->code : TDM_EINVALID;
    }
    rt->scratch_bytes = tdm_engine_scratch_bytes(probe);
    tdm_engine_destroy(&probe);
    tdm_kv_pool_destroy(&probe_pool);
    return TDM_OK;
}

/* The pool's blocks: the capacity planner's arithmetic (tdm_kv_plan, as tandem kvcalc and the
 * dashboard print it), for one full-context sequence at least. TDM_ERESOURCE with the
 * numbers when the budget does not hold that. */
static int size_pool(const tdm_node_runtime_t *rt, const tdm_node_config_t *node,
                     uint32_t *n_blocks_out, uint64_t *block_bytes_out, tdm_error_t *err)
{
    tdm_kv_plan_in_t pin = {rt->layout,        0,    rt->n_ctx,          1, rt->weight_bytes,
                            rt->scratch_bytes, true, node->memory_budget};
    tdm_kv_plan_t plan;
    int rc = tdm_kv_plan(&pin, &plan, err);
    if (rc != TDM_OK)
        return rc;
    uint64_t block_bytes = plan.block_bytes;
    uint64_t need_blocks = plan.blocks_per_seq;
    uint64_t fixed = rt->weight_bytes + rt->scratch_bytes;
    uint64_t n_blocks = plan.pool_blocks;
    if (n_blocks > UINT32_MAX - 1)
        n_blocks = UINT32_MAX - 1;
    if (n_blocks < need_blocks)
        return tdm_error_set(
            err, TDM_ERESOURCE,
            "node '%s': memory_budget %.1f MiB holds the weights (%.1f MiB) and engine scratch "
            "(%.1f MiB) but only %" PRIu64 " KV blocks of %" PRIu64 " bytes; one sequence of the "
            "full context (%u tokens) needs %" PRIu64 " blocks (%.1f MiB): raise memory_budget "
            "to at least %.1f MiB",
            node->id, mib(node->memory_budget), mib(rt->weight_bytes), mib(rt->scratch_bytes),
            n_blocks, block_bytes, rt->n_ctx, need_blocks, mib(need_blocks * block_bytes),
            mib(fixed + need_blocks * block_bytes) + 0.1);
    *n_blocks_out = (uint32_t)n_blocks;
    *block_bytes_out = block_bytes;
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
    rt->pool = tdm_kv_pool_new(&rt->layout, n_blocks, err);
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
    };
    rt->worker = tdm_worker_new(rt->engine, rt->pool, rt->tok, rt->n_vocab, &wo, err);
    if (!rt->worker)
        return err ? err->code : TDM_ERESOURCE;
    return TDM_OK;
}

int tdm_node_runtime_open(tdm_node_runtime_t *rt, const tdm_config_t *cfg,
                          const tdm_node_config_t *node, tdm_worker_mode_t mode, tdm_error_t *err)
{
    memset(rt, 0, sizeof *rt);
    if (node->device.kind != TDM_NODE_DEVICE_CPU)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "node '%s': device cuda:%d: the CUDA engine backend is not available "
                             "in this build; use device: cpu",
                             node->id, node->device.index);
    int rc = tdm_node_keys_open(&rt->keys, cfg, node, err);
    if (rc != TDM_OK)
        return rc;
    /* the same loader as the router's: context, vocabulary, fingerprint and layout agree */
    tdm_served_model_t sm;
    if ((rc = tdm_served_model_open(&sm, cfg, err)) != TDM_OK)
        goto out_close;
    rt->model = sm.model; /* the runtime owns them from here (tdm_node_runtime_close) */
    rt->tok = sm.tok;
    rt->n_vocab = sm.n_vocab;
    rt->n_ctx = sm.n_ctx;
    rt->fingerprint = sm.fingerprint;
    rt->layout = sm.layout;
    rt->weight_bytes = tdm_model_weight_bytes(rt->model);

    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_threads = node->threads;
    ep.n_ctx = rt->n_ctx;
    ep.max_batch_tokens = (uint32_t)node->max_batch_tokens;
    /* the decode row of each running sequence and the draft rows of speculative decoding */
    tdm_worker_opts_t rows = {.mode = mode,
                              .max_running = (uint32_t)node->max_running,
                              .max_draft = (uint32_t)node->spec_max_draft};
    ep.max_logits = tdm_worker_logit_rows(&rows);
    uint32_t n_blocks = 0;
    uint64_t block_bytes = 0;
    if ((rc = measure_scratch(rt, &ep, err)) != TDM_OK ||
        (rc = size_pool(rt, node, &n_blocks, &block_bytes, err)) != TDM_OK)
        goto out_close;
    rt->kv_bytes = (uint64_t)n_blocks * block_bytes;
    if ((rc = open_grammars(rt, node, err)) != TDM_OK ||
        (rc = open_engine(rt, cfg, node, &ep, mode, n_blocks, err)) != TDM_OK)
        goto out_close;
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
