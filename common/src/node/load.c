/* load.c - a node's load (tdm_node_load_t, NodeLoad on the wire): filled from its worker and
 * pool, and converted to and from the message once for every sender and reader. */
#include <string.h>

#include "tandem/node_load.h"
#include "tandem/process.h"

void tdm_node_load_collect(const tdm_worker_t *w, const tdm_kv_pool_t *pool, tdm_node_load_t *out)
{
    tdm_worker_stats_t ws;
    tdm_worker_stats(w, &ws);
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(pool, &ks);
    memset(out, 0, sizeof *out);
    out->kv_blocks_free = ks.n_free;
    out->kv_blocks_used = ks.n_used;
    out->kv_blocks_cached = ks.n_cached;
    out->running = ws.running;
    out->waiting = ws.waiting;
    out->queued_prefill_tokens = ws.queued_prefill_tokens;
    out->step_s = ws.last_step_s;
    out->batch_size = ws.batch_size;
    out->decode_step_s = ws.decode_step_s;
    out->decode_batch_size = ws.decode_batch_size;
    out->prefix_queries = ks.prefix_queries;
    out->prefix_hits = ks.prefix_hits;
    memcpy(out->iteration_counts, ws.iteration_counts, sizeof out->iteration_counts);
    out->iteration_tokens = ws.iteration_tokens;
    out->spec_drafts = ws.spec_drafts;
    out->spec_draft_tokens = ws.spec_draft_tokens;
    out->spec_accepted_tokens = ws.spec_accepted_tokens;
}

void tdm_node_load_process(tdm_node_load_t *l)
{
    tdm_process_stats_t ps;
    if (!tdm_process_stats(&ps))
        return;
    l->process_resident_bytes = ps.resident_bytes;
    l->process_cpu_seconds = ps.cpu_seconds;
    l->process_open_fds = ps.open_fds;
}

void tdm_node_load_to_proto(const tdm_node_load_t *l, Tandem__V1__NodeLoad *m)
{
    tandem__v1__node_load__init(m);
    m->kv_blocks_free = l->kv_blocks_free;
    m->kv_blocks_used = l->kv_blocks_used;
    m->kv_blocks_cached = l->kv_blocks_cached;
    m->running = l->running;
    m->waiting = l->waiting;
    m->queued_prefill_tokens = l->queued_prefill_tokens;
    m->step_s = l->step_s;
    m->batch_size = l->batch_size;
    m->decode_step_s = l->decode_step_s;
    m->decode_batch_size = l->decode_batch_size;
    m->prefix_queries = l->prefix_queries;
    m->prefix_hits = l->prefix_hits;
    m->spec_draft_tokens = l->spec_draft_tokens;
    m->spec_accepted_tokens = l->spec_accepted_tokens;
    m->spec_drafts = l->spec_drafts;
    m->n_iteration_tokens_counts = TDM_WORKER_ITERATION_BUCKETS;
    m->iteration_tokens_counts = (uint64_t *)(uintptr_t)l->iteration_counts;
    m->iteration_tokens_sum = l->iteration_tokens;
    m->process_resident_bytes = l->process_resident_bytes;
    m->process_cpu_seconds = l->process_cpu_seconds;
    m->process_open_fds = l->process_open_fds;
    m->stale_router_frames = l->stale_router_frames;
}

void tdm_node_load_from_proto(const Tandem__V1__NodeLoad *m, tdm_node_load_t *l)
{
    memset(l, 0, sizeof *l);
    if (!m)
        return;
    l->kv_blocks_free = m->kv_blocks_free;
    l->kv_blocks_used = m->kv_blocks_used;
    l->kv_blocks_cached = m->kv_blocks_cached;
    l->running = m->running;
    l->waiting = m->waiting;
    l->queued_prefill_tokens = m->queued_prefill_tokens;
    l->step_s = m->step_s;
    l->batch_size = m->batch_size;
    l->decode_step_s = m->decode_step_s;
    l->decode_batch_size = m->decode_batch_size;
    l->prefix_queries = m->prefix_queries;
    l->prefix_hits = m->prefix_hits;
    l->spec_draft_tokens = m->spec_draft_tokens;
    l->spec_accepted_tokens = m->spec_accepted_tokens;
    l->spec_drafts = m->spec_drafts;
    if (m->n_iteration_tokens_counts == TDM_WORKER_ITERATION_BUCKETS)
        memcpy(l->iteration_counts, m->iteration_tokens_counts, sizeof l->iteration_counts);
    l->iteration_tokens = m->iteration_tokens_sum;
    l->process_resident_bytes = m->process_resident_bytes;
    l->process_cpu_seconds = m->process_cpu_seconds;
    l->process_open_fds = m->process_open_fds;
    l->stale_router_frames = m->stale_router_frames;
}
