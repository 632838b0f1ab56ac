/* heap.c - the router's min-heap of embedded entries (heap.h): an array in level order. */
#include <stdint.h>
#include <stdlib.h>

#include "heap.h"
#include "tandem/base.h"

void rt_heap_init(rt_heap_t *h)
{
    h->v = NULL;
    h->n = h->cap = 0;
}

void rt_heap_fini(rt_heap_t *h)
{
    if (!h)
        return;
    free(h->v);
    rt_heap_init(h);
}

void rt_heap_entry_init(rt_heap_entry_t *e)
{
    e->key = 0;
    e->pos = SIZE_MAX;
}

bool rt_heap_contains(const rt_heap_entry_t *e)
{
    return e->pos != SIZE_MAX;
}

static void place(rt_heap_t *h, size_t i, rt_heap_entry_t *e)
{
    h->v[i] = e;
    e->pos = i;
}

/* Moves e (at i) towards the root while its parent's key is larger. */
static void sift_up(rt_heap_t *h, size_t i, rt_heap_entry_t *e)
{
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (h->v[parent]->key <= e->key)
            break;
        place(h, i, h->v[parent]);
        i = parent;
    }
    place(h, i, e);
}

/* Moves e (at i) towards the leaves while a child's key is smaller. */
static void sift_down(rt_heap_t *h, size_t i, rt_heap_entry_t *e)
{
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && h->v[c + 1]->key < h->v[c]->key)
            c++;
        if (e->key <= h->v[c]->key)
            break;
        place(h, i, h->v[c]);
        i = c;
    }
    place(h, i, e);
}

int rt_heap_push(rt_heap_t *h, rt_heap_entry_t *e, uint64_t key)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        rt_heap_entry_t **v = realloc(h->v, cap * sizeof *v);
        if (!v)
            return TDM_ERESOURCE;
        h->v = v;
        h->cap = cap;
    }
    e->key = key;
    sift_up(h, h->n++, e);
    return TDM_OK;
}

void rt_heap_remove(rt_heap_t *h, rt_heap_entry_t *e)
{
    if (e->pos == SIZE_MAX)
        return;
    TDM_ASSERT(e->pos < h->n && h->v[e->pos] == e);
    size_t i = e->pos;
    rt_heap_entry_t *last = h->v[--h->n];
    e->pos = SIZE_MAX;
    if (last == e)
        return;
    /* the last entry fills the hole: it may belong above or below it */
    if (i > 0 && last->key < h->v[(i - 1) / 2]->key)
        sift_up(h, i, last);
    else
        sift_down(h, i, last);
}

rt_heap_entry_t *rt_heap_top(const rt_heap_t *h)
{
    return h->n ? h->v[0] : NULL;
}
