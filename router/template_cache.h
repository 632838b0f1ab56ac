/* template_cache.h - the router's cache of compiled request chat templates (template_cache.c):
 * a request's chat_template is compiled once per distinct text and reused while it stays among
 * the RT_TEMPLATE_CACHE_SIZE most recently used. The model's own template is compiled once at
 * start (tdm_chat_template_pick) and never goes through here. Used on the router thread only.
 */
#ifndef TANDEM_ROUTER_TEMPLATE_CACHE_H
#define TANDEM_ROUTER_TEMPLATE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/jinja.h"

#define RT_TEMPLATE_CACHE_SIZE 8 /* distinct request templates kept compiled */

/* One compiled template, keyed by its text's XXH3 hash and checked byte for byte. */
typedef struct rt_template_entry {
    uint64_t hash;  /* XXH3_64bits of the source */
    char *src;      /* the source (heap, len bytes); NULL: the slot is free */
    size_t len;     /* bytes of src */
    tdm_jinja_t *t; /* the compiled template (owned) */
    uint64_t used;  /* the cache's clock at the last hit: the least recent is evicted */
} rt_template_entry_t;

typedef struct rt_template_cache {
    rt_template_entry_t slot[RT_TEMPLATE_CACHE_SIZE];
    uint64_t clock;    /* lookups so far */
    uint64_t compiles; /* templates compiled (misses), for tests and logs */
} rt_template_cache_t;

/* The compiled template of len bytes of src: from the cache, or compiled
 * (tdm_chat_jinja_compile) and cached, evicting the least recently used. The template is
 * borrowed: valid until the next call or rt_template_cache_fini. Returns NULL with *err set:
 * TDM_EINVALID ("line:column: what"; more than TDM_CHAT_TEMPLATE_MAX_BYTES), TDM_ERESOURCE. */
const tdm_jinja_t *rt_template_cache_get(rt_template_cache_t *c, const char *src, size_t len,
                                         tdm_error_t *err);

/* Frees every cached template; the cache is empty (and usable) after. Accepts NULL. */
void rt_template_cache_fini(rt_template_cache_t *c);

#endif
