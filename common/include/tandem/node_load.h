/* node_load.h - a node's load and its own counters (NodeLoad on the wire): filled once on the
 * node from its worker and pool, sent in every heartbeat and NODE_STATUS answer, and read as
 * this one struct by the router's node record, admission, ClusterStatus and /metrics. */
#ifndef TANDEM_NODE_LOAD_H
#define TANDEM_NODE_LOAD_H

#include <stdint.h>

#include "tandem/kv.h"
#include "tandem/proto.h"
#include "tandem/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A node's load (NodeLoad): gauges are the node's now, counters run since its process started.
 * Filled on the engine thread by tdm_node_load_collect; the link adds the process figures and
 * stale_router_frames, which are its own. */
typedef struct tdm_node_load {
    uint32_t kv_blocks_free, kv_blocks_used, kv_blocks_cached;
    uint32_t running, waiting;
    uint64_t queued_prefill_tokens;
    double step_s;              /* last forward pass, seconds */
    uint32_t batch_size;        /* sequences in the last forward pass */
    double decode_step_s;       /* last pass of decode rows only, seconds (0: none yet) */
    uint32_t decode_batch_size; /* sequences in it */
    uint64_t prefix_queries, prefix_hits;
    /* forward passes by tokens since the node started (tdm_worker_stats_t's) */
    uint64_t iteration_counts[TDM_WORKER_ITERATION_BUCKETS];
    uint64_t iteration_tokens;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens; /* tdm_worker_stats_t's */
    uint64_t process_resident_bytes; /* the node process's (tdm_process_stats; 0: unknown) */
    double process_cpu_seconds;      /* user + system */
    uint32_t process_open_fds;
    uint64_t stale_router_frames; /* frames of another router instance the link dropped */
} tdm_node_load_t;

/* Fills *out from a worker and pool (the process figures and stale_router_frames 0). Cannot
 * fail. */
void tdm_node_load_collect(const tdm_worker_t *w, const tdm_kv_pool_t *pool, tdm_node_load_t *out);

/* Adds the calling process's own figures (tdm_process_stats) to *l; leaves them as they are
 * when they cannot be read. Cannot fail. */
void tdm_node_load_process(tdm_node_load_t *l);

/* Fills m (initialised here) from *l. m->iteration_tokens_counts points into l, so m is valid
 * while l is. Cannot fail. */
void tdm_node_load_to_proto(const tdm_node_load_t *l, Tandem__V1__NodeLoad *m);

/* Copies m into *l; a NULL m (a message without a load) reads as all zeros, and an
 * iteration_tokens_counts of another length than TDM_WORKER_ITERATION_BUCKETS as zeros (the
 * router then adds nothing to its histogram). Cannot fail. */
void tdm_node_load_from_proto(const Tandem__V1__NodeLoad *m, tdm_node_load_t *l);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_LOAD_H */
