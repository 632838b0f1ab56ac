/* node_runtime.h - what a node computes with: model, tokenizer, KV pool sized from its memory
 * budget, engine, continuous-batching worker and grammar cache, opened and closed together;
 * the sizing of its KV pool; which config entry it is. Owned by the engine thread. */
#ifndef TANDEM_NODE_RUNTIME_H
#define TANDEM_NODE_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/constraint.h"
#include "tandem/device.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/node_keys.h"
#include "tandem/tokenizer.h"
#include "tandem/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* TDM_NODE_MAX_WAITING (limits.h): requests a node queues beyond its running batch
 * (node.max_running), its worker's max_waiting; its request table holds max_running + that. */

/* GPUs a node lists at registration, at most (the UUIDs of the first ones it sees). */
#define TDM_NODE_MAX_GPUS 16

typedef struct tdm_node_runtime {
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *worker;
    tdm_kv_layout_t layout;
    uint32_t n_ctx; /* tokens per sequence at most */
    uint32_t n_vocab;
    uint64_t fingerprint;                           /* tdm_model_fingerprint */
    uint64_t weight_bytes, scratch_bytes, kv_bytes; /* the budget's split (device bytes on
                                                       a cuda node) */
    uint64_t budget_bytes;                          /* what the split divides */
    bool kv_grouped;        /* the pool allocates per layer group (tdm_node_kv_groups) */
    tdm_kv_groups_t groups; /* those groups (kv_grouped only); the pool keeps its own copy */
    bool on_device;         /* device: cuda:N (the engine's backend is cuda, KV on the device) */
    int device_index;       /* N of cuda:N */
    void *kv_device_base;   /* the engine's device copy of the pool (tdm_engine_kv_device_base);
                               NULL on the CPU */
    uint64_t device_total_bytes, device_free_bytes;         /* cudaMemGetInfo at start */
    char gpu_uuid[TDM_DEVICE_UUID_MAX];                     /* the node's GPU ("" on the CPU) */
    char gpu_uuids[TDM_NODE_MAX_GPUS][TDM_DEVICE_UUID_MAX]; /* every GPU it sees (cuda) */
    uint32_t n_gpu_uuids;                                   /* 0 on the CPU */
    tdm_node_keys_t keys; /* the node's CURVE keys, loaded before the model */

    /* structured output */
    tdm_grammar_vocab_t *grammar_vocab; /* the tokenizer's vocabulary for token masks, built
                                           once at open; the worker's */
    tdm_grammar_cache_t *grammars;      /* compiled grammars by hash (node.grammar_cache_bytes) */
} tdm_node_runtime_t;

/* What sizes a node's KV pool (tdm_node_size_pool). Bytes. */
typedef struct tdm_node_sizing {
    const char *node_id;           /* for the messages */
    tdm_kv_layout_t layout;        /* the served model's KV layout */
    uint32_t n_ctx;                /* tokens of one full-context sequence */
    uint64_t weight_bytes;         /* weights in the budget's memory (device copies on cuda) */
    uint64_t scratch_bytes;        /* engine scratch in that memory */
    uint64_t memory_budget;        /* node.memory_budget; 0: gpu_memory_utilization */
    bool on_device;                /* a cuda:N node: the figures below count */
    int device_index;              /* N */
    double gpu_memory_utilization; /* (0, 1] when memory_budget is 0 */
    uint64_t device_total_bytes;   /* the device's memory (cudaMemGetInfo) */
    uint64_t device_free_bytes;    /* free on it at start */
    uint64_t host_memory_bytes;    /* a cpu node's memory: the host's, or its cgroup's limit
                                      where lower (tdm_node_host_memory); 0: not checked */
    const tdm_kv_groups_t *groups; /* the layer groups the node allocates per
                                      (tdm_node_kv_groups), NULL: every block holds every
                                      layer */
} tdm_node_sizing_t;

/* The pool tdm_node_size_pool chose. */
typedef struct tdm_node_pool_size {
    uint64_t budget_bytes; /* memory_budget, or floor(gpu_memory_utilization x total) */
    uint64_t block_bytes;  /* tdm_kv_block_bytes(layout), with groups of tdm_kv_group_layout */
    uint32_t n_blocks;     /* tdm_kv_plan's pool_blocks, capped at 2^32 - 2 */
} tdm_node_pool_size_t;

/* Sizes a node's KV pool: budget = memory_budget, or on a device node without one
 * floor(gpu_memory_utilization x device_total_bytes); a device node's budget must be at most
 * device_free_bytes (two nodes on one GPU each take a share, e.g. 0.4). Blocks =
 * tdm_kv_plan's pool_blocks for that budget after weight_bytes + scratch_bytes (the same
 * arithmetic as `tandem kvcalc`); with in->groups, blocks of one group's layers and a
 * full-context sequence of tdm_kv_groups_blocks_per_seq of them. A cpu node's memory_budget
 * must be at most host_memory_bytes where that is known (a budget past the host's memory
 * would only fail later, or be taken by the kernel's OOM killer). Pure: the device and host
 * figures are given, not queried.
 * Errors (*out zeroed, message in *err with every figure in bytes: total, free, budget,
 * weights, scratch, blocks, one full-context sequence, the budget needed): TDM_ERESOURCE when
 * the budget exceeds the free memory (or a cpu node's, the host memory) or holds less than one
 * full-context sequence of KV; TDM_EINVALID for a bad layout or utilization (tdm_kv_plan's
 * message). */
int tdm_node_size_pool(const tdm_node_sizing_t *in, tdm_node_pool_size_t *out, tdm_error_t *err);

