/* heap.h - the router's binary min-heap of embedded entries by a 64-bit key (the request
 * deadlines: the earliest is found in O(1), added or removed in O(log n)).
 *
 * Each entry remembers its position, so any entry can be removed, not only the top. Entries
 * with equal keys come out in no particular order. Not thread-safe.
 */
#ifndef TANDEM_ROUTER_HEAP_H
#define TANDEM_ROUTER_HEAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Embedded in an object on the heap; the heap owns both fields. Initialise with
 * rt_heap_entry_init before the first push. */
typedef struct rt_heap_entry {
    uint64_t key; /* smaller comes first */
    size_t pos;   /* index in the heap's array; SIZE_MAX when not on a heap */
} rt_heap_entry_t;

typedef struct rt_heap {
    rt_heap_entry_t **v; /* [cap], v[0] the smallest key; v[i]'s children are 2i+1, 2i+2 */
    size_t n, cap;
} rt_heap_t;

/* An empty heap (nothing allocated until the first push). Cannot fail. */
void rt_heap_init(rt_heap_t *h);

/* Frees the array (not the entries). NULL-safe; leaves *h empty. */
void rt_heap_fini(rt_heap_t *h);

/* Marks e as on no heap. Cannot fail. */
void rt_heap_entry_init(rt_heap_entry_t *e);

/* True when e is on a heap. */
bool rt_heap_contains(const rt_heap_entry_t *e);

/* Adds e (on no heap) with key. Returns 0, or TDM_ERESOURCE (out of memory: e stays off). */
int rt_heap_push(rt_heap_t *h, rt_heap_entry_t *e, uint64_t key);

/* Removes e from h; does nothing when e is on no heap. Cannot fail. */
void rt_heap_remove(rt_heap_t *h, rt_heap_entry_t *e);

/* The entry with the smallest key, or NULL when h is empty. */
rt_heap_entry_t *rt_heap_top(const rt_heap_t *h);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_ROUTER_HEAP_H */
