/* index.h - the router's hash index: objects found by a key in O(1), through an entry
 * embedded in each object (no allocation per insert).
 *
 * The index stores hashes, not keys: a lookup walks the entries whose 64-bit hash equals the
 * key's (rt_index_first / rt_index_next) and the caller compares its own key, so an object may
 * be indexed by any bytes it holds (the request id, the client's routing id and call id) and
 * several objects may share a key. Hashes are XXH3_64bits (xxHash; rt_index_hash). Chains are
 * kept newest first. Not thread-safe.
 */
#ifndef TANDEM_ROUTER_INDEX_H
#define TANDEM_ROUTER_INDEX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Embedded in an indexed object; the index owns both fields while the object is in it. */
typedef struct rt_index_entry {
    struct rt_index_entry *next; /* next entry of the same bucket */
    uint64_t hash;               /* the key's rt_index_hash */
} rt_index_entry_t;

typedef struct rt_index {
    rt_index_entry_t **buckets; /* [mask + 1] chains, newest first */
    size_t mask;                /* buckets - 1 (a power of two minus one) */
    size_t n;                   /* entries in the index */
} rt_index_t;

/* XXH3_64bits of key[len] with seed (0 for a plain key). Cannot fail. */
uint64_t rt_index_hash(const void *key, size_t len, uint64_t seed);

/* Makes an empty index of at least min_buckets buckets (rounded up to a power of two, at least
 * 16). Returns 0, or TDM_ERESOURCE (out of memory; *ix is then empty and safe to fini). */
int rt_index_init(rt_index_t *ix, size_t min_buckets);

/* Frees the buckets (not the objects). NULL-safe; leaves *ix empty. */
void rt_index_fini(rt_index_t *ix);

/* Adds e (not in the index) under hash. Doubles the buckets when there are more entries than
 * buckets; when that runs out of memory the index keeps its buckets (longer chains). Cannot
 * fail. */
void rt_index_insert(rt_index_t *ix, rt_index_entry_t *e, uint64_t hash);

/* Removes e (in the index). Cannot fail. */
void rt_index_remove(rt_index_t *ix, rt_index_entry_t *e);

/* The newest entry with this hash, or NULL. */
rt_index_entry_t *rt_index_first(const rt_index_t *ix, uint64_t hash);

/* The next (older) entry with e's hash after e, or NULL. */
rt_index_entry_t *rt_index_next(const rt_index_entry_t *e);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_ROUTER_INDEX_H */