/* The memory an engine for model (borrowed) with params ep takes besides its KV pool, measured
 * by creating one over a one-block pool of layout (what a node does before sizing its pool,
 * and what `tandem kvcalc -m` reports): on the CPU (on_device false), *weight_bytes is the
 * model's tensor bytes less those the engine repacked and released the file's pages of
 * (tdm_engine_released_weight_bytes), and *scratch_bytes the engine's scratch, repacked copies
 * included (tdm_engine_scratch_bytes), plus the worker's prompt-logprobs reserve
 * (tdm_worker_plp_reserve of ep->n_ctx); on a device, the engine's device figures
 * (tdm_engine_device_bytes). Costs what creating the engine costs (the repack). Errors: those
 * of tdm_kv_pool_new and tdm_engine_new (TDM_EINVALID, TDM_ERESOURCE, ...), message in *err. */
int tdm_node_measure_engine(const tdm_model_t *model, const tdm_kv_layout_t *layout,
                            const tdm_engine_params_t *ep, bool on_device, uint64_t *weight_bytes,
                            uint64_t *scratch_bytes, tdm_error_t *err);

/* Whether node allocates its KV per layer group of a model with sliding-window layers
 * (tandem/kv.h "layer groups": a window layer keeps only its window's blocks), and those groups
 * in *groups when so: a node (prefill or decode) on the CPU whose model has no CUDA node in the
 * config. The CUDA engine reads one table of every layer, and KV travels (transfer from a
 * prefill node, migration) only between pools that allocate alike (the receiver refuses
 * another group layout) and only between nodes of one model, so a CUDA node makes every node
 * of its model allocate every layer and other models' nodes do not count. The model's layer windows
 * come from hp (tdm_llama_layer_window); a model without windows allocates the plain way
 * (false). The one rule for the node's pool, its sizing, `tandem kvcalc` and the dashboard.
 * Cannot fail. */
bool tdm_node_kv_groups(const tdm_config_t *cfg, const tdm_node_config_t *node,
                        const tdm_llama_hparams_t *hp, tdm_kv_groups_t *groups);

/* The layer groups of a model's windows (tdm_kv_groups_init over tdm_llama_layer_window of
 * every layer); false for a model without sliding-window layers or a layer count out of range
 * (then one plain group). Cannot fail. */
bool tdm_model_kv_groups(const tdm_llama_hparams_t *hp, tdm_kv_groups_t *groups);

/* The memory a cpu node's budget may use, in bytes: the host's physical memory
 * (sysconf _SC_PHYS_PAGES x _SC_PAGESIZE), or the cgroup v2 limit (/sys/fs/cgroup/memory.max)
 * where that is lower, as in a container with a memory limit. 0 when neither can be read.
 * Cannot fail. */
uint64_t tdm_node_host_memory(void);

/* This host's id for transport choice: /proc/sys/kernel/random/boot_id without its newline
 * into buf (cap >= 37), "" when it cannot be read (a node on another OS: then no pair is
 * on the same host). Cannot fail. */
void tdm_node_host_id(char *buf, size_t cap);

/* Opens the runtime of node `node` of cluster cfg: loads its CURVE keys (tdm_node_keys_open,
 * first, so that a bad key file fails at once), loads the node's model (tdm_config_node_model),
 * sizes the KV pool as (budget - weight bytes - engine scratch bytes) / block bytes
 * (tdm_node_size_pool: the same sizing function as `tandem kvcalc`; on device cuda:N the budget is
 * in device memory, the engine's backend is cuda on device N, and weights and scratch are the
 * engine's device figures), creates the engine (node->threads, node->max_batch_tokens rows,
 * node->max_running logit rows), the grammar vocabulary and cache (structured output) and a worker
 * in `mode`. Errors (*err, message with the numbers): TDM_ENOTFOUND (model file), TDM_EINVALID
 * (model, config), TDM_ERESOURCE when the budget does not hold the weights plus one full-context
 * sequence (n_ctx tokens of KV), or a device budget exceeds its free memory, or out of
 * memory; TDM_EPRECONDITION for a cuda device in a build without CUDA (the message names the
 * build); TDM_EUNAVAILABLE / TDM_EINVALID for a device the CUDA runtime cannot use or does
 * not have. On error nothing is left to close. */
/* What tdm_node_runtime_open would decide about a CPU node's memory without keeping anything:
 * loads the model, measures the engine and sizes the pool from memory_budget exactly as the
 * node does at start (no keys, grammars or worker), then frees it all; *kv_bytes = the KV pool
 * the node would get. For `tandem config check`. Errors as tdm_node_runtime_open's (the
 * TDM_ERESOURCE message names memory_budget and the bytes it must reach);
 * TDM_EPRECONDITION without a check for a cuda node (its budget is device memory, known only
 * on the machine that has the device). */
int tdm_node_runtime_check(const tdm_config_t *cfg, const tdm_node_config_t *node,
                           tdm_worker_mode_t mode, uint64_t *kv_bytes, tdm_error_t *err);

int tdm_node_runtime_open(tdm_node_runtime_t *rt, const tdm_config_t *cfg,
                          const tdm_node_config_t *node, tdm_worker_mode_t mode, tdm_error_t *err);

/* Frees everything the runtime holds; zeroes it. NULL-safe. */
void tdm_node_runtime_close(tdm_node_runtime_t *rt);

/* The node `node_id` of cfg, or (node_id NULL) its first node of `role`. NULL with *err:
 * TDM_ENOTFOUND (no such node; the message lists the ids of that role), TDM_EINVALID (the
 * node has another role). */
const tdm_node_config_t *tdm_node_pick(const tdm_config_t *cfg, const char *node_id,
                                       tdm_node_role_t role, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_RUNTIME_H */
