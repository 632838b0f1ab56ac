/* index.c - the router's hash index by key (index.h): chained buckets of embedded entries. */
#include <stdlib.h>

#include <xxhash.h>

#include "index.h"
#include "tandem/base.h"

uint64_t rt_index_hash(const void *key, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(key, len, seed);
}

int rt_index_init(rt_index_t *ix, size_t min_buckets)
{
    size_t cap = 16;
    while (cap < min_buckets)
        cap *= 2;
    ix->n = 0;
    ix->mask = 0;
    ix->buckets = calloc(cap, sizeof *ix->buckets);
    if (!ix->buckets)
        return TDM_ERESOURCE;
    ix->mask = cap - 1;
    return TDM_OK;
}

void rt_index_fini(rt_index_t *ix)
{
    if (!ix)
        return;
    free(ix->buckets);
    ix->buckets = NULL;
    ix->mask = 0;
    ix->n = 0;
}

/* Doubles the buckets. Bucket i splits into i and i + old size; each entry is appended to
 * its new chain, so both keep the newest-first order. Out of memory: nothing changes. */
static void grow(rt_index_t *ix)
{
    size_t cap = (ix->mask + 1) * 2;
    rt_index_entry_t **b = calloc(cap, sizeof *b);
    if (!b)
        return;
    for (size_t i = 0; i <= ix->mask; i++) {
        rt_index_entry_t *tails[2] = {NULL, NULL};
        for (rt_index_entry_t *e = ix->buckets[i], *nx; e; e = nx) {
            nx = e->next;
            size_t s = (size_t)e->hash & (cap - 1);
            int which = s != i;
            e->next = NULL;
            if (tails[which])
                tails[which]->next = e;
            else
                b[s] = e;
            tails[which] = e;
        }
    }
    free(ix->buckets);
    ix->buckets = b;
    ix->mask = cap - 1;
}

void rt_index_insert(rt_index_t *ix, rt_index_entry_t *e, uint64_t hash)
{
    if (ix->n + 1 > ix->mask + 1)
        grow(ix);
    e->hash = hash;
    rt_index_entry_t **head = &ix->buckets[(size_t)hash & ix->mask];
    e->next = *head;
    *head = e;
    ix->n++;
}

void rt_index_remove(rt_index_t *ix, rt_index_entry_t *e)
{
    for (rt_index_entry_t **pp = &ix->buckets[(size_t)e->hash & ix->mask]; *pp; pp = &(*pp)->next)
        if (*pp == e) {
            *pp = e->next;
            e->next = NULL;
            ix->n--;
            return;
        }
    TDM_ASSERT(!"rt_index_remove: the entry is not in the index");
}

rt_index_entry_t *rt_index_first(const rt_index_t *ix, uint64_t hash)
{
    rt_index_entry_t *e = ix->buckets[(size_t)hash & ix->mask];
    while (e && e->hash != hash)
        e = e->next;
    return e;
}

rt_index_entry_t *rt_index_next(const rt_index_entry_t *e)
{
    uint64_t hash = e->hash;
    for (e = e->next; e; e = e->next)
        if (e->hash == hash)
            return (rt_index_entry_t *)e;
    return NULL;
}
