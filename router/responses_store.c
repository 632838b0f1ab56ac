/* responses_store.c - the bounded in-memory store of Responses API answers (responses_store.h):
 * a hash table of entries (XXH3 of the id, chained) on a doubly linked list in recency order,
 * the least recently used at the tail, evicted first.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "responses_store.h"
#include "tandem/base.h"

typedef struct resp_entry {
    struct resp_entry *next_hash;       /* the bucket's chain */
    struct resp_entry *newer, *older;   /* the recency list */
    char *id, *response, *conversation; /* one allocation: id, then the two texts */
    uint64_t bytes;                     /* the allocation's size */
} resp_entry_t;

struct resp_store {
    pthread_mutex_t mu;
    resp_entry_t **buckets; /* [n_buckets], a power of two */
    size_t n_buckets;
    resp_entry_t *newest, *oldest;
    size_t max_count, count;
    uint64_t max_bytes, bytes, evicted;
};

resp_store_t *resp_store_new(size_t max_count, uint64_t max_bytes)
{
    resp_store_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    size_t n = 16;
    while (n < max_count && n < ((size_t)1 << 20))
        n <<= 1;
    s->buckets = calloc(n, sizeof *s->buckets);
    if (!s->buckets) {
        free(s);
        return NULL;
    }
    s->n_buckets = n;
    s->max_count = max_count;
    s->max_bytes = max_bytes;
    pthread_mutex_init(&s->mu, NULL);
    return s;
}

void resp_store_destroy(resp_store_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    resp_store_t *s = *self_p;
    for (resp_entry_t *e = s->newest, *next; e; e = next) {
        next = e->older;
        free(e->id);
        free(e);
    }
    free(s->buckets);
    pthread_mutex_destroy(&s->mu);
    free(s);
    *self_p = NULL;
}

static resp_entry_t **bucket_of(resp_store_t *s, const char *id)
{
    return &s->buckets[XXH3_64bits(id, strlen(id)) & (s->n_buckets - 1)];
}

/* The entry id, or NULL; under mu. */
static resp_entry_t *find(resp_store_t *s, const char *id)
{
    for (resp_entry_t *e = *bucket_of(s, id); e; e = e->next_hash)
        if (strcmp(e->id, id) == 0)
            return e;
    return NULL;
}

static void list_unlink(resp_store_t *s, resp_entry_t *e)
{
    if (e->newer)
        e->newer->older = e->older;
    else
        s->newest = e->older;
    if (e->older)
        e->older->newer = e->newer;
    else
        s->oldest = e->newer;
    e->newer = e->older = NULL;
}

static void list_push(resp_store_t *s, resp_entry_t *e)
{
    e->older = s->newest;
    e->newer = NULL;
    if (s->newest)
        s->newest->newer = e;
    s->newest = e;
    if (!s->oldest)
        s->oldest = e;
}

/* Takes e out of the table and the list and frees it; under mu. */
static void drop(resp_store_t *s, resp_entry_t *e)
{
    for (resp_entry_t **p = bucket_of(s, e->id); *p; p = &(*p)->next_hash)
        if (*p == e) {
            *p = e->next_hash;
            break;
        }
    list_unlink(s, e);
    s->count--;
    s->bytes -= e->bytes;
    free(e->id);
    free(e);
}

int resp_store_put(resp_store_t *s, const char *id, const char *response, const char *conversation)
{
    size_t n_id = strlen(id) + 1, n_resp = strlen(response) + 1, n_conv = strlen(conversation) + 1;
    uint64_t bytes = (uint64_t)n_id + n_resp + n_conv;
    if (s->max_count == 0 || bytes > s->max_bytes)
        return TDM_EINVALID;
    resp_entry_t *e = calloc(1, sizeof *e);
    char *text = malloc(n_id + n_resp + n_conv);
    if (!e || !text) {
        free(e);
        free(text);
        return TDM_ERESOURCE;
    }
    memcpy(text, id, n_id);
    memcpy(text + n_id, response, n_resp);
    memcpy(text + n_id + n_resp, conversation, n_conv);
    e->id = text;
    e->response = text + n_id;
    e->conversation = text + n_id + n_resp;
    e->bytes = bytes;
    pthread_mutex_lock(&s->mu);
    resp_entry_t *old = find(s, id);
    if (old)
        drop(s, old);
    while (s->oldest && (s->count + 1 > s->max_count || s->bytes + bytes > s->max_bytes)) {
        drop(s, s->oldest);
        s->evicted++;
    }
    resp_entry_t **b = bucket_of(s, id);
    e->next_hash = *b;
    *b = e;
    list_push(s, e);
    s->count++;
    s->bytes += bytes;
    pthread_mutex_unlock(&s->mu);
    return TDM_OK;
}

int resp_store_get(resp_store_t *s, const char *id, char **response, char **conversation)
{
    if (response)
        *response = NULL;
    if (conversation)
        *conversation = NULL;
    pthread_mutex_lock(&s->mu);
    resp_entry_t *e = find(s, id);
    int rc = e ? TDM_OK : TDM_ENOTFOUND;
    if (e) {
        list_unlink(s, e);
        list_push(s, e);
        if (response && !(*response = strdup(e->response)))
            rc = TDM_ERESOURCE;
        if (conversation && !(*conversation = strdup(e->conversation)))
            rc = TDM_ERESOURCE;
    }
    pthread_mutex_unlock(&s->mu);
    if (rc == TDM_ERESOURCE) {
        if (response) {
            free(*response);
            *response = NULL;
        }
        if (conversation) {
            free(*conversation);
            *conversation = NULL;
        }
    }
    return rc;
}

bool resp_store_delete(resp_store_t *s, const char *id)
{
    pthread_mutex_lock(&s->mu);
    resp_entry_t *e = find(s, id);
    if (e)
        drop(s, e);
    pthread_mutex_unlock(&s->mu);
    return e != NULL;
}

resp_store_stats_t resp_store_stats(resp_store_t *s)
{
    pthread_mutex_lock(&s->mu);
    resp_store_stats_t st = {s->count, s->bytes, s->evicted};
    pthread_mutex_unlock(&s->mu);
    return st;
}
