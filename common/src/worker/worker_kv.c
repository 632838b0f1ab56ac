/* worker_kv.c - a worker sequence's KV block tables: one table over a plain pool (tdm_kv_seq_*),
 * one per layer group over a pool with layer groups (tdm_kv_hseq_*, tandem/kv.h "layer
 * groups"), whose sliding-window groups give back the blocks no later query reads. The rest of
 * the worker goes through these calls and never asks which. */
#include "worker_internal.h"

#include <string.h>

bool tdm_worker_kv_prepare(tdm_worker_t *w, wseq_t *s, uint32_t cap)
{
    if (!w->groups)
        return tdm_kv_seq_prepare(w->pool, &s->kv, cap) == TDM_OK;
    if (!s->hkv.tab && tdm_kv_hseq_init(&s->hkv, w->groups, NULL) != TDM_OK)
        return false;
    if (tdm_kv_hseq_prepare(w->pool, &s->hkv, cap) != TDM_OK) {
        tdm_kv_hseq_release(w->pool, &s->hkv);
        return false;
    }
    return true;
}

uint32_t tdm_worker_kv_entries(const tdm_worker_t *w, const wseq_t *s)
{
    if (!w->groups)
        return s->kv.n_blocks;
    return s->hkv.tab ? s->hkv.tab[0].n_blocks : 0;
}

uint32_t tdm_worker_kv_held(const tdm_worker_t *w, const wseq_t *s)
{
    return w->groups ? (uint32_t)tdm_kv_hseq_held(&s->hkv) : s->kv.n_blocks;
}

uint32_t tdm_worker_kv_cost(const tdm_worker_t *w, const wseq_t *s, uint32_t n_tokens)
{
    uint32_t need = (uint32_t)tdm_kv_blocks_for_tokens(tdm_kv_pool_layout(w->pool), n_tokens);
    uint32_t have = tdm_worker_kv_entries(w, s);
    return (need > have ? need - have : 0) * (w->groups ? w->groups->n_groups : 1);
}

uint32_t tdm_worker_kv_match_prefix(tdm_worker_t *w, wseq_t *s)
{
    if (!w->groups)
        return tdm_kv_seq_match_prefix(w->pool, &s->kv, s->tokens, s->n_tokens);
    /* s->n_tokens <= n_ctx, what the scratch was sized for */
    return tdm_kv_hseq_match_prefix_with(w->pool, &s->hkv, s->tokens, s->n_tokens,
                                         w->match_scratch);
}

void tdm_worker_kv_clear(tdm_worker_t *w, wseq_t *s)
{
    if (w->groups)
        tdm_kv_hseq_clear(w->pool, &s->hkv);
    else
        tdm_kv_seq_clear(w->pool, &s->kv);
}

void tdm_worker_kv_release(tdm_worker_t *w, wseq_t *s)
{
    if (w->groups)
        tdm_kv_hseq_release(w->pool, &s->hkv);
    tdm_kv_seq_release(w->pool, &s->kv);
}

/* Gives back table t's entries past keep (never below its given-back ones). */
static void trim_table(tdm_kv_pool_t *pool, tdm_kv_seq_t *t, uint32_t keep)
{
    while (t->n_blocks > keep && t->n_blocks > t->n_dropped)
        tdm_kv_pool_unref(pool, t->blocks[--t->n_blocks]);
    if (t->n_blocks > keep) /* only given-back entries left past keep */
        t->n_blocks = t->n_dropped = keep;
}

void tdm_worker_kv_trim(tdm_worker_t *w, wseq_t *s, uint32_t keep)
{
    if (!w->groups) {
        trim_table(w->pool, &s->kv, keep);
        return;
    }
    for (uint32_t gi = 0; gi < w->groups->n_groups; gi++)
        trim_table(w->pool, &s->hkv.tab[gi], keep);
}

uint32_t tdm_worker_kv_share(tdm_worker_t *w, wseq_t *s, const wseq_t *p, uint32_t k)
{
    const uint32_t bs = tdm_kv_pool_layout(w->pool)->block_size;
    uint64_t h = TDM_KV_HASH_SEED;
    for (uint32_t i = 0; i < k; i++)
        h = tdm_kv_block_hash(h, p->tokens + (size_t)i * bs, bs);
    if (!w->groups) {
        for (uint32_t i = 0; i < k; i++) {
            s->kv.blocks[i] = p->kv.blocks[i];
            tdm_kv_pool_ref(w->pool, p->kv.blocks[i]);
        }
        s->kv.n_blocks = s->kv.n_hashed = k;
        s->kv.last_hash = k > 0 ? h : 0;
        s->kv.n_tokens = k * bs;
        return k * bs;
    }
    const tdm_kv_groups_t *g = w->groups;
    for (uint32_t gi = 0; gi < g->n_groups; gi++)
        if (p->hkv.tab[gi].n_blocks < k ||
            p->hkv.tab[gi].n_dropped > tdm_kv_group_first_needed(g, gi, bs, (uint64_t)k * bs))
            return 0; /* the parent gave back a block the fork's first query reads */
    if (k == 0)
        return 0;
    for (uint32_t gi = 0; gi < g->n_groups; gi++) {
        tdm_kv_seq_t *t = &s->hkv.tab[gi];
        uint32_t first = (uint32_t)tdm_kv_group_first_needed(g, gi, bs, (uint64_t)k * bs);
        for (uint32_t i = 0; i < k; i++) {
            t->blocks[i] = i < first ? TDM_KV_NO_BLOCK : p->hkv.tab[gi].blocks[i];
            if (i >= first)
                tdm_kv_pool_ref(w->pool, t->blocks[i]);
        }
        t->n_blocks = k;
        t->n_dropped = first;
    }
    s->hkv.n_tokens = k * bs;
    s->hkv.n_hashed = k;
    s->hkv.last_hash = h;
    return k * bs;
}

tdm_batch_seq_t tdm_worker_kv_view(tdm_worker_t *w, const wseq_t *s, uint32_t k)
{
    if (!w->groups)
        return (tdm_batch_seq_t){s->kv.blocks, s->kv.n_blocks, NULL};
    const uint32_t **gb = w->b_gb + (size_t)k * w->groups->n_groups;
    for (uint32_t gi = 0; gi < w->groups->n_groups; gi++)
        gb[gi] = s->hkv.tab[gi].blocks;
    return (tdm_batch_seq_t){NULL, s->hkv.tab[0].n_blocks, gb};
}
