/* responses_store.h - the HTTP gateway's store of Responses API answers (/v1/responses with
 * store true): what previous_response_id continues and GET /v1/responses/{id} returns.
 *
 * Bounded in memory, one per router process (router.responses_store_max entries,
 * router.responses_store_bytes bytes in all); when a new entry does not fit, the least recently
 * used ones are evicted first. Ids are local to the router that made them: another router of
 * the same pool has never seen them (docs/operations.md "Several routers"). Thread-safe: the
 * gateway's HTTP threads share it under its own mutex.
 */
#ifndef TANDEM_ROUTER_RESPONSES_STORE_H
#define TANDEM_ROUTER_RESPONSES_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct resp_store resp_store_t;

/* What the store holds and has done, for the docs' limits and the tests. */
typedef struct resp_store_stats {
    size_t count;     /* entries held */
    uint64_t bytes;   /* their bytes (id, response and conversation text) */
    uint64_t evicted; /* entries evicted to make room, since start */
} resp_store_stats_t;

/* A store of at most max_count entries and max_bytes bytes (max_count 0: nothing is stored).
 * Returns NULL on out of memory. Caller frees with resp_store_destroy. */
resp_store_t *resp_store_new(size_t max_count, uint64_t max_bytes);

/* Frees the store and every entry. NULL-safe, nulls *self_p. */
void resp_store_destroy(resp_store_t **self_p);

/* Stores copies of the response object's JSON text and of the conversation it ends (the JSON
 * array of its input and output items, with those of the responses it continues) under id,
 * replacing an entry of the same id; least recently used entries are evicted until it fits.
 * Returns 0; TDM_ERESOURCE on out of memory; TDM_EINVALID when the entry alone is larger than
 * the byte limit or the store holds no entries (it is not stored). */
int resp_store_put(resp_store_t *s, const char *id, const char *response, const char *conversation);

/* Copies of the entry id's texts into *response and *conversation (either may be NULL when not
 * wanted; caller frees with free), marking it recently used. Returns 0, TDM_ENOTFOUND (never
 * stored here, evicted or deleted) or TDM_ERESOURCE. */
int resp_store_get(resp_store_t *s, const char *id, char **response, char **conversation);

/* Deletes the entry id. Returns true when there was one. */
bool resp_store_delete(resp_store_t *s, const char *id);

/* The store's counts now. Cannot fail. */
resp_store_stats_t resp_store_stats(resp_store_t *s);

#endif /* TANDEM_ROUTER_RESPONSES_STORE_H */
